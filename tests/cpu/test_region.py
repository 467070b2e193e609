"""SharedOffloadRegion: vLLM's layout and creator/joiner protocol, and what we add to it."""

from __future__ import annotations

import contextlib
import errno
import multiprocessing as mp
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.cpu.prefault import merge_ranges
from kvoffload.cpu.segments import plan_segments
from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion
from kvoffload.errors import (
    ConfigError,
    CreatorFailedError,
    JoinTimeoutError,
    RegionError,
    RegionReleasedError,
    RootError,
)
from kvoffload.liveness import ownership
from kvoffload.shm import owner
from tests.support import regionprocs

SHM = Path("/dev/shm")
CTX = mp.get_context("spawn")


def make(engine_id: str, rank: int | None = 0, **kwargs: object) -> SharedOffloadRegion:
    kwargs.setdefault("root", SHM)
    return SharedOffloadRegion(engine_id, 4, rank, 2 * PAGESIZE, PAGESIZE, **kwargs)  # type: ignore[arg-type]


def test_creator_names_the_file_like_vllm_with_mode_0600(engine_id: str) -> None:
    with make(engine_id) as region:
        st = os.lstat(SHM / f"vllm_offload_{engine_id}.mmap")
        assert region.creator
        assert region.path == SHM / f"vllm_offload_{engine_id}.mmap"
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == 4 * 2 * PAGESIZE


def test_creator_records_owner_and_holds_shared_lock(engine_id: str) -> None:
    import fcntl

    with make(engine_id) as region:
        record = owner.read_owner(region.path)
        assert record is not None
        assert record.pid == os.getpid()
        assert record.engine_id == engine_id
        assert ownership.judge_owner(record).alive is True
        probe = os.open(region.path, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(probe)


def test_cleanup_removes_creator_file_and_is_idempotent(engine_id: str) -> None:
    region = make(engine_id)
    region.cleanup()
    region.cleanup()
    assert not region.path.exists()
    assert region.closed
    assert region.fd is None


def test_joiner_cleanup_never_unlinks(engine_id: str) -> None:
    creator = make(engine_id, lifetime="vllm")
    joiner = make(engine_id, rank=1, lifetime="vllm", populate=False)
    try:
        assert not joiner.creator
        joiner.cleanup()
        assert creator.path.exists()
    finally:
        creator.cleanup()
    assert not creator.path.exists()


def test_joiner_sees_the_creators_bytes_across_processes(engine_id: str) -> None:
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=regionprocs.create_write_and_hold, args=(engine_id, str(SHM), child))
    proc.start()
    try:
        assert parent.poll(30)
        tag, was_creator, identity = parent.recv()
        assert (tag, was_creator) == ("ready", True)
        with SharedOffloadRegion(
            engine_id, 4, 1, 2 * PAGESIZE, PAGESIZE, root=SHM, lifetime="vllm"
        ) as joiner:
            assert not joiner.creator
            assert joiner.identity == identity
            view = joiner.create_kv_memoryview()
            assert [view[row, 0] for row in range(4)] == [0x5A] * 4
            view.release()
    finally:
        parent.send("go")
        proc.join(30)
    assert proc.exitcode == 0
    assert not (SHM / f"vllm_offload_{engine_id}.mmap").exists()


def test_race_of_processes_elects_exactly_one_creator_and_one_file(engine_id: str) -> None:
    n = 4
    pipes, procs = [], []
    for rank in range(n):
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=regionprocs.race, args=(engine_id, str(SHM), rank, n, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        assert all(p.poll(60) for p in pipes)
        results: list[tuple[bool, tuple[int, int]]] = [p.recv() for p in pipes]
        assert sum(1 for creator, _ in results if creator) == 1
        assert len({identity for _, identity in results}) == 1
        # Every participant attached: the ledger unlinked the path while all still map it.
        assert not (SHM / f"vllm_offload_{engine_id}.mmap").exists()
    finally:
        for p in pipes:
            p.send("go")
        for proc in procs:
            proc.join(30)
    assert [proc.exitcode for proc in procs] == [0] * n


def test_ledger_unlinks_once_every_expected_participant_attached(engine_id: str) -> None:
    first = make(engine_id, rank=0, participant=0, participants=2)
    try:
        assert first.path.exists()
        assert first.attached_participants() == 1
        with make(engine_id, rank=1, participant=1, participants=2) as second:
            assert not first.path.exists()
            assert second.unlinked
            # Still one shared region: a write through one mapping is seen through the other.
            a, b = first.create_kv_memoryview(), second.create_kv_memoryview()
            a[3, PAGESIZE + 7] = 42
            assert b[3, PAGESIZE + 7] == 42
            a.release()
            b.release()
    finally:
        first.cleanup()


def test_vllm_lifetime_keeps_path_until_creator_cleanup(engine_id: str) -> None:
    first = make(engine_id, rank=0, participant=0, participants=2, lifetime="vllm")
    second = make(engine_id, rank=1, participant=1, participants=2, lifetime="vllm")
    assert first.path.exists()
    second.cleanup()
    assert first.path.exists()
    first.cleanup()
    assert not first.path.exists()


def test_second_participant_with_the_same_slot_is_rejected(engine_id: str) -> None:
    with make(engine_id, participant=0, participants=3):
        with pytest.raises(RegionError, match="already attached"):
            make(engine_id, rank=1, participant=0, participants=3)
        assert (SHM / f"vllm_offload_{engine_id}.mmap").exists()


def test_cleanup_never_unlinks_a_newer_file_that_reuses_the_name(engine_id: str) -> None:
    region = make(engine_id)
    os.unlink(region.path)
    newer = os.open(region.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        region.cleanup()
        assert region.path.exists()
        assert os.fstat(newer).st_ino == os.stat(region.path).st_ino
    finally:
        os.close(newer)
        os.unlink(region.path)


def test_joiner_fails_clearly_when_kvoffload_creator_died_before_sizing(engine_id: str) -> None:
    proc = subprocess.run(
        regionprocs.crash_child_argv(engine_id, SHM),
        env=regionprocs.child_env("region.truncate=crash"),
        capture_output=True,
        timeout=60,
        check=False,
    )
    path = SHM / f"vllm_offload_{engine_id}.mmap"
    try:
        assert proc.returncode == -9
        assert path.stat().st_size == 0
        with pytest.raises(CreatorFailedError, match="died before sizing"):
            make(engine_id, rank=1, join_timeout_s=10)
    finally:
        path.unlink()


def test_joiner_of_an_unsized_vllm_file_times_out_clearly(engine_id: str) -> None:
    path = SHM / f"vllm_offload_{engine_id}.mmap"
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        with pytest.raises(JoinTimeoutError, match="timed out") as info:
            make(engine_id, join_timeout_s=0.2)
        assert isinstance(info.value, TimeoutError)
        assert info.value.fix
        assert "shmctl scan" in info.value.fix
    finally:
        path.unlink()


def test_joiner_rejects_a_region_unlinked_while_waiting(engine_id: str) -> None:
    import threading

    path = SHM / f"vllm_offload_{engine_id}.mmap"
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    joined = threading.Event()

    def joiner_has_it_open() -> bool:
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                    return True
        return False

    def unlink_once_the_joiner_waits() -> None:
        # Not sooner: the joiner would find no file and become the creator.
        while not joined.is_set():
            if joiner_has_it_open():
                path.unlink()
                return
            joined.wait(0.002)

    creator_fails = threading.Thread(target=unlink_once_the_joiner_waits)
    creator_fails.start()
    try:
        with pytest.raises(CreatorFailedError, match=r"creator failed.*removed the file"):
            make(engine_id, join_timeout_s=30)
    finally:
        joined.set()
        creator_fails.join()
        path.unlink(missing_ok=True)


def test_symlink_at_the_region_name_is_never_followed(engine_id: str, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = SHM / f"vllm_offload_{engine_id}.mmap"
    link.symlink_to(victim)
    try:
        with pytest.raises(RegionError, match="symbolic link"):
            make(engine_id)
        assert victim.read_bytes() == b"precious"
    finally:
        link.unlink()


def test_missing_root_is_a_root_error(engine_id: str, tmp_path: Path) -> None:
    with pytest.raises(RootError, match="does not exist"):
        make(engine_id, root=tmp_path / "nope")


def test_invalid_geometry_is_rejected_before_any_file(engine_id: str) -> None:
    with pytest.raises(ConfigError, match="kv_bytes_per_chunk"):
        SharedOffloadRegion(engine_id, 4, 0, PAGESIZE + 1, PAGESIZE, root=SHM)
    with pytest.raises(ConfigError, match="rank"):
        SharedOffloadRegion(engine_id, 4, 2, 2 * PAGESIZE, PAGESIZE, root=SHM)
    assert not (SHM / f"vllm_offload_{engine_id}.mmap").exists()


def test_segments_split_like_vllm() -> None:
    segments = plan_segments(
        "e", num_chunks=5, row_stride=2 * PAGESIZE, num_segments=3, min_segment_bytes=2 * PAGESIZE
    )
    assert [s.length // PAGESIZE for s in segments] == [4, 4, 2]
    assert [s.name for s in segments] == [
        "vllm_offload_e.mmap",
        "vllm_offload_e.mmap.1",
        "vllm_offload_e.mmap.2",
    ]
    # Under two minimum segments: one file, whatever was asked.
    assert len(plan_segments("e", 5, 2 * PAGESIZE, 32)) == 1


def test_segmented_region_maps_files_back_to_back(engine_id: str) -> None:
    region = SharedOffloadRegion(
        engine_id, 5, None, 2 * PAGESIZE, PAGESIZE, root=SHM, num_segments=3, min_segment_bytes=2 * PAGESIZE
    )
    try:
        files = [SHM / s.name for s in region.segments]
        assert [f.stat().st_size // PAGESIZE for f in files] == [4, 4, 2]
        view = region.create_kv_memoryview()
        view[4, 1] = 0x33  # row 4 lives in the third file, at its offset 1
        view.release()
        with open(files[2], "rb") as f:
            assert f.read(2)[1] == 0x33
    finally:
        region.cleanup()
    assert not any(f.exists() for f in files)


def test_worker_views_follow_vllm_layout(engine_id: str) -> None:
    with make(engine_id, rank=1) as region:
        view = region.create_next_worker_view(PAGESIZE // 2)
        assert view.shape == (4, PAGESIZE // 2)
        assert view.stride() == (2 * PAGESIZE, 1)
        assert view.storage_offset() == PAGESIZE
        with pytest.raises(RegionError, match="exceeds worker area end"):
            region.create_next_worker_view(PAGESIZE)
        view[2].fill_(9)
        raw = region.create_kv_memoryview()
        assert raw[2, PAGESIZE] == 9
        assert raw[2, 0] == 0
        raw.release()
        del view
    with pytest.raises(RegionReleasedError):
        _ = region.base_tensor


def test_worker_populate_covers_only_its_slots(engine_id: str) -> None:
    with make(engine_id, rank=1) as region:
        assert region.slot_ranges() == [
            (r * 2 * PAGESIZE + PAGESIZE, (r + 1) * 2 * PAGESIZE) for r in range(4)
        ]


def test_merge_ranges_joins_touching_ranges() -> None:
    assert merge_ranges(iter([(0, 4), (4, 8), (10, 12), (11, 20)])) == [(0, 8), (10, 20)]


def test_touch_fallback_preserves_bytes_and_faults_pages(engine_id: str) -> None:
    creator = make(engine_id, populate=False, lifetime="vllm")
    try:
        view = creator.create_kv_memoryview()
        view[0, 5] = 0x11
        view[3, 2 * PAGESIZE - 1] = 0x22
        view.release()
        with make(engine_id, rank=None, populate="touch", lifetime="vllm") as joiner:
            assert joiner.populated_with == "touch"
            assert creator.path.stat().st_blocks * 512 >= joiner.total_bytes
            seen = joiner.create_kv_memoryview()
            assert (seen[0, 5], seen[3, 2 * PAGESIZE - 1]) == (0x11, 0x22)
            seen.release()
    finally:
        creator.cleanup()


def test_sparse_without_populate_like_vllm(engine_id: str) -> None:
    with make(engine_id, populate=False) as region:
        assert region.populated_with is None
        assert region.path.stat().st_blocks == 0


def test_populate_probe_treats_einval_as_unsupported_and_propagates_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mmap

    from kvoffload.cpu import shared_offload_region as module

    def fails_with(code: int) -> object:
        def madvise(*_: object) -> None:
            raise OSError(code, os.strerror(code))

        return madvise

    with mmap.mmap(-1, PAGESIZE) as mm:
        assert module._get_populate_write_fn(mm) is module._madvise_populate_write
        monkeypatch.setattr(module, "_madvise_populate_write", fails_with(errno.EINVAL))
        assert module._get_populate_write_fn(mm) is module._fallback_populate_write
        monkeypatch.setattr(module, "_madvise_populate_write", fails_with(errno.EIO))
        with pytest.raises(OSError, match="Input/output error") as info:
            module._get_populate_write_fn(mm)
        assert info.value.errno == errno.EIO


# What a SIGKILL at each stage of a lone creator's init leaves in the root: the base file's
# size, or None for nothing. With our lifetime the path is gone once everyone attached, so a
# crash while populating leaks nothing; vLLM's tiering lifetime keeps the sized file.
CRASH_RESIDUE = {
    "region.open": (None, None),
    "region.space": (0, 0),
    "region.truncate": (0, 0),
    "region.mmap": (8 * PAGESIZE, 8 * PAGESIZE),
    "region.attach": (8 * PAGESIZE, 8 * PAGESIZE),
    "region.populate": (None, 8 * PAGESIZE),
}


@pytest.mark.parametrize("lifetime", ["kvoffload", "vllm"])
@pytest.mark.parametrize("stage", sorted(CRASH_RESIDUE))
def test_crash_at_each_stage_leaves_exactly_the_expected_file(
    engine_id: str, stage: str, lifetime: str
) -> None:
    proc = subprocess.run(
        regionprocs.crash_child_argv(engine_id, SHM, lifetime),
        env=regionprocs.child_env(f"{stage}=crash"),
        capture_output=True,
        timeout=60,
        check=False,
    )
    path = SHM / f"vllm_offload_{engine_id}.mmap"
    try:
        assert proc.returncode == -9, proc.stderr
        expected = CRASH_RESIDUE[stage][lifetime == "vllm"]
        left = sorted(p.name for p in SHM.glob(f"vllm_offload_{engine_id}.mmap*"))
        if expected is None:
            assert left == []
        else:
            assert left == [path.name]
            assert path.stat().st_size == expected
    finally:
        path.unlink(missing_ok=True)


def test_crash_registry_stages_are_all_region_points() -> None:
    from kvoffload import faults

    assert set(CRASH_RESIDUE) == {n for n in faults.names() if n.startswith("region.")}


def test_a_directory_at_the_region_name_is_a_clear_region_error(engine_id: str) -> None:
    path = SHM / f"vllm_offload_{engine_id}.mmap"
    path.mkdir()
    try:
        with pytest.raises(RegionError, match="is a directory"):
            make(engine_id)
    finally:
        path.rmdir()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create another user's file")
def test_another_users_file_at_the_region_name_is_a_clear_region_error(engine_id: str) -> None:
    path = SHM / f"vllm_offload_{engine_id}.mmap"
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    os.chown(path, 65534, 65534)
    child = subprocess.run(
        [sys.executable, "-c", JOIN_AS_NOBODY, engine_id],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    try:
        assert child.returncode == 0, child.stderr
        assert "belongs to someone else" in child.stdout
    finally:
        path.unlink()


# A process of uid 1 tries to join a region file owned by uid 65534: O_RDWR is refused.
JOIN_AS_NOBODY = """
import os, sys
from kvoffload.errors import RegionError
from kvoffload.cpu.shared_offload_region import SharedOffloadRegion, PAGESIZE
os.setgid(1); os.setuid(1)
try:
    SharedOffloadRegion(sys.argv[1], 4, 0, 2 * PAGESIZE, PAGESIZE)
except RegionError as e:
    print(e)
"""
