"""``shmctl reap --yes`` of orphans next to ``rm -f`` of the same files.

Creates ``--files`` orphaned region files (one page each, vLLM's names, nobody holding them)
in a private directory ``/dev/shm/shmctl-bench-reap-<uuid>/`` and removes them, ``--repeat``
rounds, once each way per round (which goes first alternates), the files recreated before
every removal and only the removal timed, as whole processes with their output read through
a pipe:

* ``shmctl reap --root DIR --yes --grace 0s``: every file judged (a /proc pass, a write lease
  per file) and each re-proven under its own lease before its inode-checked unlink;
* ``rm -f FILE...``: the same files, unlinked with no question asked.

Goal (issue 22): reap <= 8x ``rm -f`` (issue 10 asked 10x). After each removal the directory
must be empty, so the figure is that of a reap that removed every orphan. Where the time went
is printed after the table (``profile:`` lines, kept by ``make bench``): cProfile's top
functions of one more reap of the same files, run in this process and not timed. Everything
it creates is removed on the way out, also on Ctrl-C or SIGTERM.

    .venv/bin/python bench/bench_reap.py [--quick] [--json FILE] [--files N]
"""

from __future__ import annotations

import argparse
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


def measure(directory: Path, files: int, repeat: int) -> dict[str, list[float]]:
    names = [f"vllm_offload_bench-{i:05d}.mmap" for i in range(files)]
    commands = {
        "reap": [*shmctl_argv(), "reap", "--root", str(directory), "--yes", "--grace", "0s"],
        # Names relative to DIR keep 10,000 of them well inside ARG_MAX.
        "rm": ["rm", "-f", *names],
    }
    samples: dict[str, list[float]] = {key: [] for key in commands}
    print(f"measuring: {repeat} rounds of {', '.join(commands)}", flush=True)
    for r in range(repeat + 1):  # the first round warms and is not kept
        order = list(commands) if r % 2 else list(reversed(commands))
        for key in order:
            make_files(directory, names)
            seconds = removal_s(commands[key], directory)
            if r:
                samples[key].append(seconds * 1e3)
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
