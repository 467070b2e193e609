"""The fs secondary tier: block files, the dual-queue I/O pool, lookups and shutdown.

Every file lives under the test's ``tmp_path``; the primary view is an anonymous mapping
(page-aligned, like the shared region), released and closed by each test, which proves
the tier left no export of it behind.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvoffload.base import (
    LookupResult,
    Medium,
    OffloadingKVEventsConfig,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from kvoffload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from kvoffload.errors import ConfigError, TierIOError
from kvoffload.tiering.base import JobResult, TransferJob
from kvoffload.tiering.fs import io
from kvoffload.tiering.fs.manager import FileSystemTierManager
from kvoffload.tiering.fs.thread_pool import DualQueueThreadPool
from tests.support.mounts import mounted_tmpfs

BLOCK = mmap.PAGESIZE * 4
CHUNKS = 6
CTX = ReqContext(req_id="fs-tier-test")
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


Maker = Callable[..., FileSystemTierManager]


def key(n: int) -> OffloadKey:
    return make_offload_key(n.to_bytes(8, "big"), 0)


@dataclass
class _Spec:
    """What the fs tier reads of an OffloadingSpec."""

    config: OffloadingConfig
    kv_events_config: OffloadingKVEventsConfig
    blocks_per_chunk: int = 1


def spec(*, events: bool = False) -> _Spec:
    config = OffloadingConfig(
        groups=(),
        worker_kv_bytes_per_block=BLOCK,
        enable_kv_cache_events=events,
        extra_config={},
        engine_id="fs-tier-test",
        model=OffloadingModelConfig(name="org/model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig.tensor_parallel(0, 1),
    )
    return _Spec(
        config, OffloadingKVEventsConfig(enable_kv_cache_events=events, self_describing_kv_events=False)
    )


@pytest.fixture
def primary() -> Iterator[memoryview]:
    """A (CHUNKS, BLOCK) byte view over an anonymous mapping; closing it fails on a leaked export."""
    region = mmap.mmap(-1, CHUNKS * BLOCK)
    with memoryview(region) as raw:
        view = raw.cast("B", (CHUNKS, BLOCK))
    yield view
    view.release()
    region.close()  # BufferError if anything still exports the mapping


def fill(view: memoryview, chunk: int, byte: int) -> None:
    with view.cast("B") as flat:
        flat[chunk * BLOCK : (chunk + 1) * BLOCK] = bytes([byte]) * BLOCK


def chunk_bytes(view: memoryview, chunk: int) -> bytes:
    with view.cast("B") as flat:
        return flat[chunk * BLOCK : (chunk + 1) * BLOCK].tobytes()


@pytest.fixture
def make_tier(tmp_path: Path, primary: memoryview) -> Iterator[Maker]:
    made: list[FileSystemTierManager] = []

    def make(**options: Any) -> FileSystemTierManager:
        options.setdefault("root_dir", str(tmp_path))
        options.setdefault("n_read_threads", 2)
        options.setdefault("n_write_threads", 2)
        tier = FileSystemTierManager(
            offloading_spec=options.pop("offloading_spec", spec()),
            primary_kv_view=primary,
            tier_type="fs",
            **options,
        )
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.shutdown()


def job(job_id: int, keys: list[OffloadKey], chunks: list[int], *, promotion: bool = False) -> TransferJob:
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.array(chunks, dtype=np.int64),
        is_promotion=promotion,
        req_context=CTX,
    )


def finish(tier: FileSystemTierManager) -> list[JobResult]:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def settle(tier: FileSystemTierManager, keys: list[OffloadKey], ctx: ReqContext = CTX) -> list[LookupResult]:
    """Ask, end the step, wait for the probe, ask again: the answers of the next step."""
    first = [tier.lookup(k, ctx) for k in keys]
    tier.on_schedule_end(STEP)
    deadline = time.monotonic() + 5
    while tier._lookup_manager._pending_results.empty() and any(r is LookupResult.RETRY for r in first):
        assert time.monotonic() < deadline, "the lookup worker never answered"
        time.sleep(0.005)
    return [tier.lookup(k, ctx) for k in keys]


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.name.endswith(".tmp"))


# ----------------------------------------------------------------- block files (io)


def test_a_stored_block_is_published_whole_under_its_name(tmp_path: Path, primary: memoryview) -> None:
    fill(primary, 2, 0xAB)
    path = str(tmp_path / "a" / "b" / "block.bin")
    io.batch_store_block([path], primary, [2 * BLOCK], BLOCK, use_o_direct=False)
    assert Path(path).read_bytes() == b"\xab" * BLOCK
    assert leftovers(tmp_path) == []


def test_a_block_already_in_place_is_not_rewritten(tmp_path: Path, primary: memoryview) -> None:
    path = tmp_path / "block.bin"
    path.write_bytes(b"\x01" * BLOCK)
    before = path.stat().st_ino
    fill(primary, 0, 0x02)
    io.batch_store_block([str(path)], primary, [0], BLOCK, use_o_direct=False)
    assert (path.stat().st_ino, path.read_bytes()) == (before, b"\x01" * BLOCK)


def test_a_store_that_runs_out_of_space_leaves_no_temporary_file(tmp_path: Path, primary: memoryview) -> None:
    with mounted_tmpfs(tmp_path / "small", f"size={BLOCK // 2}") as small:
        with pytest.raises(TierIOError) as caught:
            io.batch_store_block([str(small / "block.bin")], primary, [0], BLOCK, use_o_direct=False)
        assert caught.value.errno == errno.ENOSPC
        assert isinstance(caught.value, OSError)
        assert list(small.iterdir()) == []


def test_an_offset_outside_the_view_is_refused_before_any_file_is_made(
    tmp_path: Path, primary: memoryview
) -> None:
    with pytest.raises(ConfigError, match="outside the primary view"):
        io.batch_store_block([str(tmp_path / "x.bin")], primary, [CHUNKS * BLOCK], BLOCK, use_o_direct=False)
    assert list(tmp_path.iterdir()) == []


def test_a_short_block_file_fails_the_load_and_is_removed(tmp_path: Path, primary: memoryview) -> None:
    good, short = tmp_path / "good.bin", tmp_path / "short.bin"
    good.write_bytes(b"\x07" * BLOCK)
    short.write_bytes(b"\x07" * 10)
    with pytest.raises(TierIOError, match="short read") as caught:
        io.batch_load_block([str(good), str(short)], primary, [0, BLOCK], BLOCK, use_o_direct=False)
    assert caught.value.num_succeeded == 1
    assert chunk_bytes(primary, 0) == b"\x07" * BLOCK
    assert good.exists()
    assert not short.exists()


def test_a_corrupt_file_replaced_while_it_was_read_is_not_removed(tmp_path: Path) -> None:
    path = tmp_path / "block.bin"
    path.write_bytes(b"x" * 10)
    read = os.stat(path)
    replacement = tmp_path / "new.bin"
    replacement.write_bytes(b"\x05" * BLOCK)
    os.replace(replacement, path)  # another writer published a good copy meanwhile
    io._remove_if_same_file(str(path), read)
    assert path.read_bytes() == b"\x05" * BLOCK


def test_a_longer_file_is_another_layouts_block_and_stays(tmp_path: Path, primary: memoryview) -> None:
    path = tmp_path / "block.bin"
    path.write_bytes(b"\x01" * (BLOCK + 1))
    with pytest.raises(TierIOError, match="another layout") as caught:
        io.batch_load_block([str(path)], primary, [0], BLOCK, use_o_direct=False)
    assert caught.value.fix is not None
    assert path.stat().st_size == BLOCK + 1
    assert chunk_bytes(primary, 0) == bytes(BLOCK)


def test_a_transient_open_error_leaves_the_file(tmp_path: Path, primary: memoryview) -> None:
    path, loop = tmp_path / "block.bin", tmp_path / "loop"
    os.symlink(loop, path)
    os.symlink(path, loop)
    with pytest.raises(TierIOError) as caught:
        io.batch_load_block([str(path)], primary, [0], BLOCK, use_o_direct=False)
    assert caught.value.errno == errno.ELOOP
    assert os.path.lexists(path)


def test_the_o_direct_probe_answers_and_leaves_nothing(tmp_path: Path) -> None:
    # The answer is what the filesystem does: an O_DIRECT open of a file there, made by hand.
    try:
        fd = os.open(tmp_path / "by-hand", os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError:
        accepted = False
    else:
        os.close(fd)
        accepted = True
    os.unlink(tmp_path / "by-hand")
    assert io.probe_o_direct(str(tmp_path)) is accepted
    assert list(tmp_path.iterdir()) == []
    assert io.probe_o_direct(str(tmp_path / "missing")) is False


# ----------------------------------------------------------------- the I/O pool


def test_a_read_thread_takes_queued_loads_before_queued_stores() -> None:
    order: list[str] = []
    gate = threading.Event()
    with DualQueueThreadPool(n_read_threads=1, n_write_threads=0) as pool:
        pool.enqueue_store(0, 1, [lambda: gate.wait(5)])  # occupies the only thread
        pool.enqueue_store(1, 1, [lambda: order.append("store")])
        pool.enqueue_load(2, 1, [lambda: order.append("load")])
        gate.set()
        pool.wait_idle()
    assert order == ["load", "store"]


def test_a_write_thread_serves_loads_when_no_store_is_queued() -> None:
    with DualQueueThreadPool(n_read_threads=0, n_write_threads=1) as pool:
        pool.enqueue_load(7, 1, [lambda: None])
        pool.wait_idle()
        assert [(job_id, ok) for job_id, ok, _ in pool.get_finished()] == [(7, True)]


def test_a_job_fails_if_any_task_raises_and_is_reported_once() -> None:
    def boom() -> None:
        raise OSError("disk on fire")

    with DualQueueThreadPool(1, 1) as pool:
        pool.enqueue_store(1, 3, [lambda: None, boom, lambda: None])
        pool.wait_idle()
        assert [(job_id, ok) for job_id, ok, _ in pool.get_finished()] == [(1, False)]
        assert pool.get_finished() == []


def test_a_job_without_tasks_finishes_at_once() -> None:
    with DualQueueThreadPool(1, 0) as pool:
        pool.enqueue_load(3, 0, [])
        assert [(job_id, ok) for job_id, ok, _ in pool.get_finished()] == [(3, True)]


def test_wait_idle_waits_for_the_running_task() -> None:
    gate = threading.Event()
    with DualQueueThreadPool(1, 1) as pool:
        pool.enqueue_store(1, 1, [lambda: gate.wait(5)])
        waiter = threading.Thread(target=pool.wait_idle)
        waiter.start()
        waiter.join(0.1)
        assert waiter.is_alive()
        gate.set()
        waiter.join(5)
        assert not waiter.is_alive()


def test_shutdown_reports_queued_jobs_as_failed_and_joins_every_thread() -> None:
    gate = threading.Event()
    pool = DualQueueThreadPool(1, 0)
    pool.enqueue_store(1, 1, [lambda: gate.wait(5)])
    pool.enqueue_store(2, 1, [lambda: None])
    while len(pool._store_q) == 2:
        time.sleep(0.001)  # wait for the thread to take job 1
    stopper = threading.Thread(target=pool.shutdown)
    stopper.start()
    while pool._store_q:
        time.sleep(0.001)  # shutdown has cancelled job 2; job 1 is still running
    gate.set()
    stopper.join(5)
    assert all(not t.is_alive() for t in pool._threads)
    assert sorted((job_id, ok) for job_id, ok, _ in pool.get_finished()) == [(1, True), (2, False)]
    pool.wait_idle()  # returns: nothing is counted in flight


def test_a_job_enqueued_after_shutdown_is_reported_as_failed() -> None:
    pool = DualQueueThreadPool(1, 1)
    pool.shutdown()
    pool.shutdown()
    pool.enqueue_load(9, 1, [lambda: None])
    assert [(job_id, ok) for job_id, ok, _ in pool.get_finished()] == [(9, False)]


def test_an_empty_root_dir_is_refused_rather_than_writing_at_the_filesystem_root(
    make_tier: Maker,
) -> None:
    before = threading.active_count()
    with pytest.raises(ConfigError, match="root_dir: must be a non-empty path"):
        make_tier(root_dir="")
    assert threading.active_count() == before


def test_a_pool_without_threads_is_refused() -> None:
    with pytest.raises(ConfigError, match="n_read_threads") as caught:
        DualQueueThreadPool(0, 0)
    assert caught.value.fix is not None


def test_a_task_count_that_disagrees_with_the_tasks_is_refused() -> None:
    with DualQueueThreadPool(1, 0) as pool, pytest.raises(ConfigError, match="n_tasks"):
        pool.enqueue_load(1, 2, [lambda: None])


# ----------------------------------------------------------------- the tier


def test_store_then_load_round_trips_the_bytes(make_tier: Maker, primary: memoryview) -> None:
    tier = make_tier()
    fill(primary, 0, 0x11)
    fill(primary, 1, 0x22)
    tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
    [stored] = finish(tier)
    assert (stored.success, stored.transfer_bytes) == (True, 2 * BLOCK)
    tier.submit_load(job(2, [key(1), key(2)], [4, 5], promotion=True))
    assert [r.success for r in finish(tier)] == [True]
    assert (chunk_bytes(primary, 4), chunk_bytes(primary, 5)) == (b"\x11" * BLOCK, b"\x22" * BLOCK)


def test_blocks_go_to_the_file_mappers_paths(make_tier: Maker) -> None:
    tier = make_tier()
    tier.submit_store(job(1, [key(5)], [0]))
    finish(tier)
    path = Path(tier.file_mapper.get_file_name(key(5)))
    assert path.stat().st_size == BLOCK
    assert path.parent.name.endswith("_g0")


def test_a_lookup_retries_until_the_probe_has_answered(
    make_tier: Maker,
) -> None:
    tier = make_tier()
    tier.submit_store(job(1, [key(1)], [0]))
    finish(tier)
    assert tier.lookup(key(1), CTX) is LookupResult.RETRY
    assert settle(tier, [key(1), key(2)]) == [LookupResult.HIT, LookupResult.MISS]


def test_the_namespace_config_is_written_once_without_a_temporary(tmp_path: Path, make_tier: Maker) -> None:
    tier = make_tier()
    config = Path(tier.file_mapper.get_config_file_path())
    assert config.is_file()
    first = config.stat().st_ino
    make_tier()  # a second engine on the same root
    assert config.stat().st_ino == first
    assert leftovers(tmp_path) == []


def test_an_unusable_root_is_an_oserror_naming_the_fix(primary: memoryview) -> None:
    with pytest.raises(TierIOError) as caught:
        FileSystemTierManager(spec(), primary, "fs", root_dir="/dev/null/fs")
    assert isinstance(caught.value, OSError)
    assert caught.value.errno == errno.ENOTDIR
    assert caught.value.fix is not None


def test_a_lower_case_locality_is_refused(make_tier: Maker) -> None:
    with pytest.raises(ConfigError, match="Locality"):
        make_tier(locality="local")


def test_direct_io_is_off_for_a_view_whose_blocks_are_not_page_aligned(tmp_path: Path) -> None:
    region = mmap.mmap(-1, 4 * (BLOCK + 512))
    with memoryview(region) as raw:
        view = raw.cast("B", (4, BLOCK + 512))
    tier = FileSystemTierManager(spec(), view, "fs", root_dir=str(tmp_path), n_read_threads=1)
    try:
        assert tier._use_o_direct is False
    finally:
        tier.shutdown()
        view.release()
        region.close()


def test_a_partly_failed_promotion_keeps_the_blocks_before_the_bad_one(
    make_tier: Maker,
) -> None:
    tier = make_tier()
    keys = [key(1), key(2), key(3)]
    tier.submit_store(job(1, keys, [0, 1, 2]))
    finish(tier)
    ctx = ReqContext(req_id="partial")
    assert settle(tier, keys, ctx) == [LookupResult.HIT] * 3
    Path(tier.file_mapper.get_file_name(key(2))).write_bytes(b"x")
    tier.submit_load(job(2, keys, [3, 4, 5], promotion=True))
    [result] = finish(tier)
    assert (result.success, tuple(result.successful_keys or ())) == (False, (key(1),))
    # The bad block and the one after it are misses now for this request, without a probe.
    assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.HIT, LookupResult.MISS, LookupResult.MISS]
    assert tier._lookup_manager._lookup_batch == []


def test_pending_work_lasts_until_the_job_is_reported(
    make_tier: Maker,
) -> None:
    tier = make_tier()
    assert not tier.has_pending_work()
    tier.submit_store(job(1, [key(1)], [0]))
    tier.drain_jobs()
    assert tier.has_pending_work()
    list(tier.get_finished_jobs())
    assert not tier.has_pending_work()


def test_a_successful_store_emits_one_stored_event(make_tier: Maker) -> None:
    tier = make_tier(offloading_spec=spec(events=True), enable_kv_events=True, locality="REMOTE")
    tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
    finish(tier)
    [event] = tier.take_events()
    assert (event.keys, event.medium, event.removed, event.locality.value if event.locality else None) == (
        [key(1), key(2)],
        Medium.STORAGE,
        False,
        "REMOTE",
    )
    assert list(tier.take_events()) == []


def test_events_need_the_engines_kv_events_switch_too(
    make_tier: Maker,
) -> None:
    tier = make_tier(enable_kv_events=True)
    assert tier.events is None


def test_every_job_is_reported_once_even_when_shutdown_cancels_it(
    make_tier: Maker,
) -> None:
    tier = make_tier(n_read_threads=1, n_write_threads=0)
    for i in range(20):
        tier.submit_store(job(i, [key(i)], [i % CHUNKS]))
    tier.shutdown()
    assert sorted(r.job_id for r in tier.get_finished_jobs()) == list(range(20))
    assert not tier._pool._store_q
    assert all(not t.is_alive() for t in tier._pool._threads)
    tier.submit_load(job(99, [key(1)], [0], promotion=True))
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(99, False)]


def test_a_tier_refused_for_its_thread_counts_leaves_nothing_on_disk(
    tmp_path: Path, make_tier: Maker
) -> None:
    with pytest.raises(ConfigError, match="n_read_threads"):
        make_tier(n_read_threads=0, n_write_threads=0)
    assert list(tmp_path.iterdir()) == []
