"""Region creation: kvoffload's SharedOffloadRegion next to vLLM 0.33's own sequence.

Creates and pre-faults a region of ``--mib`` MiB (default 1024; ``--quick`` 256) in a private
directory of the default /dev/shm and, as root, of a tmpfs it mounts itself with
``huge=within_size`` in a temporary directory. vLLM's sequence, reproduced with the standard
library: ``open(O_CREAT|O_EXCL)``, ``ftruncate``, ``mmap(MAP_SHARED)``,
``madvise(MADV_POPULATE_WRITE)`` over the whole region (the scheduler side), close, unlink.
kvoffload adds its lock, owner record, attach ledger and inode-checked unlink, and
pre-faults on threads (one per CPU this process may use, capped; on 4 KiB pages each step
allocated with fallocate first).

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
* on the huge=within_size tmpfs: vLLM's sequence (context: a bare MADV_POPULATE_WRITE on huge
  pages, over the same on 4 KiB pages), kvoffload (goal >= 10x vLLM's sequence on the default
  tmpfs) and the two workers (context);
* kvoffload on the huge=within_size tmpfs over kvoffload on the default tmpfs, both in the
  same process, warm: goal >= 4x (what huge pages give kvoffload itself).

Then, unless ``--no-profile``, a profile of every figure, one line each (``profile:``), so that the next
round starts from evidence: each variant runs once more in a child process of its own, first
untimed (to warm the memory), then profiled from its start to where its timing ends (its
teardown is not in the profile either): under cProfile, and under ``perf record`` where
``perf`` is installed (its events switched on and off around that window). A note gives the
window's wall time, the CPU time perf sampled in it (every process of the run; without perf,
this process's), the CPUs that kept busy on average (under 2 on 2 CPUs: the run waited for a
CPU, or on a lock), the top symbols (share of perf's samples; ``[k]`` kernel) and Python's top
functions (cProfile, own time).

The rounds interleave the variants, in alternating order. On a VM whose freed memory goes
back to the host (free page reporting), the first allocation after a pause, the first huge
pages after small ones, or the first ones on another CPU, cost many times a warm one: in each
round every mount first gets one untimed run of vLLM's sequence and of kvoffload, so both
sides are timed on warm memory. Rows that cannot run (not root, no mount) are left out
with a note on stderr. Everything it creates is removed and the mount unmounted on the way
out, also on Ctrl-C, SIGTERM or SIGHUP.

    .venv/bin/python bench/bench_region.py [--quick] [--json FILE] [--mib N] [--repeat N] [--no-huge]
        [--no-touch] [--no-profile]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import mmap
import multiprocessing
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
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
#: What huge pages should give kvoffload itself: its rate there over its rate on 4 KiB pages.
HUGE_OVER_DEFAULT_GOAL = 4.0


# ---------------------------------------------------------------- the variants


def _nothing() -> None:
    pass


# Each variant calls ``timed`` where what it times ends, before its teardown: a profile stops there.


def vllm_sequence(root: Path, size: int, timed: Callable[[], None] = _nothing) -> float:
    """Seconds from the exclusive create to the end of the pre-fault; the teardown is not timed."""
    path = root / f"vllm_offload_bench-{uuid.uuid4().hex}.mmap"
    started = time.perf_counter()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        mm.madvise(MADV_POPULATE_WRITE, 0, size)
        seconds = time.perf_counter() - started
        timed()
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return seconds


def kvoffload_region(root: Path, size: int, timed: Callable[[], None] = _nothing, **kwargs: Any) -> float:
    """Seconds the constructor takes (create, size, map, attach, pre-fault); cleanup is not timed."""
    started = time.perf_counter()
    region = SharedOffloadRegion(
        f"bench-{uuid.uuid4().hex}", size // ROW, None, ROW, ROW, root=root, **kwargs
    )
    seconds = time.perf_counter() - started
    timed()
    region.cleanup()
    return seconds


def _worker(root: str, engine_id: str, rows: int, rank: int, start: Any, barrier: Any, out: Any) -> None:
    # The parent decides: Ctrl-C reaches the whole group, and it terminates us on the way out
    # (whatever we leave in its private directory goes with it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.setprofile(None)  # a fork keeps the parent's cProfile (a --profile-run), which is not ours
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


def two_workers(root: Path, size: int, timed: Callable[[], None] = _nothing) -> float:
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
        timed()
        for p in procs:
            p.join(60)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a worker failed: exit codes {[p.exitcode for p in procs]}")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(10)
    return float(max(end for _, end in stamps) - min(began for began, _ in stamps))


#: Every variant by name: (root, size, timed) -> seconds from the create to the last page faulted.
VARIANTS: dict[str, Callable[[Path, int, Callable[[], None]], float]] = {
    "vllm": vllm_sequence,
    "kvoffload": kvoffload_region,
    "one-thread": lambda root, size, timed: kvoffload_region(root, size, timed, populate_threads=1),
    "touch": lambda root, size, timed: kvoffload_region(root, size, timed, populate="touch"),
    "workers": two_workers,
}


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
    if ("kvoffload", HUGE) in samples:
        out.append(huge_over_default(samples, size))
    return out


def huge_over_default(samples: Samples, size: int) -> Row:
    """kvoffload on the huge=within_size tmpfs over kvoffload on the default tmpfs, same run."""
    rates = [size / s / GIB for s in samples[("kvoffload", HUGE)]]
    base = statistics.median(size / s / GIB for s in samples[("kvoffload", DEFAULT)])
    median = statistics.median(rates)
    return Row(
        figure=f"create + pre-fault {size // MIB} MiB: kvoffload on huge=within_size over kvoffload "
        "on the default tmpfs, one warm process",
        unit="GiB/s",
        median=round(median, 3),
        min=round(min(rates), 3),
        max=round(max(rates), 3),
        baseline=f"kvoffload SharedOffloadRegion on the default tmpfs, {size // MIB} MiB, same run",
        ratio=round(median / base, 3),
        goal=f">= {HUGE_OVER_DEFAULT_GOAL:g}x kvoffload on the default tmpfs",
        met=median / base >= HUGE_OVER_DEFAULT_GOAL,
    )


def run_rounds(mount_list: Sequence[Mount], size: int, repeat: int, touch: bool) -> Samples:
    samples: Samples = {}
    for round_ in range(repeat):
        for mount in mount_list:
            variants = ["vllm", "kvoffload"]
            if mount.label == DEFAULT:
                variants += ["one-thread", "touch"] if touch else ["one-thread"]
            if round_ % 2:
                variants.reverse()  # neither side always runs first
            # Untimed: memory freed on one CPU is reused warm on that CPU only, and what was
            # handed back to the host faults in many times slower; one run of each side on the
            # mount first, so that both find it warm.
            vllm_sequence(mount.root, size)
            kvoffload_region(mount.root, size)
            for variant in [*variants, "workers"]:
                seconds = VARIANTS[variant](mount.root, size, _nothing)
                samples.setdefault((variant, mount.label), []).append(seconds)
    order = {v: i for i, v in enumerate(FIGURES)}
    labels = {m.label: i for i, m in enumerate(mount_list)}
    return dict(sorted(samples.items(), key=lambda kv: (labels[kv[0][1]], order[kv[0][0]])))


# ---------------------------------------------------------------- profiles

#: Lines of each profile a note quotes.
PROFILE_TOP = 4


class Probe:
    """The profiled window of one run in the child: cProfile, CPU time and, where perf runs us,
    perf's sampling (``--control`` fifos: perf starts with its events off)."""

    def __init__(self, control: str | None) -> None:
        self.control = control.split(",") if control else None
        self.profiler = cProfile.Profile()
        self.wall = self.cpu = 0.0

    def _perf(self, command: str) -> None:
        if self.control is None:
            return
        ctl, ack = self.control
        with open(ctl, "w") as f:
            f.write(f"{command}\n")
        with open(ack) as f:
            f.readline()  # perf has switched its events by now

    def start(self) -> None:
        self._perf("enable")
        self.cpu = -time.process_time()
        self.wall = -time.perf_counter()
        self.profiler.enable()

    def stop(self) -> None:
        self.profiler.disable()
        self.wall += time.perf_counter()
        self.cpu += time.process_time()
        self._perf("disable")


def profile_run(variant: str, root: Path, size: int, control: str | None) -> dict[str, Any]:
    """In the child: one untimed run to warm the memory, then one profiled up to its teardown."""
    VARIANTS[variant](root, size, _nothing)
    probe = Probe(control)
    probe.start()
    VARIANTS[variant](root, size, probe.stop)
    stats = pstats.Stats(probe.profiler, stream=io.StringIO())
    own = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)  # type: ignore[attr-defined]
    python = [(function_name(func), timing[2]) for func, timing in own[:PROFILE_TOP]]
    return {"wall": probe.wall, "cpu": probe.cpu, "python": python}


def function_name(func: tuple[str, int, str]) -> str:
    """cProfile's (file, line, name) as ``file.py:line(name)``, or a builtin's own name."""
    file, line, name = func
    return name if file == "~" else f"{Path(file).name}:{line}({name})"


def run_child(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a session of its own; on our interruption its whole group goes first."""
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as child:
        try:
            out, err = child.communicate()
        except BaseException:
            # perf's workload outlives a killed perf: end the group, not just our child.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise
    return subprocess.CompletedProcess(argv, child.returncode, out, err)


def kernel_profile(perf: str, data: Path) -> tuple[float, list[str]]:
    """CPU seconds perf sampled (its cpu-clock counts nanoseconds) and its top symbols."""
    done = run_child([perf, "report", "-i", str(data), "--no-children", "--sort", "sym", "--stdio"])
    cpu = 0.0
    top: list[str] = []
    for line in done.stdout.splitlines():
        fields = line.split()
        if line.startswith("# Event count"):
            cpu = int(fields[-1]) / 1e9
        elif len(fields) >= 3 and fields[0].endswith("%") and len(top) < PROFILE_TOP:
            top.append(f"{float(fields[0].rstrip('%')):.0f}% {' '.join(fields[1:])}")
    return cpu, top


def profile_note(variant: str, mount: Mount, size: int) -> str:
    """One figure's profile as a note: time, CPU, the top symbols (perf), Python's top functions."""
    child = [
        sys.executable, str(Path(__file__).resolve()), "--profile-run", variant,
        "--root", str(mount.root), "--mib", str(size // MIB),
    ]  # fmt: skip
    label = f"profile [{mount.label}] {variant}"
    with tempfile.TemporaryDirectory(prefix="bench-region-perf-") as tmp:
        ctl, ack, data = Path(tmp) / "ctl", Path(tmp) / "ack", Path(tmp) / "perf.data"
        perf = shutil.which("perf")
        done, why = None, "perf not found"
        if perf:
            os.mkfifo(ctl)
            os.mkfifo(ack)
            record = [perf, "record", "-q", "-D", "-1", "--control", f"fifo:{ctl},{ack}", "-o", str(data)]
            done = run_child([*record, "--", *child, "--perf-control", f"{ctl},{ack}"])
            why = f"perf record failed: {done.stderr.strip()[-200:]}"
        if perf and done is not None and done.returncode == 0:
            cpu, top = kernel_profile(perf, data)
            how = f"perf, all its processes: CPU {cpu * 1000:.0f} ms"
        else:
            done = run_child(child)
            cpu, top, how = 0.0, [why], ""
    if done.returncode != 0:
        return f"{label}: failed: {done.stderr.strip()[-200:]}"
    run = json.loads(done.stdout.strip().splitlines()[-1])
    if not how:
        cpu, how = run["cpu"], f"this process: CPU {run['cpu'] * 1000:.0f} ms"
    python = ", ".join(f"{seconds * 1000:.1f} ms {name}" for name, seconds in run["python"])
    return (
        f"{label}: a warm run, up to its teardown, {run['wall'] * 1000:.0f} ms; {how}, "
        f"{cpu / run['wall']:.2f} CPUs busy; top symbols: {', '.join(top)}; "
        f"python (cProfile, own time): {python}"
    )


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
    parser.add_argument("--no-profile", action="store_true", help="skip the profile of each figure")
    # The child each profile runs in: one variant on one root, its figures as JSON on stdout.
    parser.add_argument("--profile-run", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--perf-control", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = (args.mib or (256 if args.quick else 1024)) * MIB
    if args.profile_run:
        print(json.dumps(profile_run(args.profile_run, args.root, size, args.perf_control)))
        return 0
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
        profile: list[str] = []
        if not args.no_profile:
            roots = {m.label: m for m in mount_list}
            profile = [profile_note(variant, roots[label], size) for variant, label in samples]
    table = rows(samples, size)
    info = mounts.root_mount(args.shm)
    huge_policy = f"huge={info.huge}" if info is not None and info.huge else "no huge="
    system = mounts.read_shmem_enabled() or "absent"
    print(
        f"region of {size // MIB} MiB, median of {repeat} rounds, {len(os.sched_getaffinity(0))} CPUs, "
        f"kernel {os.uname().release}, {args.shm} {huge_policy}, shmem_enabled {system}"
    )
    return report(table, value="GiB/s", digits=2, notes=notes, json_path=args.json, profile=profile)


if __name__ == "__main__":
    sys.exit(entry(main, "bench_region"))
