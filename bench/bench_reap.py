"""``shmctl reap --yes`` of orphans next to ``rm -f`` of the same files.

Creates ``--files`` orphaned region files (one page each, vLLM's names, nobody holding them)
in a private directory ``/dev/shm/shmctl-bench-reap-<uuid>/`` and removes them, ``--repeat``
rounds, once each way per round (which goes first alternates), the files recreated before
every removal and only the removal timed, as whole processes with their output read through
a pipe:

* ``shmctl reap --root DIR --yes --grace 0s``: every file judged (a /proc pass, a write lease
  per file) and each re-proven under its own lease before its inode-checked unlink;
* ``rm -f FILE...``: the same files, unlinked with no question asked.

Goal (issues 22 and 31): reap <= 8x ``rm -f`` (issue 10 asked 10x). After each removal the
directory must be empty, so the figure is that of a reap that removed every orphan. Where the
time went is printed after the table (``profile:`` lines, kept by ``make bench``): cProfile's
top functions of one more reap of the same files, run in this process and not timed.

The floor, measured in the same rounds on the same files: the syscalls a reap makes for each
file (``FLOOR_SYSCALLS``: the scan's lstat and probe, then the removal protocol of
docs/reap-protocol.md, as ``strace -f`` shows them for a one-file region), issued back to
back from this process with no logic between them, and the interpreter's own start-up
(``python -c pass``). No reap can cost less than the two together. Everything
it creates is removed on the way out, also on Ctrl-C or SIGTERM.

    .venv/bin/python bench/bench_reap.py [--quick] [--json FILE] [--files N]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from figures import (
    Row,
    compared,
    entry,
    interrupt_on_signals,
    private_dir,
    profiled,
    reference,
    report,
    shmctl_argv,
)

PAGE = os.sysconf("SC_PAGE_SIZE")
GOAL = 8.0
#: What ``strace -f shmctl reap --yes`` shows for each file of a one-file region (2026-12-06):
#: the listing's lstat; the scan's probe (open, fstat, the owner xattr, the write lease taken,
#: checked and given back); the removal (open, fstat, flock, lease, lstat of the name, the
#: lease checked, rename into the park, lstat there, the lease checked and dropped, taken again
#: for the unlink, lstat, unlink, fstat of the fd, lease dropped, close).
FLOOR_SYSCALLS = 29
_OWNER_XATTR = "user.kvoffload.owner"


def make_files(directory: Path, names: Sequence[str]) -> None:
    page = b"\0" * PAGE
    for name in names:
        fd = os.open(directory / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, page)  # resident, as a leaked region's pages are
        finally:
            os.close(fd)


def removal_s(argv: Sequence[str], directory: Path) -> float:
    """Seconds ``argv`` took to run, run in ``directory``, which it must leave empty."""
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=directory, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} ... exited {done.returncode}: {done.stderr.strip()[-300:]}")
    left = sorted(os.listdir(directory))
    if left:
        said = [
            line for line in done.stdout.splitlines() if left[0].removeprefix("vllm_offload_")[:-5] in line
        ]
        raise RuntimeError(
            f"{' '.join(argv[:3])} ... left {len(left)} of the files, e.g. {left[0]}"
            + (f": {said[0].strip()}" if said else "")
        )
    return seconds


def protocol_floor_s(directory: Path, names: Sequence[str]) -> float:
    """Seconds to issue, back to back, the syscalls a reap makes for each of ``names``.

    Each file is its own region, as in the timed reaps: ``FLOOR_SYSCALLS`` calls a file, in
    ``strace``'s order, with none of the checks between them (every answer is known here).
    """
    setlease, getlease = fcntl.F_SETLEASE, fcntl.F_GETLEASE
    wrlck, unlck = fcntl.F_WRLCK, fcntl.F_UNLCK
    flags = os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    park = directory / ".floor-park"
    park.mkdir(mode=0o700)
    root_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    park_fd = os.open(park, os.O_RDONLY | os.O_DIRECTORY)
    try:
        start = time.perf_counter()
        for name in names:
            os.stat(name, dir_fd=root_fd, follow_symlinks=False)  # the listing
            fd = os.open(name, flags, dir_fd=root_fd)  # the scan's probe
            os.fstat(fd)
            with contextlib.suppress(OSError):
                os.getxattr(fd, _OWNER_XATTR)
            fcntl.fcntl(fd, setlease, wrlck)
            fcntl.fcntl(fd, getlease)
            fcntl.fcntl(fd, setlease, wrlck)
            fcntl.fcntl(fd, setlease, unlck)
            os.close(fd)
            fd = os.open(name, flags, dir_fd=root_fd)  # the removal
            os.fstat(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.fcntl(fd, setlease, wrlck)
            os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            fcntl.fcntl(fd, getlease)
            fcntl.fcntl(fd, setlease, wrlck)
            os.rename(name, name, src_dir_fd=root_fd, dst_dir_fd=park_fd)
            os.stat(name, dir_fd=park_fd, follow_symlinks=False)
            fcntl.fcntl(fd, getlease)
            fcntl.fcntl(fd, setlease, wrlck)
            fcntl.fcntl(fd, setlease, unlck)
            fcntl.fcntl(fd, setlease, wrlck)
            fcntl.fcntl(fd, getlease)
            fcntl.fcntl(fd, setlease, wrlck)
            os.stat(name, dir_fd=park_fd, follow_symlinks=False)
            os.unlink(name, dir_fd=park_fd)
            os.fstat(fd)
            fcntl.fcntl(fd, setlease, unlck)
            os.close(fd)
        seconds = time.perf_counter() - start
    finally:
        os.close(park_fd)
        os.close(root_fd)
        park.rmdir()
    left = os.listdir(directory)
    if left:
        raise RuntimeError(f"the floor's replay left {len(left)} of the files, e.g. {left[0]}")
    return seconds


def measure(directory: Path, files: int, repeat: int) -> dict[str, list[float]]:
    names = [f"vllm_offload_bench-{i:05d}.mmap" for i in range(files)]
    commands = {
        "reap": [*shmctl_argv(), "reap", "--root", str(directory), "--yes", "--grace", "0s"],
        # Names relative to DIR keep 10,000 of them well inside ARG_MAX.
        "rm": ["rm", "-f", *names],
    }
    samples: dict[str, list[float]] = {key: [] for key in (*commands, "floor", "python")}
    print(f"measuring: {repeat} rounds of {', '.join(commands)}, the floor's syscalls", flush=True)
    for r in range(repeat + 1):  # the first round warms and is not kept
        order = list(commands) if r % 2 else list(reversed(commands))
        for key in order:
            make_files(directory, names)
            seconds = removal_s(commands[key], directory)
            if r:
                samples[key].append(seconds * 1e3)
        make_files(directory, names)
        floor = protocol_floor_s(directory, names)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        python = time.perf_counter() - start
        if r:
            samples["floor"].append(floor * 1e3)
            samples["python"].append(python * 1e3)
    return samples


def rows(samples: dict[str, list[float]], files: int) -> list[Row]:
    rm = reference(f"rm -f FILE... [{files:,} files]", "ms", samples["rm"], 1)
    return [
        rm,
        compared(
            f"shmctl reap --yes vs rm -f [{files:,} orphans]",
            "ms",
            samples["reap"],
            baseline="rm -f of the same files",
            base=statistics.median(samples["rm"]),
            at_most=GOAL,
            goal=f"<= {GOAL:g}x rm -f",
            digits=1,
        ),
        compared(
            f"floor: the reap's {FLOOR_SYSCALLS} syscalls a file alone, back to back [{files:,} files]",
            "ms",
            samples["floor"],
            baseline="rm -f of the same files",
            base=statistics.median(samples["rm"]),
            digits=1,
        ),
        compared(
            "floor: the interpreter's start-up (python -c pass)",
            "ms",
            samples["python"],
            baseline="rm -f of the same files",
            base=statistics.median(samples["rm"]),
            digits=1,
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1,000 files, 3 rounds")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    parser.add_argument("--files", type=int, help="orphans removed per run (default 10,000; --quick 1,000)")
    parser.add_argument("--repeat", type=int, help="rounds; the median is shown (default 5; --quick 3)")
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="tmpfs to work in")
    args = parser.parse_args(argv)
    files = args.files or (1000 if args.quick else 10_000)
    repeat = args.repeat or (3 if args.quick else 5)
    interrupt_on_signals()
    with private_dir(args.shm, "reap") as directory:
        print(f"files in {directory}", flush=True)
        samples = measure(directory, files, repeat)
        profile = reap_profile(directory, files)
    table = rows(samples, files)
    print(f"{files:,} orphans of one page each, whole processes, median of {repeat} rounds")
    return report(table, value="ms", digits=1, json_path=args.json, profile=profile)


def reap_profile(directory: Path, files: int) -> list[str]:
    """cProfile of one reap of ``files`` orphans, in this process (the scan's child unprofiled)."""
    from kvoffload.liveness.reap import reap
    from kvoffload.liveness.scan import ScanOptions

    names = [f"vllm_offload_bench-{i:05d}.mmap" for i in range(files)]
    make_files(directory, names)
    lines = profiled(
        f"one reap of {files:,} orphans, in-process", lambda: reap(directory, ScanOptions(grace_s=0))
    )
    left = os.listdir(directory)
    if left:
        raise RuntimeError(f"the profiled reap left {len(left)} of the files, e.g. {left[0]}")
    return lines


if __name__ == "__main__":
    sys.exit(entry(main, "bench_reap", interrupted="its files are removed"))
