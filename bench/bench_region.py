"""Region creation: kvoffload's SharedOffloadRegion next to vLLM 0.33's own sequence.

Creates and pre-faults a region of ``--mib`` MiB (default 1024; ``--quick`` 256) in a private
directory of the default /dev/shm and, as root, of a tmpfs it mounts itself with
``huge=within_size`` in a temporary directory. vLLM's sequence, reproduced with the standard
library: ``open(O_CREAT|O_EXCL)``, ``ftruncate``, ``mmap(MAP_SHARED)``,
``madvise(MADV_POPULATE_WRITE)`` over the whole region (the scheduler side), close, unlink.
kvoffload adds its lock, owner record, attach ledger and inode-checked unlink, and
pre-faults on threads (one per CPU this process may use, capped).

What is timed is creation and pre-faulting, from the exclusive create to the last page
faulted; the teardown (unmap, close, unlink: freeing the same pages either way) is not.
Figures, each the median rate in GiB/s of ``--repeat`` rounds (min-max), its ratio the median
over vLLM's sequence on the default tmpfs in the same run (how many times faster):

* vLLM's sequence on the default tmpfs: the reference;
* kvoffload on the default tmpfs: goal >= 1.8x;
* kvoffload on one populate thread (fallocate, then one walk), and with the per-page touch
  fallback used where MADV_POPULATE_WRITE is missing: context;
* two workers, one process each, each faulting its own slot of every row (vLLM's CPU spec at
  world size 2), from the moment the first starts to the moment the last is done: context;
* on the huge=within_size tmpfs: vLLM's sequence (context), kvoffload (goal >= 10x vLLM's
  sequence on the default tmpfs) and the two workers (context).

The rounds interleave the variants, in alternating order. On a VM whose freed memory goes
back to the host (free page reporting), the first allocation after a pause, the first huge
pages after small ones, or the first ones on another CPU, cost many times a warm one: in each
round every mount first gets one untimed run of vLLM's sequence and of kvoffload, so both
sides are timed on warm memory. Rows that cannot run (not root, no mount) are left out
with a note on stderr. Everything it creates is removed and the mount unmounted on the way
out, also on Ctrl-C, SIGTERM or SIGHUP.

    .venv/bin/python bench/bench_region.py [--quick] [--json FILE] [--mib N] [--repeat N] [--no-huge]
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import multiprocessing
import os
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from figures import (
    Row,
    entry,
    huge_tmpfs,
    interrupt_on_signals,
    private_dir,
    report,
)

from kvoffload.cpu.shared_offload_region import SharedOffloadRegion
from kvoffload.shm import mounts

MIB, GIB = 1 << 20, 1 << 30
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: Rows of the scheduler-side region; the workers' rows hold two slots of half this.
ROW = 1 << 20
WORKER_ROW = 256 << 10
DEFAULT, HUGE = "tmpfs", "tmpfs huge=within_size"
GOALS = {("kvoffload", DEFAULT): 1.8, ("kvoffload", HUGE): 10.0}


# ---------------------------------------------------------------- the variants


def vllm_sequence(root: Path, size: int) -> float:
    """Seconds from the exclusive create to the end of the pre-fault; the teardown is not timed."""
    path = root / f"vllm_offload_bench-{uuid.uuid4().hex}.mmap"
    started = time.perf_counter()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        mm.madvise(MADV_POPULATE_WRITE, 0, size)
        seconds = time.perf_counter() - started
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return seconds


def kvoffload_region(root: Path, size: int, **kwargs: Any) -> float:
    """Seconds the constructor takes (create, size, map, attach, pre-fault); cleanup is not timed."""
    started = time.perf_counter()
    region = SharedOffloadRegion(
        f"bench-{uuid.uuid4().hex}", size // ROW, None, ROW, ROW, root=root, **kwargs
    )
    seconds = time.perf_counter() - started
    region.cleanup()
    return seconds


def _worker(root: str, engine_id: str, rows: int, rank: int, start: Any, barrier: Any, out: Any) -> None:
    # The parent decides: Ctrl-C reaches the whole group, and it terminates us on the way out
    # (whatever we leave in its private directory goes with it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    start.wait()
    began = time.monotonic()
    region = SharedOffloadRegion(
        engine_id,
        rows,
        rank,
        WORKER_ROW,
        WORKER_ROW // 2,
        root=Path(root),
        participant=rank,
        participants=2,
        barrier=lambda: barrier.wait(60),
    )
    try:
        out.put((began, time.monotonic()))
        barrier.wait(60)  # hold the region until both are done: the ledger unlinks it after
    finally:
        region.cleanup()


def two_workers(root: Path, size: int) -> float:
    """Seconds from the first worker's start to the last one's return, in two processes."""
    ctx = multiprocessing.get_context("fork")
    start, barrier, out = ctx.Event(), ctx.Barrier(2), ctx.Queue()
    engine_id = f"bench-{uuid.uuid4().hex}"
    procs = [
        ctx.Process(
            target=_worker, args=(str(root), engine_id, size // WORKER_ROW, rank, start, barrier, out)
        )
        for rank in range(2)
    ]
    try:
        for p in procs:
            p.start()
        start.set()
        stamps = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(60)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a worker failed: exit codes {[p.exitcode for p in procs]}")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(10)
    return max(end for _, end in stamps) - min(began for began, _ in stamps)


# ---------------------------------------------------------------- mounts


@dataclass(frozen=True, slots=True)
class Mount:
    label: str
    root: Path


def pmd_mapped_bytes(root: Path, size: int) -> int:
    """How much of a fresh kvoffload region on ``root`` is mapped in huge pages (smaps)."""
    region = SharedOffloadRegion(
        f"bench-{uuid.uuid4().hex}", size // ROW, None, ROW, ROW, root=root, lifetime="vllm"
    )
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines):
            if line.endswith(str(region.path)):
                for detail in lines[i + 1 : i + 30]:
                    if detail.startswith("ShmemPmdMapped:"):
                        return int(detail.split()[1]) * 1024
        return 0
    finally:
        region.cleanup()


# ---------------------------------------------------------------- rows


Samples = dict[tuple[str, str], list[float]]  # (variant, mount label) -> seconds per round

FIGURES = {
    "vllm": "vLLM 0.33 sequence: ftruncate + one MADV_POPULATE_WRITE",
    "kvoffload": "kvoffload SharedOffloadRegion, default populate threads",
    "one-thread": "kvoffload on one populate thread (fallocate + madvise)",
    "touch": "kvoffload, per-page touch fallback (no MADV_POPULATE_WRITE)",
    "workers": "2 workers in 2 processes, each its own slot of every row",
}


def rows(samples: Samples, size: int) -> list[Row]:
    base_key = ("vllm", DEFAULT)
    base = statistics.median(size / s / GIB for s in samples[base_key])
    baseline = f"vLLM 0.33 sequence on the default tmpfs, {size // MIB} MiB, same run"
    out = []
    for (variant, label), seconds in samples.items():
        rates = [size / s / GIB for s in seconds]
        median = statistics.median(rates)
        target = GOALS.get((variant, label))
        reference = (variant, label) == base_key
        out.append(
            Row(
                figure=f"create + pre-fault {size // MIB} MiB: {FIGURES[variant]} [{label}]",
                unit="GiB/s",
                median=round(median, 3),
                min=round(min(rates), 3),
                max=round(max(rates), 3),
                baseline="" if reference else baseline,
                ratio=1.0 if reference else round(median / base, 3),
                goal="" if target is None else f">= {target:g}x vLLM's sequence on the default tmpfs",
                met=True if target is None else median / base >= target,
            )
        )
    return out


def run_rounds(mount_list: Sequence[Mount], size: int, repeat: int, touch: bool) -> Samples:
    samples: Samples = {}
    for round_ in range(repeat):
        for mount in mount_list:
            variants: list[tuple[str, Callable[[], float]]] = [
                ("vllm", lambda m=mount: vllm_sequence(m.root, size)),
                ("kvoffload", lambda m=mount: kvoffload_region(m.root, size)),
            ]
            if mount.label == DEFAULT:
                variants.append(
                    ("one-thread", lambda m=mount: kvoffload_region(m.root, size, populate_threads=1))
                )
                if touch:
                    variants.append(
                        ("touch", lambda m=mount: kvoffload_region(m.root, size, populate="touch"))
                    )
            if round_ % 2:
                variants.reverse()  # neither side always runs first
            # Untimed: memory freed on one CPU is reused warm on that CPU only, and what was
            # handed back to the host faults in many times slower; one run of each side on the
            # mount first, so that both find it warm.
            vllm_sequence(mount.root, size)
            kvoffload_region(mount.root, size)
            for variant, fn in variants:
                samples.setdefault((variant, mount.label), []).append(fn())
            samples.setdefault(("workers", mount.label), []).append(two_workers(mount.root, size))
    order = {v: i for i, v in enumerate(FIGURES)}
    labels = {m.label: i for i, m in enumerate(mount_list)}
    return dict(sorted(samples.items(), key=lambda kv: (labels[kv[0][1]], order[kv[0][0]])))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="256 MiB, 3 rounds")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    parser.add_argument("--mib", type=int, help="region size in MiB (default 1024, --quick 256)")
    parser.add_argument("--repeat", type=int, help="rounds; the median is shown (default 9, --quick 3)")
    parser.add_argument(
        "--shm", type=Path, default=Path("/dev/shm"), help="the default tmpfs (default /dev/shm)"
    )
    parser.add_argument("--no-huge", action="store_true", help="skip the huge=within_size tmpfs")
    parser.add_argument("--no-touch", action="store_true", help="skip the per-page touch fallback")
    args = parser.parse_args(argv)
    size = (args.mib or (256 if args.quick else 1024)) * MIB
    repeat = args.repeat or (3 if args.quick else 9)
    interrupt_on_signals()
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        mount_list = [Mount(DEFAULT, stack.enter_context(private_dir(args.shm, "region")))]
        if not args.no_huge:
            point = stack.enter_context(huge_tmpfs(2 * size + 64 * MIB, "its rows are left out"))
            if point is not None:
                mount_list.append(Mount(HUGE, point))
                huge = pmd_mapped_bytes(point, size)
                notes.append(
                    f"[{HUGE}] {huge // MIB} of {size // MIB} MiB of a kvoffload region in huge pages"
                )
        samples = run_rounds(mount_list, size, repeat, touch=not args.no_touch)
    table = rows(samples, size)
    info = mounts.root_mount(args.shm)
    huge_policy = f"huge={info.huge}" if info is not None and info.huge else "no huge="
    system = mounts.read_shmem_enabled() or "absent"
    print(
        f"region of {size // MIB} MiB, median of {repeat} rounds, {len(os.sched_getaffinity(0))} CPUs, "
        f"kernel {os.uname().release}, {args.shm} {huge_policy}, shmem_enabled {system}"
    )
    if (("kvoffload", HUGE)) in samples:
        factor = statistics.median(samples[("kvoffload", DEFAULT)]) / statistics.median(
            samples[("kvoffload", HUGE)]
        )
        notes.append(f"kvoffload on huge=within_size against kvoffload on the default tmpfs: {factor:.1f}x")
    return report(table, value="GiB/s", digits=2, notes=notes, json_path=args.json)


if __name__ == "__main__":
    sys.exit(entry(main, "bench_region"))
