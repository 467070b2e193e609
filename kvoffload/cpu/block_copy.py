"""How a transfer's blocks move between a KV-cache tensor and its CPU view (the direct layout).

Positions. One KV-cache group of a transfer names GPU blocks ``blocks[i]`` and CPU sub-blocks
``subs[i]`` of chunks ``chunks[i]`` (the handler in ``gpu_worker`` works them out from the
specs). A run is a stretch of positions where the GPU block and the sub-block both step by one
inside one chunk: its bytes are contiguous on both sides, so it is one copy.

Copies. The plan is computed with numpy, not a Python loop per block. CPU tensors are copied
through numpy views of their memory, where indexing moves whole blocks (a memcpy each, in C):
a run of at least ``LONG_RUN_BYTES`` is one slice assignment, and the blocks of shorter runs
are gathered and scattered by index arrays, ``TILE_BYTES`` at a time so the intermediate stays
in cache. A transfer of ``PARALLEL_COPY_BYTES`` or more is cut into pieces copied by
``CopyThreads``, as torch's own ``copy_`` would be. Device tensors copy run by run with
``copy_`` (``copy_with_torch``; the same function runs on CPU tensors in the tests).

Numpy is imported inside the functions: the CLI imports the worker's module for dry runs.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import torch
    from numpy.typing import NDArray

#: (first GPU block, chunk id, first sub-block, number of blocks)
BlockRun = tuple[int, int, int, int]

#: A run at least this long is copied as one slice; shorter ones are gathered in tiles.
#: Below it the fixed cost of one slice copy (~2 us) costs more than a second pass through
#: cache: runs of 16 KiB one by one moved at 0.52x a plain copy, in tiles at 0.6x; runs
#: of 64 KiB one by one at 0.83x (bench/bench_worker.py's machine, one thread).
LONG_RUN_BYTES = 64 << 10
#: Bytes of blocks gathered and scattered per index operation: big enough that the fixed
#: cost per tile vanishes, small enough that the gathered tile is still in cache.
TILE_BYTES = 1 << 20
#: A CPU transfer of at least this many bytes is split over ``torch.get_num_threads()``
#: threads, as torch splits a large ``copy_``: one core's memcpy is not the machine's
#: bandwidth. Smaller ones stay on the caller's thread (a hand-off costs ~50 us).
PARALLEL_COPY_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class BlockCopyPlan:
    """One group of a transfer, position by position (``int64`` numpy arrays), and its runs.

    Position ``i`` moves GPU block ``blocks[i]`` to/from sub-block ``subs[i]`` of chunk
    ``chunks[i]``; run ``r`` is positions ``starts[r] .. starts[r] + counts[r] - 1``.
    """

    blocks: NDArray[np.int64]
    chunks: NDArray[np.int64]
    subs: NDArray[np.int64]
    starts: NDArray[np.intp]
    counts: NDArray[np.intp]
    longest_run: int
    shortest_run: int

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.size)

    def runs(self) -> list[BlockRun]:
        s = self.starts
        return list(
            zip(
                self.blocks[s].tolist(),
                self.chunks[s].tolist(),
                self.subs[s].tolist(),
                self.counts.tolist(),
                strict=True,
            )
        )


def repeated_ids(ids: Collection[int]) -> list[int]:
    """Up to four ids named more than once, for an error message."""
    return sorted(i for i, count in Counter(ids).items() if count > 1)[:4]


def make_copy_plan(
    block_ids: Collection[int], chunk_ids: Collection[int], blocks_per_chunk: int
) -> BlockCopyPlan:
    """The plan of one group that starts at sub-block 0; ``ConfigError`` if it is not one.

    Block ``i`` goes to sub-block ``i % blocks_per_chunk`` of chunk
    ``chunk_ids[i // blocks_per_chunk]``, so chunks fill from sub-block 0 and only the last
    may be partial; neither side may name an id twice (two blocks would land on one
    sub-block, or one block be written twice).
    """
    import numpy as np

    n = len(block_ids)
    needed = -(-n // blocks_per_chunk)
    if len(chunk_ids) != needed:
        raise ConfigError(
            "chunk_ids",
            f"{n} blocks at {blocks_per_chunk} per chunk need {needed} chunks, got {len(chunk_ids)}",
        )
    for key, ids in (("block_ids", block_ids), ("chunk_ids", chunk_ids)):
        if len(set(ids)) != len(ids):
            raise ConfigError(key, f"{repeated_ids(ids)} named more than once in one transfer")
    return plan_group(
        np.fromiter(block_ids, dtype=np.int64, count=n),
        np.fromiter(chunk_ids, dtype=np.int64, count=needed),
        blocks_per_chunk,
        skip=0,
    )


def plan_group(
    blocks: NDArray[np.int64], chunk_ids: NDArray[np.int64], blocks_per_chunk: int, skip: int
) -> BlockCopyPlan:
    """The plan of ``blocks`` laid over the sub-blocks of ``chunk_ids`` from sub-block ``skip`` on.

    The caller has checked the counts: ``chunk_ids`` has ``ceil((len(blocks) + skip) / bpc)``.
    """
    import numpy as np

    n = blocks.size
    sub_blocks = np.arange(skip, skip + n, dtype=np.int64)
    chunks = np.repeat(chunk_ids, blocks_per_chunk)[skip : skip + n]
    subs = sub_blocks % blocks_per_chunk
    # Positions step through the sub-blocks one by one, so a run goes on while block - position
    # stays the same, and ends where a chunk starts.
    offset = blocks - sub_blocks
    return _runs(blocks, chunks, subs, (offset[1:] != offset[:-1]) | (subs[1:] == 0))


def plan_positions(
    blocks: NDArray[np.int64], chunks: NDArray[np.int64], subs: NDArray[np.int64]
) -> BlockCopyPlan:
    """The runs of positions given one by one (any order, any gaps)."""
    # A run goes on while both sides step by one inside one chunk.
    ends = (blocks[1:] != blocks[:-1] + 1) | (subs[1:] != subs[:-1] + 1) | (chunks[1:] != chunks[:-1])
    return _runs(blocks, chunks, subs, ends)


def _runs(
    blocks: NDArray[np.int64], chunks: NDArray[np.int64], subs: NDArray[np.int64], ends: NDArray[np.bool_]
) -> BlockCopyPlan:
    import numpy as np

    n = blocks.size
    starts = np.flatnonzero(np.concatenate(([n > 0], ends)))
    counts = np.concatenate((starts[1:], [n])) - starts
    longest, shortest = (int(counts.max()), int(counts.min())) if n else (0, 0)
    return BlockCopyPlan(blocks, chunks, subs, starts, counts, longest, shortest)


def split_plan(plan: BlockCopyPlan, pieces: int) -> list[BlockCopyPlan]:
    """``plan`` cut into at most ``pieces`` plans of consecutive positions, runs cut at the cuts."""
    n = plan.num_blocks
    pieces = max(1, min(pieces, n))
    edges = [n * i // pieces for i in range(pieces + 1)]
    return [
        plan_positions(plan.blocks[lo:hi], plan.chunks[lo:hi], plan.subs[lo:hi])
        for lo, hi in pairwise(edges)
        if hi > lo
    ]


def plan_copy_runs(
    block_ids: Collection[int], chunk_ids: Collection[int], blocks_per_chunk: int
) -> list[BlockRun]:
    """Group a transfer into runs that are contiguous on both sides (see ``make_copy_plan``)."""
    return make_copy_plan(block_ids, chunk_ids, blocks_per_chunk).runs()


def block_view(tensor: torch.Tensor) -> NDArray[np.int8]:
    """The numpy view of an int8 CPU tensor (same memory): ``(blocks, page)`` or ``(chunks, bpc, page)``.

    Indexing its leading dimensions moves whole blocks, each as one memcpy in C; numpy
    drops the GIL while it copies int8 data, which lets ``CopyThreads`` copy in parallel.
    """
    return tensor.detach().numpy()


def copy_on_host(
    gpu: NDArray[np.int8],
    cpu: NDArray[np.int8],
    plan: BlockCopyPlan,
    page: int,
    to_cpu: bool,
    *,
    long_run_bytes: int = LONG_RUN_BYTES,
    tile_bytes: int = TILE_BYTES,
) -> None:
    """Move ``plan`` between two block views (``block_view``) of one KV tensor."""
    blocks, chunks, subs = plan.blocks, plan.chunks, plan.subs
    if plan.longest_run * page >= long_run_bytes:
        long_runs = plan.counts * page >= long_run_bytes
        s = plan.starts[long_runs]
        for b, c, sub, n in zip(
            blocks[s].tolist(),
            chunks[s].tolist(),
            subs[s].tolist(),
            plan.counts[long_runs].tolist(),
            strict=True,
        ):
            if to_cpu:
                cpu[c, sub : sub + n] = gpu[b : b + n]
            else:
                gpu[b : b + n] = cpu[c, sub : sub + n]
        if plan.shortest_run * page >= long_run_bytes:
            return
        import numpy as np

        short = np.repeat(~long_runs, plan.counts)
        blocks, chunks, subs = blocks[short], chunks[short], subs[short]
    tile = max(1, tile_bytes // page)
    for i in range(0, blocks.size, tile):
        b, c, sub = blocks[i : i + tile], chunks[i : i + tile], subs[i : i + tile]
        if to_cpu:
            cpu[c, sub] = gpu[b]
        else:
            gpu[b] = cpu[c, sub]


def copy_with_torch(
    gpu: torch.Tensor, cpu: torch.Tensor, runs: Sequence[BlockRun], to_cpu: bool, non_blocking: bool
) -> None:
    """Move ``runs`` with one ``copy_`` each: the device path (CUDA streams, other devices).

    ``gpu`` is ``(blocks, page)`` and ``cpu`` ``(chunks, bpc, page)``, both int8.
    """
    for block, chunk, sub, count in runs:
        host = cpu[chunk, sub : sub + count]
        device = gpu[block : block + count]
        if to_cpu:
            host.copy_(device, non_blocking=non_blocking)
        else:
            device.copy_(host, non_blocking=non_blocking)


class CopyThreads:
    """The threads that copy the pieces of large host transfers, shared by a worker's handlers.

    Started by the first call that needs them; ``close`` waits for them and is idempotent.
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(self, calls: Sequence[Callable[[], None]]) -> None:
        """Run every call; return once all have ended, raising the first failure."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvoffload_copy")
            futures: list[Future[None]] = [self._pool.submit(call) for call in calls]
        # Every piece ends before the job does, failed or not: none may still write afterwards.
        wait(futures)
        for future in futures:
            future.result()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


__all__ = [
    "LONG_RUN_BYTES",
    "PARALLEL_COPY_BYTES",
    "TILE_BYTES",
    "BlockCopyPlan",
    "BlockRun",
    "CopyThreads",
    "block_view",
    "copy_on_host",
    "copy_with_torch",
    "make_copy_plan",
    "plan_copy_runs",
    "plan_group",
    "plan_positions",
    "split_plan",
]
