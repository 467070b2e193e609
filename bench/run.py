"""Every bench script side by side in one run: one table of ratios, the same as JSON and Markdown.

Runs each script (default: bench_scan, bench_reap, bench_region, bench_worker, bench_manager,
then any other ``bench/bench_*.py``) one after the other as its own process with ``--json FILE``
(and ``--quick``), merges the rows it wrote (see ``figures.py`` for how to read one) and prints
one table: figure, median, min-max, baseline, ratio, goal and whether it is met. The same goes
to ``--json`` (with the date, the machine and each script's outcome) and to ``--markdown``,
for docs/benchmarks.md.

A script that fails (exits non-zero, or writes no rows) is a FAILED line in the table; the
others still run and the exit status is 1. An unmet goal is a figure, not a failure: timings on
a shared machine move, and the table says NOT MET.

Cleanup, also when interrupted: each script runs in its own session, so a Ctrl-C reaches only
this harness, which passes one SIGINT on to the running script (its ``finally`` blocks remove
what it made), waits for it (SIGTERM after ``--grace`` seconds, SIGKILL 10 s later), and starts
no other. After each script, and once more at the end, it looks for directories the benches
make in /dev/shm (``shmctl-bench-*``, ``bench-*``, ``kvbench-*``) that were not there before:
one named with this run's tag, or one nobody holds open or mapped, is removed and named on
stderr, and counts as a failure of the script that left it. Run one harness at a time: two
would share the machine and every figure would be wrong anyway.

    .venv/bin/python bench/run.py [--quick] [--json FILE] [--markdown FILE] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from figures import SHM_PREFIX, TAG_ENV, Row, profile_path, read_json

BENCH = Path(__file__).resolve().parent
ORDER = ("bench_scan.py", "bench_reap.py", "bench_region.py", "bench_worker.py", "bench_manager.py")
#: Names the bench scripts give what they make in the shm root (shmctl-bench-*; bench_worker's
#: bench-worker-*, and bench-* / kvbench-* of older scripts).
LEFTOVER_PREFIXES = (SHM_PREFIX, "bench-", "kvbench-")
KILL_AFTER_TERM_S = 10.0


# ---------------------------------------------------------------- the machine


def _first(path: str, key: str) -> str:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def shm_options(shm: Path) -> str:
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return "?"
    for _, point, fstype, options, *_ in reversed(mounts):  # the last mount on a point wins
        if point == str(shm):
            return f"{fstype} {options}"
    return "not a mount point"


def machine(shm: Path) -> dict[str, str]:
    cores = os.cpu_count() or 0
    usable = len(os.sched_getaffinity(0))
    mem_kib = _first("/proc/meminfo", "MemTotal").split()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return {
        "cpu": _first("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
        "cores": f"{usable}" if usable == cores else f"{usable} of {cores}",
        "memory": f"{int(mem_kib[0]) / (1 << 20):.1f} GiB" if mem_kib else "?",
        "kernel": f"{platform.system()} {platform.release()}",
        "shm": f"{shm} {shm_options(shm)}",
        "python": platform.python_version(),
        "load": load,
    }


def machine_line(m: dict[str, str]) -> str:
    return (
        f"{m['cpu']}, {m['cores']} cores, {m['memory']} RAM, {m['kernel']}, {m['shm']}, "
        f"Python {m['python']}, load {m['load']} at start"
    )


# ---------------------------------------------------------------- leftovers in the shm root


def bench_entries(shm: Path) -> set[str]:
    try:
        return {name for name in os.listdir(shm) if name.startswith(LEFTOVER_PREFIXES)}
    except OSError:
        return set()


def holders_of(path: Path) -> set[int]:
    """Processes with a file under ``path`` open or mapped (those this process can see)."""
    inside = f"{path}/"
    pids = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with_target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if with_target.startswith(inside):
                    pids.add(int(pid))
                    break
            else:
                with open(f"/proc/{pid}/maps") as f:
                    if any(inside in line for line in f):
                        pids.add(int(pid))
        except OSError:
            continue
    return pids


def sweep(shm: Path, before: set[str], tag: str) -> list[str]:
    """Remove what appeared since ``before`` and is this run's (tagged) or nobody's; say what."""
    removed = []
    for name in sorted(bench_entries(shm) - before):
        path = shm / name
        held = set() if tag in name else holders_of(path)
        if held:
            print(
                f"bench: {path} appeared meanwhile and is in use by pid {', '.join(map(str, sorted(held)))}; "
                "left alone (another run's?)",
                file=sys.stderr,
            )
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        print(f"bench: removed {path}, left behind", file=sys.stderr)
        removed.append(str(path))
    return removed


# ---------------------------------------------------------------- running one script


@dataclass
class Outcome:
    script: str
    status: str = "ok"  # ok | failed | interrupted
    exit: int | None = None
    seconds: float = 0.0
    error: str = ""
    leftovers: list[str] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    #: Where the time went, as the script profiled it (``figures.report(profile=...)``).
    profile: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        del out["rows"]
        return out


class Harness:
    def __init__(self, shm: Path, grace_s: float, timeout_s: float) -> None:
        self.shm = shm
        self.grace_s = grace_s
        self.timeout_s = timeout_s
        # A caller that wants to find this run's directories (a test) may choose the tag.
        self.tag = os.environ.get(TAG_ENV) or f"{uuid.uuid4().hex[:8]}-"
        self.interrupted: int | None = None
        self.running = ""

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only recorded here; the wait loop passes it on, so no signal is lost to a race with Popen.
        if self.interrupted is None:
            self.interrupted = signum
            what = f"; {self.running} cleans up" if self.running else ""
            print(f"\nbench: interrupted{what}, then the harness stops", file=sys.stderr)
        else:
            print(f"bench: still waiting for {self.running or 'the harness'} to clean up", file=sys.stderr)

    def run(self, script: Path, extra: Sequence[str], quick: bool) -> Outcome:
        outcome = Outcome(script.name)
        before = bench_entries(self.shm)
        with tempfile.TemporaryDirectory(prefix="shmctl-bench-rows-") as tmp:
            rows_file = Path(tmp) / "rows.json"
            argv = [
                sys.executable,
                str(script),
                "--json",
                str(rows_file),
                *(["--quick"] if quick else []),
                *extra,
            ]
            print(f"== {script.name}: {shlex.join(argv[1:])}", flush=True)
            start = time.monotonic()
            child = subprocess.Popen(
                argv,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                start_new_session=True,  # a Ctrl-C at the terminal reaches the harness only
                env={**os.environ, TAG_ENV: self.tag},
            )
            self.running = script.name
            tail: collections.deque[str] = collections.deque(maxlen=3)
            echo = threading.Thread(target=_echo, args=(child, tail), daemon=True)
            echo.start()
            try:
                outcome.exit = self._wait(child, start)
            finally:
                self.running = ""
                echo.join(timeout=5)
            outcome.seconds = round(time.monotonic() - start, 1)
            if outcome.exit == 0:
                try:
                    outcome.rows = read_json(rows_file)
                except (OSError, ValueError) as e:
                    outcome.error = f"wrote no rows: {e}"
                with contextlib.suppress(OSError):
                    outcome.profile = profile_path(rows_file).read_text().splitlines()
            else:
                outcome.error = f"exit {outcome.exit}" + (f": {tail[-1]}" if tail else "")
        outcome.leftovers = sweep(self.shm, before, self.tag)
        if outcome.leftovers:
            outcome.error = "; ".join(
                filter(None, [outcome.error, f"left {len(outcome.leftovers)} in {self.shm}"])
            )
        if self.interrupted is not None:
            outcome.status = "interrupted"
        elif outcome.error:
            outcome.status = "failed"
        return outcome

    def _wait(self, child: subprocess.Popen[str], start: float) -> int:
        stop_at: float | None = None  # when SIGINT went, or the timeout struck
        term_at: float | None = None
        while True:
            try:
                return child.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if stop_at is None and (self.interrupted is not None or now - start > self.timeout_s):
                if self.interrupted is None:
                    print(
                        f"bench: {self.running} ran past {self.timeout_s:g} s; stopping it", file=sys.stderr
                    )
                child.send_signal(signal.SIGINT)
                stop_at = now
            elif stop_at is not None and term_at is None and now - stop_at > self.grace_s:
                print(f"bench: {self.running} still running; SIGTERM", file=sys.stderr)
                child.send_signal(signal.SIGTERM)
                term_at = now
            elif term_at is not None and now - term_at > KILL_AFTER_TERM_S:
                print(f"bench: {self.running} still running; SIGKILL", file=sys.stderr)
                os.killpg(child.pid, signal.SIGKILL)
                return child.wait()


def _echo(child: subprocess.Popen[str], tail: collections.deque[str]) -> None:
    assert child.stderr is not None
    for line in child.stderr:
        sys.stderr.write(line)
        sys.stderr.flush()
        if line.strip():
            tail.append(line.strip())


# ---------------------------------------------------------------- the merged table


def number(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def ratio_text(x: float) -> str:
    """Two decimals, the way goals are written (<= 1.5x); a small ratio keeps two digits."""
    return f"{x:.2f}" if not math.isfinite(x) or abs(x) >= 0.1 else f"{x:.2g}"


HEADER = ("figure", "median", "min-max", "baseline", "ratio", "goal", "met")


def cells(outcomes: Sequence[Outcome]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for o in outcomes:
        for r in o.rows:
            met = ("met" if r.met else "NOT MET") if r.goal else ""
            out.append(
                (
                    r.figure,
                    f"{number(r.median)} {r.unit}",
                    f"{number(r.min)}-{number(r.max)}",
                    r.baseline,
                    ratio_text(r.ratio),
                    r.goal,
                    met,
                )
            )
        if o.status != "ok":
            out.append((o.script, "-", "-", "-", "-", "runs to the end", f"{o.status.upper()} ({o.error})"))
    return out


def text_table(outcomes: Sequence[Outcome]) -> str:
    rows = [HEADER, *cells(outcomes)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    right = {1, 2, 4}
    lines = []
    for r in rows:
        parts = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def markdown_table(outcomes: Sequence[Outcome]) -> str:
    def esc(cell: str) -> str:
        return cell.replace("|", "\\|")

    lines = [
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join("---:" if i in (1, 2, 4) else "---" for i in range(len(HEADER))) + "|",
    ]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in cells(outcomes)]
    return "\n".join(lines)


def markdown_profiles(outcomes: Sequence[Outcome]) -> str:
    """Each script's profile under its name, as preformatted text; empty when none has one."""
    parts = [f"\n`{o.script}`:\n\n```\n" + "\n".join(o.profile) + "\n```\n" for o in outcomes if o.profile]
    return "\n#### Where the time went\n" + "".join(parts) if parts else ""


# ---------------------------------------------------------------- main


def scripts_to_run(given: Sequence[str], only: str | None) -> list[Path]:
    if given:
        scripts = [Path(s).resolve() for s in given]
    else:
        found = {p.name: p for p in BENCH.glob("bench_*.py")}
        scripts = [found.pop(name) for name in ORDER if name in found] + sorted(found.values())
    if only:
        wanted = {w.strip().removesuffix(".py").removeprefix("bench_") for w in only.split(",")}
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in wanted]
    return scripts


def extra_args(pairs: Sequence[str]) -> dict[str, list[str]]:
    out = {}
    for pair in pairs:
        name, sep, args = pair.partition("=")
        if not sep:
            raise SystemExit(f"bench: --args wants SCRIPT=ARGS, not {pair!r}")
        out[name.removesuffix(".py").removeprefix("bench_")] = shlex.split(args)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("scripts", nargs="*", help="bench scripts (default: every bench/bench_*.py)")
    parser.add_argument("--quick", action="store_true", help="pass --quick: smaller sizes, fewer repetitions")
    parser.add_argument("--only", metavar="NAMES", help="run only these, e.g. scan,reap")
    parser.add_argument(
        "--args",
        metavar="SCRIPT=ARGS",
        action="append",
        default=[],
        help="more arguments for one script, e.g. scan='--files 50000' (repeatable)",
    )
    parser.add_argument("--json", metavar="FILE", type=Path, help="write the merged rows here")
    parser.add_argument("--markdown", metavar="FILE", type=Path, help="write the table as Markdown here")
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="where leftovers are looked for")
    parser.add_argument("--grace", type=float, default=60.0, help="seconds a script has to clean up (60)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one script may run (1800)")
    args = parser.parse_args(argv)
    scripts = scripts_to_run(args.scripts, args.only)
    if not scripts:
        parser.error("no bench script to run")
    extra = extra_args(args.args)

    harness = Harness(args.shm, args.grace, args.timeout)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, harness.on_signal)
    start_entries = bench_entries(args.shm)
    now = datetime.datetime.now(datetime.UTC)
    host = machine(args.shm)
    what = "make bench QUICK=1" if args.quick else "make bench"
    header = f"{now:%Y-%m-%d %H:%M} UTC, {what}: {machine_line(host)}"
    print(header, flush=True)

    outcomes: list[Outcome] = []
    for script in scripts:
        if harness.interrupted is not None:
            break
        outcomes.append(harness.run(script, extra.get(script.stem.removeprefix("bench_"), []), args.quick))
    # Whatever a script's own sweep missed (a leftover that appeared after it, say).
    left = sweep(args.shm, start_entries, harness.tag)

    print(f"\n{header}")
    print(text_table(outcomes))
    skipped = [s.name for s in scripts[len(outcomes) :]]
    if skipped:
        print(f"not run (interrupted): {', '.join(skipped)}")
    document = {
        "date": now.isoformat(timespec="seconds"),
        "machine": host,
        "machine_line": machine_line(host),
        "quick": args.quick,
        "interrupted": harness.interrupted is not None,
        "not_run": skipped,
        "left_in_shm": left,
        "scripts": [o.summary() for o in outcomes],
        "rows": [{"script": o.script, **asdict(r)} for o in outcomes for r in o.rows],
    }
    for path, text in (
        (args.json, json.dumps(document, indent=2) + "\n"),
        (args.markdown, f"{header}\n\n{markdown_table(outcomes)}\n{markdown_profiles(outcomes)}"),
    ):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if harness.interrupted is not None:
        return 130
    return 0 if all(o.status == "ok" for o in outcomes) and not left else 1


if __name__ == "__main__":
    sys.exit(main())
