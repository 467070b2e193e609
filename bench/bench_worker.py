"""Worker store and load through a real region, next to a plain copy of the same bytes.

For blocks of 16 KiB, 256 KiB and 2 MiB (``--tensors`` KV tensors, each block one page of
that size in every tensor, ``--bpc`` blocks per chunk) the bench creates a
``SharedOffloadRegion`` in a private directory of the mount, builds a
``CPUOffloadingWorker`` over it and times, ``--repeat`` times and side by side:

* the baseline: a plain contiguous ``dst.copy_(src)`` of the same number of bytes between
  two CPU tensors (a pinned host tensor and the device when ``--device cuda``);
* the memcpy ceiling: ``ctypes.memmove`` of those bytes (CPU only);
* ``submit_store`` (device -> region) and ``submit_load`` (region -> device) of ``--mib`` MiB,
  once with consecutive block and chunk ids and once with both shuffled.

Before timing, every pattern makes one round trip whose bytes are compared, so the figures
are those of correct copies. A figure is the median throughput in GiB/s (min-max over the
repetitions); its ratio is median / the baseline's median, and the goal is >= 0.8 for
blocks of 256 KiB and more, >= 0.5 for 16 KiB.

The bench runs on ``--root`` (default /dev/shm) and, when run as root, also on a tmpfs it
mounts itself with ``huge=within_size`` in a temporary directory (``--no-huge`` skips
it; without root it is skipped with a note). Everything it creates is removed and the
mount unmounted on the way out, also on Ctrl-C or SIGTERM.

    .venv/bin/python bench/bench_worker.py [--quick] [--json FILE] [--root DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import random
import shutil
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
from figures import Row, entry, huge_tmpfs, report

from kvoffload.base import GPULoadStoreSpec
from kvoffload.cpu.common import CPULoadStoreSpec
from kvoffload.cpu.gpu_worker import CPUOffloadingWorker
from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGES = (16 * KiB, 256 * KiB, 2 * MiB)
PATTERNS = ("consecutive", "shuffled")


def goal_for(page: int) -> float:
    return 0.8 if page >= 256 * KiB else 0.5


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_s(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def shmem_huge_bytes() -> int:
    """ShmemHugePages of /proc/meminfo: how much tmpfs memory huge pages back right now."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("ShmemHugePages:"):
                    return int(line.split()[1]) * KiB
    except OSError:
        pass
    return 0


# ---------------------------------------------------------------- mounts


@dataclass(frozen=True, slots=True)
class Mount:
    label: str
    root: Path


@contextlib.contextmanager
def huge_mount(size: int) -> Iterator[Mount | None]:
    """The huge=within_size tmpfs of :func:`figures.huge_tmpfs` as a Mount, or None."""
    with huge_tmpfs(size, "only --root is measured") as point:
        yield None if point is None else Mount("tmpfs huge=within_size", point)


# ---------------------------------------------------------------- one block size on one mount


@dataclass(frozen=True, slots=True)
class Layout:
    page: int
    tensors: int
    bpc: int
    blocks: int  # blocks per transfer

    @property
    def transfer_bytes(self) -> int:
        return self.blocks * self.page * self.tensors

    @property
    def chunks(self) -> int:
        return 2 * -(-self.blocks // self.bpc)  # twice what a transfer needs, to shuffle among

    @property
    def gpu_blocks(self) -> int:
        return 2 * self.blocks

    @property
    def cpu_page_size(self) -> int:
        return self.page * self.tensors * self.bpc

    @property
    def region_bytes(self) -> int:
        return self.chunks * round_up(self.cpu_page_size, PAGESIZE)


def layout_for(page: int, tensors: int, bpc: int, transfer: int) -> Layout:
    blocks = max(1, transfer // (page * tensors))
    return Layout(page, tensors, bpc, blocks)


def specs(layout: Layout, pattern: str, rng: random.Random) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    chunks_needed = -(-layout.blocks // layout.bpc)
    if pattern == "consecutive":
        return GPULoadStoreSpec(range(layout.blocks)), CPULoadStoreSpec(range(chunks_needed))
    return (
        GPULoadStoreSpec(rng.sample(range(layout.gpu_blocks), layout.blocks)),
        CPULoadStoreSpec(rng.sample(range(layout.chunks), chunks_needed)),
    )


Samples = dict[str, list[float]]  # figure key -> seconds per run


class Bench:
    """One worker over one region, for one block size on one mount."""

    def __init__(self, layout: Layout, device: torch.device, directory: Path) -> None:
        self.layout = layout
        self.device = device
        self.job_ids = iter(range(1 << 62))
        gen = torch.Generator().manual_seed(layout.page)
        self.kv = [
            torch.randint(-128, 128, (layout.gpu_blocks, layout.page), generator=gen, dtype=torch.int8).to(
                device
            )
            for _ in range(layout.tensors)
        ]
        huge_before = shmem_huge_bytes()
        region = SharedOffloadRegion(
            f"bench-worker-{uuid.uuid4().hex[:12]}",
            layout.chunks,
            0,
            round_up(layout.cpu_page_size, PAGESIZE),
            layout.cpu_page_size,
            root=directory,
        )
        self.huge_bytes = max(0, shmem_huge_bytes() - huge_before)
        try:
            self.worker = CPUOffloadingWorker(self.kv, layout.bpc, layout.chunks, mmap_region=region)
        except BaseException:
            region.cleanup()
            raise
        n = layout.transfer_bytes
        pinned = device.type == "cuda"
        self.host_src = torch.ones(n, dtype=torch.int8, pin_memory=pinned)
        self.host_dst = torch.zeros(n, dtype=torch.int8, pin_memory=pinned)
        self.dev_buf = torch.zeros(n, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def close(self) -> None:
        self.worker.shutdown()

    def _run(self, submit: Callable[[int], bool]) -> None:
        job = next(self.job_ids)
        submit(job)
        self.worker.wait({job})
        [result] = self.worker.get_finished()
        if not result.success:
            raise RuntimeError(f"job {job} failed")

    def store(self, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec) -> Callable[[], None]:
        return lambda: self._run(lambda job: self.worker.submit_store(job, gpu, cpu))

    def load(self, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec) -> Callable[[], None]:
        return lambda: self._run(lambda job: self.worker.submit_load(job, cpu, gpu))

    def check_round_trip(self, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec) -> None:
        ids = torch.tensor(gpu.block_ids, device=self.device)
        before = [t[ids].clone() for t in self.kv]
        self.store(gpu, cpu)()
        for t in self.kv:
            t[ids] = 0
        self.load(gpu, cpu)()
        if not all(torch.equal(t[ids], b) for t, b in zip(self.kv, before, strict=True)):
            raise RuntimeError(f"a round trip of {len(gpu.block_ids)} blocks changed their bytes")

    def baseline(self) -> Callable[[], object]:
        if self.dev_buf is not None:
            dev, host = self.dev_buf, self.host_dst
            return lambda: host.copy_(dev, non_blocking=True)
        src, dst = self.host_src, self.host_dst
        return lambda: dst.copy_(src)

    def memcpy(self) -> Callable[[], object]:
        src, dst, n = self.host_src.data_ptr(), self.host_dst.data_ptr(), self.layout.transfer_bytes
        return lambda: ctypes.memmove(dst, src, n)


def bench_mount(
    mount: Mount, layouts: Sequence[Layout], device: torch.device, repeat: int, samples: Samples
) -> list[str]:
    notes: list[str] = []
    directory = mount.root / f"bench-worker-{uuid.uuid4().hex[:8]}"
    directory.mkdir(mode=0o700)
    try:
        for layout in layouts:
            bench = Bench(layout, device, directory)
            try:
                rng = random.Random(layout.page)
                if bench.huge_bytes:
                    notes.append(
                        f"[{mount.label}] {layout.page // KiB} KiB blocks: "
                        f"{bench.huge_bytes / MiB:.0f} of {layout.region_bytes / MiB:.0f} MiB in huge pages"
                    )
                fns: dict[str, Callable[[], object]] = {}
                size = f"{layout.page // KiB} KiB"
                fns[f"baseline|{size}|{mount.label}"] = bench.baseline()
                if device.type == "cpu":
                    fns[f"memcpy|{size}|{mount.label}"] = bench.memcpy()
                for pattern in PATTERNS:
                    gpu, cpu = specs(layout, pattern, rng)
                    bench.check_round_trip(gpu, cpu)
                    fns[f"store|{size}|{mount.label}|{pattern}"] = bench.store(gpu, cpu)
                    fns[f"load|{size}|{mount.label}|{pattern}"] = bench.load(gpu, cpu)
                for fn in fns.values():  # warm: first touches, allocator, caches
                    fn()
                for _ in range(repeat):
                    for key, fn in fns.items():
                        samples.setdefault(key, []).append(timed_s(fn, device))
            finally:
                bench.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return notes


def rows(samples: Samples, layouts: Sequence[Layout]) -> list[Row]:
    by_size = {f"{lay.page // KiB} KiB": lay for lay in layouts}
    out: list[Row] = []
    for key, times in samples.items():
        what, size, label, *pattern = key.split("|")
        layout = by_size[size]
        n = layout.transfer_bytes
        rates = [n / s / GiB for s in times]
        base = statistics.median(n / s / GiB for s in samples[f"baseline|{size}|{label}"])
        med = statistics.median(rates)
        ratio = med / base
        total = f"{n / MiB:.0f} MiB"
        if what == "baseline":
            figure = f"plain torch copy_ of {total} (baseline for {size} blocks) [{label}]"
            goal, met = "", True
        elif what == "memcpy":
            figure = f"memcpy ceiling (ctypes.memmove) of {total} (for {size} blocks) [{label}]"
            goal, met = "", True
        else:
            target = goal_for(layout.page)
            figure = f"worker {what}, {size} blocks, {pattern[0]} ids, {total} [{label}]"
            goal, met = f">= {target}x plain copy", ratio >= target
        out.append(
            Row(
                figure=figure,
                unit="GiB/s",
                median=round(med, 3),
                min=round(min(rates), 3),
                max=round(max(rates), 3),
                baseline=f"plain contiguous torch copy_ of {total} in the same run",
                ratio=round(ratio, 3),
                goal=goal,
                met=met,
            )
        )
    return out


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="16 MiB transfers, 3 repetitions")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    parser.add_argument("--root", type=Path, default=Path("/dev/shm"), help="tmpfs for the region")
    parser.add_argument("--no-huge", action="store_true", help="skip the huge=within_size tmpfs")
    parser.add_argument("--mib", type=int, help="MiB per transfer (default 64, --quick 16)")
    parser.add_argument("--repeat", type=int, help="repetitions; the median is shown (default 9, --quick 3)")
    parser.add_argument("--tensors", type=int, default=2, help="KV-cache tensors (default 2)")
    parser.add_argument("--bpc", type=int, default=4, help="blocks per chunk (default 4)")
    parser.add_argument("--device", default="cpu", help="where the KV caches live: cpu or cuda")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    transfer = (args.mib or (16 if args.quick else 64)) * MiB
    repeat = args.repeat or (3 if args.quick else 9)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    layouts = [layout_for(page, args.tensors, args.bpc, transfer) for page in PAGES]
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    samples: Samples = {}
    notes: list[str] = []
    mounts = [Mount("tmpfs" if args.root == Path("/dev/shm") else str(args.root), args.root)]
    with contextlib.ExitStack() as stack:
        if not args.no_huge:
            huge = stack.enter_context(huge_mount(max(lay.region_bytes for lay in layouts) + 64 * MiB))
            if huge is not None:
                mounts.append(huge)
        for mount in mounts:
            notes += bench_mount(mount, layouts, device, repeat, samples)
    table = rows(samples, layouts)
    print(
        f"{args.tensors} tensors, {args.bpc} blocks per chunk, {transfer // MiB} MiB per transfer, "
        f"median of {repeat}, device {device}, {torch.get_num_threads()} torch threads"
    )
    return report(table, value="GiB/s", digits=2, notes=notes, json_path=args.json)


if __name__ == "__main__":
    sys.exit(entry(main, "bench_worker"))
