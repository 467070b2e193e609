"""Holder evidence from /proc: real processes holding real tmpfs files, plus parser units."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kvoffload import procfs
from kvoffload.liveness.holders import (
    HolderIndex,
    Uninspected,
    collect_holders,
    parse_dev,
    parse_locks,
    parse_maps,
)
from tests.support.procs import Child, region_path, write_file


def key(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def test_a_child_that_maps_then_closes_its_fd_holds_the_file_via_map(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    with Child("map-only", path) as child:
        holders = collect_holders().holders_of(*key(path))
    assert [(h.pid, h.via) for h in holders] == [(child.pid, ("map",))]


def test_a_child_that_keeps_only_the_fd_holds_the_file_via_fd(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    with Child("fd-only", path) as child:
        holders = collect_holders().holders_of(*key(path))
    assert [(h.pid, h.via) for h in holders] == [(child.pid, ("fd",))]


def test_a_vllm_creator_holds_its_file_via_fd_and_map_and_is_named(root: Path, engine_id: str) -> None:
    path = region_path(root, engine_id)
    with Child("vllm", path) as child:
        holders = collect_holders().holders_of(*key(path))
        assert [(h.pid, h.via) for h in holders] == [(child.pid, ("fd", "map"))]
        assert holders[0].name == procfs.read_stat(child.pid).comm
    path.unlink()


def test_a_flock_holder_is_seen_via_lock(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    with Child("lock-only", path) as child:
        holders = collect_holders().holders_of(*key(path))
    assert [(h.pid, h.via) for h in holders] == [(child.pid, ("fd", "lock"))]


def test_a_killed_holder_holds_nothing_even_as_an_unreaped_zombie(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    child = Child("map-only", path)
    try:
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not procfs.read_stat(child.pid).is_zombie:  # not waited for: a zombie
            assert time.monotonic() < deadline
            time.sleep(0.005)
        index = collect_holders()
        assert index.holders_of(*key(path)) == ()
        assert child.pid not in {u.pid for u in index.uninspected}
    finally:
        child.kill()


def test_restricting_to_inodes_indexes_only_those_files(root: Path, engine_id: str) -> None:
    a = write_file(region_path(root, engine_id))
    b = write_file(region_path(root, engine_id + "-b"))
    with Child("fd-only", a), Child("fd-only", b):
        index = collect_holders(inodes=[key(a)])
    assert index.holders_of(*key(a))
    assert index.holders_of(*key(b)) == ()


def test_ignored_fds_of_a_process_do_not_count(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert collect_holders(inodes=[key(path)]).holders_of(*key(path))
        index = collect_holders(inodes=[key(path)], ignore_fds={os.getpid(): [fd]})
        assert index.holders_of(*key(path)) == ()
    finally:
        os.close(fd)


def test_an_unlinked_but_mapped_region_is_listed_as_deleted_per_process(root: Path, engine_id: str) -> None:
    path = region_path(root, engine_id)
    with Child("vllm", path, 3 * 4096) as child:
        ino = os.stat(path).st_ino
        path.unlink()
        deleted = [d for d in collect_holders().deleted if d.pid == child.pid]
    assert len(deleted) == 1
    d = deleted[0]
    assert (d.path, d.engine_id, d.segment, d.ino) == (str(path), engine_id, 0, ino)
    assert d.mapped_bytes == 3 * 4096
    assert d.via == ("fd", "map")
    assert d.size_bytes == 3 * 4096
    assert d.resident_bytes == 4096


def test_maps_devices_are_hex_major_minor() -> None:
    assert parse_dev("00:1b") == os.makedev(0, 0x1B)
    assert parse_dev("fd:01") == os.makedev(0xFD, 1)
    assert parse_dev("103:02") == os.makedev(0x103, 2)


def test_parse_maps_finds_file_mappings_and_deleted_regions() -> None:
    text = (
        "7f0000000000-7f0000100000 rw-s 00000000 00:1b 3  /dev/shm/vllm_offload_a.mmap\n"
        "7f0000100000-7f0000200000 rw-p 00000000 00:00 0 \n"
        "7f0000200000-7f0000201000 rw-s 00000000 00:1b 9  /dev/shm/vllm_offload_b c.mmap.2 (deleted)\n"
        "7f0000300000-7f0000302000 rw-s 00001000 00:1b 9  /dev/shm/vllm_offload_b c.mmap.2 (deleted)\n"
        "7f0000400000-7f0000401000 r--p 00000000 fd:01 77 /usr/lib/libc.so.6\n"
    )
    dev = os.makedev(0, 0x1B)
    keys, deleted = parse_maps(text, lambda k: k[0] == dev)
    assert keys == {(dev, 3), (dev, 9)}
    assert deleted == {(dev, 9): ("/dev/shm/vllm_offload_b c.mmap.2", 0x3000)}


MAPS_OF_MANY_DEVICES = (
    "7f0000000000-7f0000100000 rw-s 00000000 00:1b 3  /dev/shm/vllm_offload_a.mmap\n"
    "7f0000100000-7f0000200000 rw-p 00000000 00:00 0 \n"
    "7f0000200000-7f0000201000 rw-s 00000000 00:1b 9  /dev/shm/vllm_offload_b c.mmap.2 (deleted)\n"
    "7f0000300000-7f0000302000 rw-s 00001000 00:1b 9  /dev/shm/vllm_offload_b c.mmap.2 (deleted)\n"
    "7f0000400000-7f0000401000 r--p 00000000 fd:01 77 /usr/lib/libc.so.6\n"
    "7f0000500000-7f0000501000 r--p 00000000 00:1b0 5 /other/minor-0x1b0\n"
    "7f0000600000-7f0000601000 rw-s 00000000 fd:01 8  /data/ 00:1b in a name\n"
    "7f0000700000-7f0000701000 rw-s 00000000 fd:01 12 /run/vllm_offload_c.mmap (deleted)\n"
    "7f0000800000-7f0000801000 rw-s 00000000 00:1b 4  /dev/shm/vllm_offload_last.mmap"  # no newline
)


@pytest.mark.parametrize(
    "devices", [(0, 0x1B), (0, 0x1B0), (0xFD, 1), (0x103, 2)], ids=["00:1b", "00:1b0", "fd:01", "103:02"]
)
def test_parse_maps_on_given_devices_finds_what_reading_every_line_finds(devices: tuple[int, int]) -> None:
    dev = os.makedev(*devices)

    def wanted(key: tuple[int, int]) -> bool:
        return key[0] == dev

    fast = parse_maps(MAPS_OF_MANY_DEVICES, wanted, devices={dev})
    assert fast == parse_maps(MAPS_OF_MANY_DEVICES, wanted)
    # Deleted regions of every device are reported, whatever the devices asked for.
    assert set(fast[1]) == {(os.makedev(0, 0x1B), 9), (os.makedev(0xFD, 1), 12)}


#: Past two wanted devices only those whose minor a maps line of a file shows are looked for:
#: minors shared across majors, a minor in a name (``:1b 3``), and devices absent from the text.
MANY_DEVICE_SETS = {
    "same minor, other majors": [(0, 0x1B), (1, 0x1B), (0xFD, 0x1B), (0x103, 0x1B)],
    "every device of the text": [(0, 0x1B), (0, 0x1B0), (0xFD, 1), (0x103, 2)],
    "a hundred pod volumes": [(0, minor) for minor in range(0x100, 0x164)] + [(0xFD, 1)],
    "none of the text": [(0, minor) for minor in range(0x200, 0x210)],
}


@pytest.mark.parametrize("devices", list(MANY_DEVICE_SETS.values()), ids=list(MANY_DEVICE_SETS))
def test_parse_maps_on_many_devices_finds_what_reading_every_line_finds(
    devices: list[tuple[int, int]],
) -> None:
    wanted_devices = {os.makedev(*d) for d in devices}
    text = MAPS_OF_MANY_DEVICES + "\n7f0000900000-7f0000901000 r--p 00000000 fd:01 13 /data/a:1b 3 :1b0 5\n"

    def wanted(key: tuple[int, int]) -> bool:
        return key[0] in wanted_devices

    assert parse_maps(text, wanted, devices=wanted_devices) == parse_maps(text, wanted)


def test_parse_locks_reads_granted_locks_and_skips_waiters() -> None:
    text = (
        "1: FLOCK  ADVISORY  WRITE 1234 00:1b:5678 0 EOF\n"
        "1: -> FLOCK  ADVISORY  WRITE 999 00:1b:5678 0 EOF\n"
        "2: OFDLCK ADVISORY  WRITE -1 00:1b:42 4611686018427387904 4611686018427387904\n"
        "3: FLOCK  ADVISORY  READ 0 fd:01:7 0 EOF\n"
    )
    dev = os.makedev(0, 0x1B)
    assert parse_locks(text) == [
        (1234, (dev, 5678)),
        (-1, (dev, 42)),
        (0, (os.makedev(0xFD, 1), 7)),
    ]


def fake_process(proc: Path, pid: int, *, uid: int, caps: int, maps: str | None) -> None:
    """A /proc/PID entry; ``maps=None`` makes maps unreadable (a directory: EISDIR)."""
    base = proc / str(pid)
    (base / "fd").mkdir(parents=True)
    (base / "stat").write_text(f"{pid} (fake {pid}) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 4242 0 0\n")
    (base / "status").write_text(
        f"Name:\tfake\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nCapPrm:\t{caps:016x}\nCapEff:\t{caps:016x}\n"
    )
    if maps is None:
        (base / "maps").mkdir()
    else:
        (base / "maps").write_text(maps)


def test_a_process_whose_maps_cannot_be_read_is_reported_not_skipped(tmp_path: Path) -> None:
    fake_process(tmp_path, 100, uid=1000, caps=0, maps=None)
    fake_process(tmp_path, 101, uid=0, caps=0, maps="")
    (tmp_path / "102").mkdir()  # exited between listing and reading: not a failure
    index = collect_holders(tmp_path)
    assert index.uninspected == (
        Uninspected(100, "fake 100", "EISDIR", "maps", (1000, 1000, 1000, 1000), False),
    )
    assert index.processes == 1


def test_fds_in_a_fake_proc_tree_resolve_to_the_files_they_name(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    fake_process(proc, 100, uid=0, caps=0, maps="")
    target = write_file(tmp_path / "vllm_offload_x.mmap")
    (proc / "100" / "fd" / "3").symlink_to(target)
    assert [h.pid for h in collect_holders(proc).holders_of(*key(target))] == [100]


def test_every_uninspected_process_is_a_blind_spot_whatever_its_uid_or_the_file_mode() -> None:
    # A process of another uid may have opened a 0600 file before a chmod or before it
    # dropped privileges: its uid and the mode excuse nothing.
    other = Uninspected(7, "x", "EACCES", "maps", (1000, 1000, 1000, 1000), False)
    init = Uninspected(1, "init", "EACCES", "maps", (0, 0, 0, 0), True)
    index = HolderIndex(
        holders={}, deleted=(), uninspected=(other, init), anonymous_locks=frozenset(), processes=0
    )
    assert index.blind_spots() == (other, init)
    assert index.blind_spots(assume_not_holding={1}) == (other,)


@pytest.mark.root
def test_another_user_cannot_inspect_our_processes_and_says_so(root: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to uid 65534")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become nobody, inspect, report our parent's verdict
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            index = collect_holders(inodes=())
            found = [u for u in index.uninspected if u.pid == os.getppid()]
            os.write(write_end, repr([(u.error, u.uids[:1]) for u in found]).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        result = f.read()
    os.waitpid(pid, 0)
    assert result == "[('EACCES', (0,))]"
