"""Region creation: kvoffload's SharedOffloadRegion next to vLLM 0.33's own sequence.

Both create a region of ``--mib`` MiB in a private directory on /dev/shm and pre-fault it.
vLLM's sequence, reproduced with the standard library: ``open(O_CREAT|O_EXCL)``,
``ftruncate``, ``mmap(MAP_SHARED)``, ``madvise(MADV_POPULATE_WRITE)`` over the whole region
(the scheduler side), then close and unlink. kvoffload does the same with its additions:
LOCK_SH, owner xattr, attach ledger, ``posix_fallocate`` before populating (``reserve``),
inode-checked unlink. Also timed: kvoffload without ``reserve`` (to show what fallocate buys)
and the per-page touch fallback used where MADV_POPULATE_WRITE is missing.

Prints the median of ``--repeat`` runs and each variant's ratio to vLLM's sequence, and
removes everything it created.

    .venv/bin/python bench/bench_region.py --mib 512 --repeat 5
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from kvoffload.shm.region import SharedOffloadRegion

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
ROW = 1 << 20


def vllm_sequence(root: Path, size: int) -> None:
    path = root / f"vllm_offload_bench-{uuid.uuid4().hex}.mmap"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        mm.madvise(MADV_POPULATE_WRITE, 0, size)
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)


def kvoffload_region(root: Path, size: int, **kwargs: object) -> None:
    region = SharedOffloadRegion(
        f"bench-{uuid.uuid4().hex}",
        size // ROW,
        None,
        ROW,
        ROW,
        root=root,
        **kwargs,  # type: ignore[arg-type]
    )
    region.cleanup()


def timed(fn: Callable[[], None], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256, help="region size in MiB (default 256)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per variant; the median is shown")
    args = parser.parse_args()
    size = args.mib * ROW
    root = Path("/dev/shm") / f"bench-region-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    try:
        variants: list[tuple[str, Callable[[], None]]] = [
            ("vLLM 0.33 sequence (ftruncate + madvise)", lambda: vllm_sequence(root, size)),
            ("kvoffload (fallocate + madvise, lock, ledger)", lambda: kvoffload_region(root, size)),
            ("kvoffload without reserve (ftruncate)", lambda: kvoffload_region(root, size, reserve=False)),
            ("kvoffload, per-page touch fallback", lambda: kvoffload_region(root, size, populate="touch")),
        ]
        vllm_sequence(root, size)  # warm the page cache of the tmpfs once
        results = [(name, timed(fn, args.repeat)) for name, fn in variants]
        base = results[0][1]
        print(f"region of {args.mib} MiB, median of {args.repeat} runs, in {root}")
        for name, seconds in results:
            rate = size / seconds / (1 << 30)
            print(f"  {name:<48} {seconds * 1000:8.1f} ms  {rate:5.2f} GiB/s  {seconds / base:5.2f}x vLLM")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
