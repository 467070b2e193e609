"""Peak memory of every command at 100,000 region files: the one-shot commands and the agent.

Lays out ``--files`` region files (vLLM's names, a base file and one segment per region, empty:
nothing but inodes, as a leaking engine's leftovers in a full ``/dev/shm``), every region
orphaned, in a private tmpfs of its own where this process may mount one (as root; else a
private directory of ``/dev/shm``, said on stderr). Then each command runs once as its own
process, as an operator runs it, its output read through a pipe:

* ``scan --json`` and ``scan`` (the table, in a pipe: every row);
* ``reap --dry-run --json``; ``metrics``;
* ``watch --max-passes 1`` (the agent's pass, for comparison: it streamed already);
* ``reap --yes`` last (it removes every file; the directory must be empty after it).

The figure is the peak resident set of the whole process, in MiB: ``ru_maxrss`` of the command
as ``/usr/bin/time -f %M`` reads it with ``wait4``. (Not this process's own ``wait4``: the kernel
carries into an ``exec`` the high-water mark of the process that forked, and a Python parent
that spawns with ``vfork`` would lend the command its own peak; ``time`` is a small C program.)

Goal (issue 31): <= 100 MiB for every command, the agent's budget (docs/agent-memory.md). With
``--against DIR`` (another checkout, e.g. the main branch's), each command is run with that
tree's code too (``PYTHONPATH=DIR``), on the same files, and shown as a context row. Where a
goal is not met, ``tracemalloc``'s top allocation sites of the same command, run in this
process, follow the table. Everything it creates is unmounted and removed on the way out, also
on Ctrl-C or SIGTERM.

    .venv/bin/python bench/bench_memory.py [--quick] [--json FILE] [--files N] [--against DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from figures import (
    SHM_PREFIX,
    TAG_ENV,
    Row,
    compared,
    entry,
    interrupt_on_signals,
    private_dir,
    private_tmpfs,
    report,
)

MIB = 1024 * 1024
GOAL_MIB = 100.0
TIME = "/usr/bin/time"


def make_regions(directory: Path, files: int) -> None:
    """``files`` empty region files, a base and one segment per region, nobody holding them."""
    for i in range(files // 2):
        base = directory / f"vllm_offload_bench-{i:06d}.mmap"
        for path in (base, Path(f"{base}.1")):
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))


@contextlib.contextmanager
def private_root(files: int) -> Iterator[Path]:
    """A tmpfs of its own (root), else a private directory of /dev/shm; removed on the way out."""
    # Inodes only: a tmpfs's nr_inodes, not its size, is what 100,000 empty files need.
    options = f"size=64m,nr_inodes={files + 1024},mode=0700"
    prefix = f"{SHM_PREFIX}{os.environ.get(TAG_ENV, '')}memory-"
    with private_tmpfs(options, prefix, "the files go to a private directory of /dev/shm") as point:
        if point is not None:
            yield point
            return
        with private_dir(Path("/dev/shm"), "memory") as path:
            yield path


def peak_mib(argv: Sequence[str], tree: Path, ok: Sequence[int] = (0, 1)) -> float:
    """The peak RSS of ``argv`` (run with ``tree``'s code), in MiB; its stdout read and dropped.

    It runs in ``tree``: ``python -m`` puts the working directory first on ``sys.path``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.NamedTemporaryFile(prefix="shmctl-bench-time-") as out:
        done = subprocess.run(
            [TIME, "-f", "%M", "-o", out.name, *argv],
            capture_output=True,
            env=env,
            cwd=tree,
            check=False,
        )
        if done.returncode not in ok:
            raise RuntimeError(f"{' '.join(argv[2:5])} ... exited {done.returncode}: {done.stderr[-300:]!r}")
        return int(Path(out.name).read_text().split()[-1]) * 1024 / MIB


def commands(root: Path) -> dict[str, list[str]]:
    shmctl = [sys.executable, "-m", "shmctl"]
    r = ["--root", str(root), "--grace", "0s"]
    return {
        "scan --json": [*shmctl, "scan", *r, "--json"],
        "scan (table, a pipe)": [*shmctl, "scan", *r],
        "reap --dry-run --json": [*shmctl, "reap", *r, "--dry-run", "--json"],
        "metrics": [*shmctl, "metrics", *r],
        "watch, one pass": [*shmctl, "watch", "--root", str(root), "--grace", "0s", "--max-passes", "1"],
        "reap --yes": [*shmctl, "reap", *r, "--yes"],
    }


def traced(argv: Sequence[str], lines: int = 8) -> list[str]:
    """Where the memory of ``argv`` (a shmctl command line) went: tracemalloc's top sites."""
    code = (
        "import sys, tracemalloc; tracemalloc.start(1)\n"
        "from shmctl.launch import run\n"
        "try:\n    run()\nexcept SystemExit:\n    pass\n"
        "peak = tracemalloc.get_traced_memory()[1]\n"
        "snap = tracemalloc.take_snapshot()\n"
        f"print(f'traced peak {{peak / 2**20:.1f}} MiB; held at exit by site:', file=sys.stderr)\n"
        f"for s in snap.statistics('lineno')[:{lines}]:\n    print(f'  {{s}}', file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *argv[3:]],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    return [line for line in done.stderr.splitlines() if line.strip()][-(lines + 1) :]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20,000 files instead of 100,000")
    parser.add_argument("--files", type=int, default=None)
    parser.add_argument("--against", type=Path, default=None, help="another checkout, run side by side")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    interrupt_on_signals()
    if shutil.which(TIME) is None:
        raise RuntimeError(f"{TIME} (GNU time) is needed to read a command's peak RSS")
    files = args.files or (20_000 if args.quick else 100_000)
    ours = Path(__file__).resolve().parents[1]
    trees = [("", ours)]
    if args.against is not None:
        trees.append((f" [{args.against}]", args.against.resolve()))
    rows: list[Row] = []
    profile: list[str] = []
    with private_root(files) as root:
        argvs = commands(root)
        for name, argv in argvs.items():
            for label, tree in trees:
                if not os.listdir(root):
                    make_regions(root, files)
                mib = peak_mib(argv, tree, ok=(0,) if name == "reap --yes" else (0, 1))
                if name == "reap --yes" and os.listdir(root):
                    raise RuntimeError(f"reap --yes{label} left {len(os.listdir(root))} files")
                figure = f"{name}{label}, {files:,} files, peak RSS"
                graded = not label
                rows.append(
                    compared(
                        figure,
                        "MiB",
                        [mib],
                        baseline=f"budget {GOAL_MIB:g} MiB",
                        base=GOAL_MIB,
                        at_most=1.0 if graded else None,
                        goal="<= 1.0x budget" if graded else "",
                        digits=1,
                    )
                )
                if graded and mib > GOAL_MIB:
                    if not os.listdir(root):
                        make_regions(root, files)
                    profile += [f"{name}:", *traced(argv)]
    notes = [
        f"{files:,} empty region files ({files // 2:,} regions of a base and a segment), all orphaned; "
        "ru_maxrss of the whole process, read by GNU time"
    ]
    return report(rows, value="MiB", digits=1, notes=notes, json_path=args.json_path, profile=profile)


if __name__ == "__main__":
    sys.exit(entry(main, "bench_memory"))
