"""How long a scan takes next to the tools an operator would otherwise run, on the same files.

Creates ``--files`` region files in a private directory on /dev/shm, starts ``--holders``
processes that each hold a share of them (half mapped with the fd closed, half by fd
only), then times, in the same run and on the same files:

* ``kvoffload`` ``scan()`` (one /proc pass, lease and lock probes, verdicts) and the bare /proc pass;
* ``lsof -n -P +D DIR`` (fds and mappings of files under DIR), ``fuser FILE...``, and
  ``lsfd`` filtered to the directory (fds and mappings);
* ``reap()`` of every orphan (each file re-proven under its own write lease before unlink).

Prints the median of ``--repeat`` runs and each tool's ratio to ``scan()``, checks that
every tool agrees on which files are held, and removes everything it created.

    .venv/bin/python bench/bench_scan.py --files 200 --holders 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from kvoffload.liveness.holders import collect_holders
from kvoffload.liveness.reap import reap
from kvoffload.liveness.scan import Status, scan

_HOLDER = r"""
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
c = ctypes
libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
keep = []
for i, path in enumerate(sys.argv[1:]):
    fd = os.open(path, os.O_RDWR)
    if i % 2:
        keep.append(fd)  # fd only
    else:
        libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        os.close(fd)  # mapped, fd closed: only /proc/PID/maps shows it
print("ready", flush=True)
sys.stdin.read()
"""


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_tool(argv: list[str]) -> str:
    # lsof and fuser exit 1 when some item is not in use; that is an answer, not a failure.
    return subprocess.run(argv, capture_output=True, text=True, check=False).stdout


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--holders", type=int, default=4)
    parser.add_argument("--held-fraction", type=float, default=0.5, help="share of files that are held")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"))
    args = parser.parse_args()

    root = args.shm / f"kvbench-{uuid.uuid4().hex[:10]}"
    root.mkdir(mode=0o700)
    children: list[subprocess.Popen[str]] = []
    try:
        paths = []
        for i in range(args.files):
            path = root / f"vllm_offload_bench-{i:05d}.mmap"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, 1 << 20)
            os.pwrite(fd, b"x", 0)
            os.close(fd)
            paths.append(path)
        held = paths[: int(len(paths) * args.held_fraction)]
        for k in range(args.holders):
            share = [str(p) for p in held[k :: args.holders]]
            child = subprocess.Popen(
                [sys.executable, "-c", _HOLDER, *share],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            children.append(child)
            assert child.stdout is not None
            if child.stdout.readline() != "ready\n":
                raise SystemExit("a holder process failed to start")
        # Processes this run cannot inspect and did not start (a sandbox's init, say): vouched
        # for, as an operator would with --assume-not-holding, so the verdicts can be checked.
        blind = frozenset(u.pid for u in collect_holders(inodes=()).uninspected)

        report = scan(root, grace_s=0, assume_not_holding=blind)
        held_names = {p.name for p in held}
        ours = {e.name for e in report.entries if e.status is Status.LIVE}
        timings: dict[str, float] = {
            "scan() (verdicts)": median_ms(
                lambda: scan(root, grace_s=0, assume_not_holding=blind), args.repeat
            ),
            "collect_holders() (/proc pass)": median_ms(
                lambda: collect_holders(devices=[os.stat(root).st_dev]), args.repeat
            ),
        }
        agree = {"scan() (verdicts)": ours == held_names}
        procs = sum(1 for name in os.listdir("/proc") if name.isdigit())

        if shutil.which("lsof"):
            argv = ["lsof", "-n", "-P", "-w", "+D", str(root)]
            timings["lsof +D"] = median_ms(lambda: run_tool(argv), args.repeat)
            found = {Path(line.split()[-1]).name for line in run_tool(argv).splitlines()[1:]}
            agree["lsof +D"] = found == held_names
        if shutil.which("fuser"):
            argv = ["fuser", *map(str, paths)]
            timings["fuser FILE..."] = median_ms(lambda: run_tool(argv), args.repeat)
            agree["fuser FILE..."] = len(run_tool(argv).split()) >= len(held)
        if shutil.which("lsfd"):
            argv = ["lsfd", "-n", "-o", "PID,ASSOC,NAME", "-Q", f'NAME =~ "^{root}/"']
            timings["lsfd -Q NAME"] = median_ms(lambda: run_tool(argv), args.repeat)
            found = {Path(line.split()[-1]).name for line in run_tool(argv).splitlines()}
            agree["lsfd -Q NAME"] = found == held_names

        for child in children:
            child.send_signal(signal.SIGKILL)
            child.wait()
        children.clear()
        start = time.perf_counter()
        reaped = reap(root, grace_s=0, assume_not_holding=blind)
        reap_ms = (time.perf_counter() - start) * 1e3

        base = timings["scan() (verdicts)"]
        print(
            f"{args.files} region files, {len(held)} held by {args.holders} processes, "
            f"{procs} processes on the host, median of {args.repeat}"
        )
        print(f"{'tool':34} {'ms':>9} {'x scan()':>9}  agrees on held files")
        for tool, ms in timings.items():
            ok = agree.get(tool)
            print(f"{tool:34} {ms:9.1f} {ms / base:9.2f}  {'-' if ok is None else 'yes' if ok else 'NO'}")
        per_region = reap_ms / max(1, len(reaped.removed))
        print(
            f"reap() of {len(reaped.removed)} orphans (each re-proven under its write lease before unlink): "
            f"{reap_ms:.1f} ms, {per_region:.2f} ms per region"
        )
        return 0 if all(agree.values()) and len(reaped.removed) == args.files else 1
    finally:
        for child in children:
            child.send_signal(signal.SIGKILL)
            child.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
