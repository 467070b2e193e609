"""``shmctl scan --json`` next to the tools an operator would otherwise run, on the same files.

Creates ``--files`` region files (one page each, vLLM's names ``vllm_offload_<id>.mmap``) in a
private directory ``/dev/shm/shmctl-bench-scan-<uuid>/``, and ``--files / 10`` more in a
second one for the growth figure. ``--holders`` real processes hold half the files of each
directory between them: half the processes map their files and close the fd (only
/proc/PID/maps shows them, as vLLM's segment files), the other half keep only an fd. Then,
``--repeat`` rounds, one of each per round (so noise hits all alike), whole processes with
their output read through a pipe:

* ``shmctl scan --root DIR --json --grace 0s``: every file judged (holders, locks, a write
  lease probe per file) and a verdict for each;
* ``lsfd -Q 'NAME =~ "^DIR/"'``, ``fuser FILE...`` and ``lsof +D DIR``, which list holders and
  give no verdict (a tool that is not installed is skipped with the package to install);
* the same scan of the directory ten times smaller, for the cost growth 1k -> 10k files.

Before the holders start, the start-up figures: ``shmctl --help``, ``shmctl scan --help``,
``shmctl scan --root EMPTY`` and the Tab completion requests bash makes (the command word, a
command's options, an option's values from a fixed list, a path option), each against an
absolute budget, next to the bare interpreter's own start-up.

Goals (issues 10 and 22): scan <= 1.5x lsfd and <= 0.2x fuser; growth <= 11x (linear);
--help <= 0.08 s, an empty scan <= 0.12 s, a completion <= 0.06 s (issue #31). The scan's verdicts are
checked (every held file live, every other orphaned) before any figure counts; a script whose
scan is wrong fails. shmctl's own bytecode is compiled first, as an installed package's is
(pip compiles it at install time; an editable checkout under PYTHONDONTWRITEBYTECODE would
otherwise compile every module on every start).

The floor, measured in the same run on the same files: the syscalls the scan makes for each
file (``PROBE_SYSCALLS``: the listing's lstat and the probe, as ``strace -f`` shows them),
issued back to back from this process with no logic between them; the ``/proc`` walk alone
(``collect_holders`` for the files' device, in this process); and ``python -c pass``. No scan
with these verdicts can cost less than the three together.

Where the time went is printed after the table (``profile:`` lines, kept by ``make bench``):
the imports of an empty-root scan by their own time, and cProfile's top functions of one
10,000-file scan with its JSON, run in this process.
Everything it creates is removed and every holder ended on the way out, also on Ctrl-C or
SIGTERM.

    .venv/bin/python bench/bench_scan.py [--quick] [--json FILE] [--files N] [--holders N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from figures import (
    Row,
    compared,
    entry,
    import_profile,
    interrupt_on_signals,
    plan_host,
    private_dir,
    profiled,
    reference,
    report,
    shmctl_argv,
)

PAGE = os.sysconf("SC_PAGE_SIZE")
#: Where a tool comes from, for the line that says how to get it.
PACKAGES = {"lsfd": "util-linux (2.38 or later)", "fuser": "psmisc", "lsof": "lsof"}
HELP_BUDGET_S = 0.08
EMPTY_SCAN_BUDGET_S = 0.12
COMPLETION_BUDGET_S = 0.06
#: The Tab presses timed: (what the row calls it, COMP_WORDS, COMP_CWORD, an item of the answer).
COMPLETIONS = (
    ("shmctl sc<Tab>", "shmctl sc", 1, "scan"),
    ("shmctl scan --<Tab>", "shmctl scan --", 2, "--family"),
    ("shmctl scan --family <Tab>", "shmctl scan --family ", 3, "offload"),
    ("shmctl scan --root <Tab>", "shmctl scan --root /dev/s", 3, ""),
)

# One process forks a child per share of files. Each child holds its files ("map": libc mmap,
# then close the fd, since Python's mmap keeps a dup of it; "fd": keep the fd), says so on the
# ready pipe, and blocks on stdin: EOF there (the bench closed it, or died) ends every child, so
# no holder outlives the bench even when it is SIGKILLed. Forking keeps 200 holders cheap.
_HOLDER_HOST = r"""
import ctypes, gc, json, mmap, os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
page = mmap.PAGESIZE
plan = json.loads(sys.stdin.readline())
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
c = ctypes
libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
failed = ctypes.c_void_p(-1).value
ready_r, ready_w = os.pipe()
gc.freeze()
children = []
for mode, paths in plan:
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(ready_r)
            fds = []
            for path in paths:
                fd = os.open(path, os.O_RDWR)
                if mode == "map":
                    rw = mmap.PROT_READ | mmap.PROT_WRITE
                    if libc.mmap(None, page, rw, mmap.MAP_SHARED, fd, 0) in (None, failed):
                        raise OSError(ctypes.get_errno(), "mmap", path)
                    os.close(fd)
                else:
                    fds.append(fd)
            os.write(ready_w, b"r")
            while os.read(0, 4096):
                pass
            status = 0
        except BaseException as e:
            os.write(2, f"holder {os.getpid()}: {e}\n".encode())
            os.write(ready_w, b"e")
        finally:
            os._exit(status)
    children.append(pid)
os.close(ready_w)
got = b""
while len(got) < len(children):
    chunk = os.read(ready_r, 4096)
    if not chunk:
        break
    got += chunk
print("ready" if got == b"r" * len(children) else "failed", flush=True)
while os.read(0, 4096):
    pass
for pid in children:
    os.waitpid(pid, 0)
"""


def make_files(directory: Path, count: int, engine: str) -> list[Path]:
    page = b"\0" * PAGE
    paths = []
    for i in range(count):
        path = directory / f"vllm_offload_{engine}-{i:05d}.mmap"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, page)  # resident, as a region's pages are
        finally:
            os.close(fd)
        paths.append(path)
    return paths


def holders(shares: Sequence[Sequence[Path]]) -> contextlib.AbstractContextManager[None]:
    """One process per share holding its files (even shares mapped, odd ones by fd), until exit."""
    plan = [["map" if k % 2 == 0 else "fd", [str(p) for p in share]] for k, share in enumerate(shares)]
    return plan_host(_HOLDER_HOST, plan, "a holder process could not hold its files")


def timed(argv: Sequence[str], *, ok: Sequence[int] = (0,), **kwargs: Any) -> tuple[float, str]:
    """Seconds the whole process took, output read through a pipe, and that output."""
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)
    seconds = time.perf_counter() - start
    if done.returncode not in ok:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return seconds, done.stdout


Samples = dict[str, list[float]]


def rounds(commands: dict[str, tuple[list[str], dict[str, Any]]], repeat: int) -> Samples:
    """``repeat`` rounds, each command once per round; the first round warms and is not kept."""
    samples: Samples = {key: [] for key in commands}
    for r in range(repeat + 1):
        for key, (argv, kwargs) in commands.items():
            seconds, _ = timed(argv, **kwargs)
            if r:
                samples[key].append(seconds)
    return samples


# ---------------------------------------------------------------- start-up


def compile_bytecode() -> None:
    """Compile kvoffload's and shmctl's bytecode, as installing them does (``pip install``)."""
    import compileall

    import kvoffload
    import shmctl

    for package in (kvoffload, shmctl):
        assert package.__file__ is not None  # regular packages, not namespace ones
        compileall.compile_dir(Path(package.__file__).parent, quiet=1)


def completion_env(words: str, cword: int) -> dict[str, str]:
    """The environment bash's completion function gives shmctl for one Tab press."""
    return {**os.environ, "_SHMCTL_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(cword)}


def startup(empty: Path, repeat: int) -> list[Row]:
    shmctl = shmctl_argv()
    compile_bytecode()
    for _, words, cword, item in COMPLETIONS:
        answer = timed(shmctl, env=completion_env(words, cword))[1].split("\n")
        if item not in answer:
            raise RuntimeError(f"a completion request for {words!r} did not answer {item!r}: {answer[:5]}")
    # scan exits 0 on a clean root; 1 would be a finding, which an empty root cannot have.
    commands: dict[str, tuple[list[str], dict[str, Any]]] = {
        "python": ([sys.executable, "-c", "pass"], {}),
        "help": ([*shmctl, "--help"], {}),
        "scan-help": ([*shmctl, "scan", "--help"], {}),
        "empty": ([*shmctl, "scan", "--root", str(empty)], {}),
    }
    for figure, words, cword, _ in COMPLETIONS:
        commands[figure] = (shmctl, {"env": completion_env(words, cword)})
    s = {key: [t * 1e3 for t in times] for key, times in rounds(commands, repeat).items()}

    def against(figure: str, key: str, budget_ms: float) -> Row:
        return compared(
            figure,
            "ms",
            s[key],
            baseline=f"budget {budget_ms / 1e3:g} s",
            base=budget_ms,
            at_most=1.0,
            goal=f"<= 1.0x budget ({budget_ms / 1e3:g} s)",
            digits=1,
        )

    return [
        reference("python -c pass (the interpreter's own start-up, whole process)", "ms", s["python"], 1),
        against("shmctl --help (whole process)", "help", HELP_BUDGET_S * 1e3),
        against("shmctl scan --help (whole process)", "scan-help", HELP_BUDGET_S * 1e3),
        against("shmctl scan --root EMPTY (whole process)", "empty", EMPTY_SCAN_BUDGET_S * 1e3),
        *(
            against(f"Tab completion: {figure} (whole process)", figure, COMPLETION_BUDGET_S * 1e3)
            for figure, _, _, _ in COMPLETIONS
        ),
    ]


def empty_scan_floor(empty: Path) -> list[str]:
    """Where an empty root's scan spends what is not imports: its ``/proc`` pass, which an empty
    root makes too (a region unlinked but still mapped is reported with no file left), timed in
    this process, and the processes it reads."""
    from kvoffload.liveness.holders import collect_holders

    procs = sum(1 for name in os.listdir("/proc") if name.isdigit())
    times = []
    for _ in range(5):
        start = time.process_time()
        collect_holders(Path("/proc"), devices={empty.stat().st_dev})
        times.append((time.process_time() - start) * 1e3)
    return [
        f"the /proc pass of `scan --root EMPTY` (collect_holders, in-process, CPU): "
        f"{statistics.median(times):.1f} ms over {procs} processes"
    ]


# ---------------------------------------------------------------- scan against the tools


def held_names_from_scan(stdout: str) -> tuple[set[str], set[str]]:
    report = json.loads(stdout)
    statuses = {e["name"]: e["status"] for e in report["entries"]}
    return {n for n, s in statuses.items() if s == "live"}, {
        n for n, s in statuses.items() if s == "orphaned"
    }


def last_column_names(stdout: str, skip: int) -> set[str]:
    return {Path(line.split()[-1]).name for line in stdout.splitlines()[skip:] if line.strip()}


def tools(root: Path, paths: Sequence[Path]) -> dict[str, tuple[str, list[str], dict[str, Any]]]:
    """Every installed tool, as (label, argv, run kwargs); an absent one is named on stderr."""
    found: dict[str, tuple[str, list[str], dict[str, Any]]] = {}
    # fuser and lsof exit 1 when some file is not in use: an answer, not a failure.
    candidates = {
        "lsfd": (
            "lsfd -Q 'NAME =~ ^DIR/'",
            ["lsfd", "-n", "-o", "PID,ASSOC,NAME", "-Q", f'NAME =~ "^{root}/"'],
            {},
        ),
        # Names relative to DIR keep 10,000 of them well inside ARG_MAX.
        "fuser": ("fuser FILE...", ["fuser", *(p.name for p in paths)], {"cwd": root}),
        "lsof": ("lsof +D DIR", ["lsof", "-n", "-P", "-w", "+D", str(root)], {}),
    }
    for tool, (label, argv, kwargs) in candidates.items():
        if shutil.which(tool) is None:
            print(
                f"note: {tool} is not installed; its rows are skipped (apt-get install {PACKAGES[tool]})",
                file=sys.stderr,
            )
            continue
        found[tool] = (label, argv, {**kwargs, "ok": (0, 1)})
    return found


def agreement(tool: str, stdout: str, held: set[str]) -> bool:
    if tool == "lsfd":
        return last_column_names(stdout, 0) == held
    if tool == "lsof":
        return last_column_names(stdout, 1) == held
    return len(stdout.split()) == len(held)  # fuser: one pid per held file on stdout


#: What ``strace -f shmctl scan`` shows for each file (2026-12-06): the listing's lstat; the
#: probe's open, fstat, owner xattr, the write lease taken, checked and given back, close.
PROBE_SYSCALLS = 9


def probe_floor_s(paths: Sequence[Path]) -> float:
    """Seconds to issue, back to back, the syscalls a scan makes for each of ``paths``."""
    import fcntl

    setlease, getlease = fcntl.F_SETLEASE, fcntl.F_GETLEASE
    flags = os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    dir_fd = os.open(paths[0].parent, os.O_RDONLY | os.O_DIRECTORY)
    names = [p.name for p in paths]
    try:
        start = time.perf_counter()
        for name in names:
            os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            fd = os.open(name, flags, dir_fd=dir_fd)
            os.fstat(fd)
            with contextlib.suppress(OSError):
                os.getxattr(fd, "user.kvoffload.owner")
            with contextlib.suppress(OSError):  # refused (EAGAIN) where a holder has it
                fcntl.fcntl(fd, setlease, fcntl.F_WRLCK)
                fcntl.fcntl(fd, getlease)
                fcntl.fcntl(fd, setlease, fcntl.F_WRLCK)
                fcntl.fcntl(fd, setlease, fcntl.F_UNLCK)
            os.close(fd)
        return time.perf_counter() - start
    finally:
        os.close(dir_fd)


def walk_floor_s(root: Path) -> float:
    """Seconds of one ``/proc`` walk for ``root``'s device, in this process."""
    from kvoffload.liveness.holders import collect_holders

    start = time.perf_counter()
    collect_holders(devices={os.stat(root).st_dev})
    return time.perf_counter() - start


def floor_rows(root: Path, paths: Sequence[Path], setup: str, lsfd: float | None, repeat: int) -> list[Row]:
    """The scan's floor beside lsfd: its syscalls a file, the /proc walk, the interpreter."""
    samples: dict[str, list[float]] = {"probe": [], "walk": [], "python": []}
    for _ in range(repeat):
        samples["probe"].append(probe_floor_s(paths) * 1e3)
        samples["walk"].append(walk_floor_s(root) * 1e3)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        samples["python"].append((time.perf_counter() - start) * 1e3)
    figures = {
        "probe": f"floor: the scan's {PROBE_SYSCALLS} syscalls a file alone, back to back {setup}",
        "walk": f"floor: the /proc walk alone (collect_holders, in-process) {setup}",
        "python": "floor: the interpreter's start-up (python -c pass)",
    }
    if lsfd is None:
        return [reference(figures[key], "ms", samples[key], 1) for key in figures]
    return [
        compared(figures[key], "ms", samples[key], baseline="lsfd, same files", base=lsfd, digits=1)
        for key in figures
    ]


def scan_rows(
    big: tuple[Path, list[Path], set[str]],
    small: tuple[Path, list[Path], set[str]],
    holders_n: int,
    repeat: int,
) -> tuple[list[Row], list[str]]:
    shmctl = shmctl_argv()
    scan = [*shmctl, "scan", "--json", "--grace", "0s", "--root"]
    notes = []
    for directory, paths, held in (big, small):
        _, out = timed([*scan, str(directory)], ok=(0, 1))
        live, orphaned = held_names_from_scan(out)
        if live != held or orphaned != {p.name for p in paths} - held:
            raise RuntimeError(
                f"shmctl scan of {directory}: {len(live)} live / {len(orphaned)} orphaned, "
                f"expected {len(held)} / {len(paths) - len(held)}; the figures would time a wrong scan"
            )
    root, paths, held = big
    found = tools(root, paths)
    for tool, (label, argv, kwargs) in found.items():
        _, out = timed(argv, **kwargs)
        if not agreement(tool, out, held):
            notes.append(f"{label} does not list exactly the {len(held)} held files")
    commands: dict[str, tuple[list[str], dict[str, Any]]] = {
        "scan": ([*scan, str(root)], {"ok": (0, 1)}),
        "scan-small": ([*scan, str(small[0])], {"ok": (0, 1)}),
    }
    commands.update({tool: (argv, kwargs) for tool, (_, argv, kwargs) in found.items()})
    print(f"measuring: {repeat} rounds of {', '.join(commands)}", flush=True)
    s = {key: [t * 1e3 for t in times] for key, times in rounds(commands, repeat).items()}

    n, n_small = len(paths), len(small[1])
    setup = f"[{n:,} files, {holders_n} holders]"
    med = {key: statistics.median(v) for key, v in s.items()}
    table = [reference(f"{found[t][0]} {setup}", "ms", s[t], 1) for t in found]
    goals = {"lsfd": 1.5, "fuser": 0.2}
    for tool in found:
        goal = goals.get(tool)
        table.append(
            compared(
                f"shmctl scan --json vs {tool} {setup}",
                "ms",
                s["scan"],
                baseline=f"{found[tool][0]}, same files",
                base=med[tool],
                at_most=goal,
                goal=f"<= {goal}x {tool}" if goal else "",
                digits=1,
            )
        )
    table.append(
        reference(f"shmctl scan --json [{n_small:,} files, {holders_n} holders]", "ms", s["scan-small"], 1)
    )
    linear = 1.1 * n / n_small
    table.append(
        compared(
            f"shmctl scan --json growth {n_small:,} -> {n:,} files",
            "ms",
            s["scan"],
            baseline=f"shmctl scan --json of {n_small:,} files",
            base=med["scan-small"],
            at_most=linear,
            goal=f"<= {linear:g} (linear)",
            digits=1,
        )
    )
    table += floor_rows(root, paths, setup, med.get("lsfd"), repeat)
    return table, notes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1,000 files, 20 holders, 3 rounds")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    parser.add_argument("--files", type=int, help="files scanned (default 10,000; --quick 1,000)")
    parser.add_argument("--growth-from", type=int, help="files of the growth base (default files/10)")
    parser.add_argument("--holders", type=int, help="holder processes (default 200; --quick 20)")
    parser.add_argument("--repeat", type=int, help="rounds; the median is shown (default 7; --quick 3)")
    parser.add_argument(
        "--startup-repeat", type=int, help="rounds of start-up figures (default 11; --quick 5)"
    )
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="tmpfs to work in")
    args = parser.parse_args(argv)
    files = args.files or (1000 if args.quick else 10_000)
    small_n = args.growth_from or max(1, files // 10)
    holders_n = args.holders or (20 if args.quick else 200)
    repeat = args.repeat or (3 if args.quick else 7)
    interrupt_on_signals()
    with ExitStack() as stack:
        work = stack.enter_context(private_dir(args.shm, "scan"))
        print(f"files in {work}", flush=True)
        empty = work / "empty"
        empty.mkdir()
        # Start-up figures are cheap and short, so noisier: more rounds unless told.
        table = startup(empty, args.startup_repeat or (5 if args.quick else 11))
        floor = empty_scan_floor(empty)  # before the holders start, as the start-up rows ran
        big_dir, small_dir = work / "big", work / "small"
        big_dir.mkdir()
        small_dir.mkdir()
        big = make_files(big_dir, files, "bench")
        small = make_files(small_dir, small_n, "bench")
        held_big, held_small = big[::2], small[::2]
        shares = [[*held_big[k::holders_n], *held_small[k::holders_n]] for k in range(holders_n)]
        stack.enter_context(holders(shares))
        rows, notes = scan_rows(
            (big_dir, big, {p.name for p in held_big}),
            (small_dir, small, {p.name for p in held_small}),
            holders_n,
            repeat,
        )
        table += rows
        profile = [
            *import_profile(empty_scan_argv(empty)),
            *floor,
            *scan_profile(big_dir, files),
        ]
    procs = sum(1 for name in os.listdir("/proc") if name.isdigit())
    print(
        f"{files:,} files ({len(big[::2]):,} held) and {small_n:,} ({len(small[::2]):,} held), "
        f"{holders_n} holder processes (half map-only, half fd-only), {procs} processes on the host; "
        f"scan with verdicts and lease probes; whole processes, median of {repeat} rounds"
    )
    return report(table, value="ms", digits=1, notes=notes, json_path=args.json, profile=profile)


def empty_scan_argv(empty: Path) -> list[str]:
    """``shmctl scan --root EMPTY`` as a Python command line (``import_profile`` runs it)."""
    run = "import sys; from shmctl.app import main; sys.exit(main())"
    return [sys.executable, "-c", run, "scan", "--root", str(empty)]


def scan_profile(root: Path, files: int) -> list[str]:
    """cProfile of one scan of ``root`` and its JSON, in this process (the scan's child too
    probes, unprofiled: what shows is the parent's share)."""
    from kvoffload.liveness.scan import ScanOptions, scan
    from shmctl.render import json_text

    title = f"one scan --json of {files:,} files, in-process"
    return profiled(title, lambda: json_text(scan(root, ScanOptions(grace_s=0))))


if __name__ == "__main__":
    sys.exit(entry(main, "bench_scan", interrupted="its files are removed and its holders ended"))
