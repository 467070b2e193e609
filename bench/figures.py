"""The row every bench script reports, its table and its JSON: what ``make bench`` merges.

Imported by the scripts as a sibling module (``python bench/bench_x.py`` puts ``bench/`` first
on ``sys.path``). Every script takes ``--quick`` (smaller sizes, fewer repetitions) and
``--json FILE`` (its rows, a JSON list of :class:`Row`); ``bench/run.py`` runs them all and
merges the rows into one table.

How to read a row (one convention for every script):

* ``median``, ``min`` and ``max`` are over the repetitions, in ``unit``. Repetitions of the
  figures a row compares are interleaved (one of each per round), so a noisy moment on a shared
  machine hits both sides alike.
* ``ratio`` is this row's median divided by its baseline's median, in the same unit:
  ``baseline`` names what it was divided by (another figure of the same run, or a fixed budget
  such as "budget 0.25 s" where the goal is an absolute time).
* ``goal`` is a bound on ``ratio`` and ``met`` its verdict. For costs (s, ms, us) lower is
  better and the goal reads ``<= X``; for rates (GiB/s) higher is better and it reads ``>= X``.
  An absolute-time goal is ``<= 1.0x budget``: the median fits the budget.
* A row with no goal is context: a reference others are divided by (``baseline`` "" and
  ``ratio`` 1.0 when it is itself the reference), or a figure shown for comparison; its
  ``met`` is True.

The signal helpers let every script clean up the same way: SIGTERM and SIGHUP raise
KeyboardInterrupt like Ctrl-C, so ``finally`` blocks run; cleanup itself runs with those
signals ignored, so a second Ctrl-C cannot cut it short.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import FrameType
from typing import Any

#: Every directory the scan and reap benches make in the shm root starts with this, so
#: nobody mistakes it for an engine's files and the harness can tell its own leftovers.
SHM_PREFIX = "shmctl-bench-"
#: Set by bench/run.py for the scripts it starts: their directories carry it, so the harness
#: removes what its own run left and never another run's.
TAG_ENV = "SHMCTL_BENCH_TAG"
_INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True, slots=True)
class Row:
    """One figure, in the form the ``make bench`` harness merges (see the module docstring)."""

    figure: str
    unit: str
    median: float
    min: float
    max: float
    baseline: str
    ratio: float
    goal: str
    met: bool


ROW_KEYS = tuple(f.name for f in fields(Row))


def spread(samples: Sequence[float]) -> tuple[float, float, float]:
    """Median, min and max of ``samples``."""
    return statistics.median(samples), min(samples), max(samples)


def reference(figure: str, unit: str, samples: Sequence[float], digits: int = 3) -> Row:
    """A row others are divided by: no baseline, ratio 1.0, no goal."""
    med, lo, hi = spread(samples)
    return Row(figure, unit, round(med, digits), round(lo, digits), round(hi, digits), "", 1.0, "", True)


def compared(
    figure: str,
    unit: str,
    samples: Sequence[float],
    *,
    baseline: str,
    base: float,
    at_most: float | None = None,
    goal: str = "",
    digits: int = 3,
) -> Row:
    """A cost divided by ``base`` (the baseline's median, or a budget); met when ratio <= at_most.

    ``goal`` is the text of the bound; without ``at_most`` the row has no goal.
    """
    med, lo, hi = spread(samples)
    ratio = med / base if base > 0 else math.inf
    graded = at_most is not None
    return Row(
        figure,
        unit,
        round(med, digits),
        round(lo, digits),
        round(hi, digits),
        baseline,
        round(ratio, 3),
        (goal or f"<= {at_most}") if graded else "",
        ratio <= at_most if at_most is not None else True,
    )


def print_table(table: Sequence[Row], *, value: str, digits: int) -> None:
    """Figure, median, min-max, ratio and goal (with its verdict), one aligned line each."""
    width = max(len(r.figure) for r in table)
    spans = [f"{r.min:.{digits}f}-{r.max:.{digits}f}" for r in table]
    span_width = max(len("min-max"), *(len(s) for s in spans))
    value_width = max(len(value), *(len(f"{r.median:.{digits}f}") for r in table))
    print(f"{'figure':<{width}}  {value:>{value_width}}  {'min-max':>{span_width}}  {'ratio':>6}  goal")
    for r, span in zip(table, spans, strict=True):
        verdict = ("met" if r.met else "NOT MET") if r.goal else ""
        line = (
            f"{r.figure:<{width}}  {r.median:{value_width}.{digits}f}  {span:>{span_width}}  {r.ratio:6.2f}"
        )
        print(f"{line}  {r.goal} {verdict}".rstrip())


def write_json(table: Sequence[Row], path: str) -> None:
    with open(path, "w") as f:
        json.dump([asdict(r) for r in table], f, indent=2)
        f.write("\n")


def profile_path(json_path: str | Path) -> Path:
    """Where a script leaves its profile beside its rows, for the harness to pick up."""
    return Path(f"{json_path}.profile")


def report(
    table: Sequence[Row],
    *,
    value: str,
    digits: int,
    notes: Sequence[str] = (),
    json_path: str | None = None,
    profile: Sequence[str] = (),
) -> int:
    """A script's ending: its table, its notes, its profile, its rows as JSON where asked; exit 0.

    ``profile`` is where the time went (``profiled``'s lines, an import profile): printed
    after the table, and written beside the JSON rows, so that ``make bench`` keeps it in
    ``results.json`` and ``results.md`` and the next round starts from evidence.
    """
    print_table(table, value=value, digits=digits)
    for note in notes:
        print(f"note: {note}")
    for line in profile:
        print(f"profile: {line}")
    if json_path:
        write_json(table, json_path)
        if profile:
            profile_path(json_path).write_text("".join(f"{line}\n" for line in profile))
    return 0


def profiled(title: str, call: Callable[[], object], lines: int = 12) -> list[str]:
    """``title``, then cProfile's top ``lines`` functions by own time over one ``call()``."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(call)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("tottime").print_stats(lines)
    text = out.getvalue().splitlines()
    total = next((t.strip() for t in text if "function calls" in t), "")
    start = next((i for i, t in enumerate(text) if t.lstrip().startswith("ncalls")), len(text))
    return [f"{title} ({total}), by own time:", *(t.rstrip() for t in text[start:] if t.strip())]


def import_profile(argv: Sequence[str], env: dict[str, str] | None = None, lines: int = 10) -> list[str]:
    """The modules ``argv`` (a Python command line) imports, the costliest ``lines`` by own time.

    ``python -X importtime``'s figures, as the interpreter measured them in that one run.
    """
    done = subprocess.run(
        [argv[0], "-X", "importtime", *argv[1:]],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    found = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, total, name = line.removeprefix("import time:").split("|")
        found.append((int(own), int(total), name.strip()))
    found.sort(reverse=True)
    spent = sum(own for own, _, _ in found) / 1e3
    command = " ".join(argv[1:])
    out = [f"imports of `{command}`: {len(found)} modules, {spent:.1f} ms; ms own / with its imports:"]
    out += [f"  {own / 1e3:6.2f} {total / 1e3:7.2f}  {name}" for own, total, name in found[:lines]]
    return out


def entry(
    main: Callable[[], int], name: str, *, interrupted: str = "everything it created is removed"
) -> int:
    """Run a script's ``main``: a RuntimeError is one line and exit 1, an interrupt exit 130.

    Its ``finally`` blocks have run by then (SIGTERM and SIGHUP too, with
    :func:`interrupt_on_signals`), so the line can say what was cleaned up.
    """
    try:
        return main()
    except RuntimeError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted; {interrupted}", file=sys.stderr)
        return 130


def read_json(path: str | Path) -> list[Row]:
    """The rows a script wrote with :func:`write_json`; ValueError if they are not rows."""
    with open(path) as f:
        data: Any = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: not a JSON list of rows")
    out = []
    for item in data:
        if not isinstance(item, dict) or set(item) != set(ROW_KEYS):
            raise ValueError(f"{path}: a row needs exactly the keys {', '.join(ROW_KEYS)}: {item!r}")
        out.append(Row(**item))
    return out


def shmctl_argv() -> list[str]:
    """The console script installed next to this interpreter, started as an operator starts it."""
    script = Path(sys.executable).parent / "shmctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "shmctl"]


@contextlib.contextmanager
def plan_host(script: str, plan: object, failure: str, wait_s: float = 30.0) -> Iterator[None]:
    """A helper process (``python -c script``) that reads ``plan`` as one JSON line, sets up
    what it describes (holders, sleepers, engines), prints ``ready``, and ends all of it at
    end of file on its stdin. ``failure`` is the error when it does not say ``ready``.

    It runs in a session of its own, so a Ctrl-C at the terminal reaches the bench, which
    ends it; one that does not exit within ``wait_s`` is killed with its process group.
    """
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdin is not None
        assert process.stdout is not None
        process.stdin.write(json.dumps(plan) + "\n")
        process.stdin.flush()
        if process.stdout.readline() != "ready\n":
            raise RuntimeError(failure)
        yield
    finally:
        with signals_ignored():
            if process.stdin is not None:
                process.stdin.close()  # EOF: everything it started exits, and it reaps them
            try:
                process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            if process.stdout is not None:
                process.stdout.close()


# ---------------------------------------------------------------- signals and cleanup


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def interrupt_on_signals() -> None:
    """SIGTERM and SIGHUP raise KeyboardInterrupt, as SIGINT does, so ``finally`` blocks run."""
    for sig in _INTERRUPTS:
        signal.signal(sig, _interrupt)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """Cleanup runs to the end: SIGINT, SIGTERM and SIGHUP are ignored meanwhile."""
    saved = [(sig, signal.signal(sig, signal.SIG_IGN)) for sig in _INTERRUPTS]
    try:
        yield
    finally:
        for sig, handler in saved:
            signal.signal(sig, handler)


@contextlib.contextmanager
def private_dir(shm: Path, what: str) -> Iterator[Path]:
    """``SHM/shmctl-bench-[TAG]WHAT-UUID``, mode 0700, removed with everything in it on the way out."""
    path = shm / f"{SHM_PREFIX}{os.environ.get(TAG_ENV, '')}{what}-{uuid.uuid4().hex[:10]}"
    path.mkdir(mode=0o700)
    try:
        yield path
    finally:
        with signals_ignored():
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def private_tmpfs(options: str, prefix: str, what: str) -> Iterator[Path | None]:
    """A private tmpfs mounted with ``options`` in a new directory named ``prefix...``, or None
    (with a note on stderr ending ``what``) where this process cannot mount one; unmounted and
    removed on the way out, also on Ctrl-C."""
    if os.geteuid() != 0:
        print(f"note: not root: no tmpfs of its own ({options}); {what}", file=sys.stderr)
        yield None
        return
    point = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            print(f"note: cannot mount a tmpfs ({options}: {done.stderr.strip()}); {what}", file=sys.stderr)
            yield None
            return
        try:
            yield point
        finally:
            with signals_ignored():
                if subprocess.run(["umount", str(point)], check=False).returncode != 0:
                    # Something still maps it (an interrupted child): detach now, freed when released.
                    subprocess.run(["umount", "-l", str(point)], check=False)
    finally:
        with signals_ignored(), contextlib.suppress(OSError):
            point.rmdir()


def huge_tmpfs(size: int, what: str) -> contextlib.AbstractContextManager[Path | None]:
    """A private tmpfs of ``size`` bytes mounted huge=within_size, or None where this process
    cannot mount one (``private_tmpfs``)."""
    return private_tmpfs(f"size={size},huge=within_size,mode=0700", "bench-huge-", what)
