"""`make vllm-compat`: vLLM 0.33's own offloading tests, run against vLLM and against kvoffload.

    python -m compat.vllm_compat [--work build/vllm-compat] [--only FILE]... [--jobs N]
                                 [--file-timeout S] [--json PATH]

1. Finds ``vllm-0.33.0.tar.gz`` through pip's own index configuration (``index-url``,
   ``extra-index-url``, ``find-links`` from pip's config files and ``PIP_*`` variables), over
   the simple API (PEP 691 JSON, or PEP 503 HTML), checks its sha256 and unpacks it under the work
   folder. ``pip download`` is not used: for an sdist it runs vLLM's setup.py to learn the version,
   which needs a build toolchain and, with ``VLLM_TARGET_DEVICE=empty``, reports ``0.33.0+empty``.
2. Checks every pin of ``compat/requirements.txt`` against the ranges vLLM declares in the sdist's
   ``requirements/`` and builds a venv of its own (torch's CPU build, then those pins).
3. Collects every test file under ``SCOPES`` (all of ``tests/v1/kv_offload`` and the offloading
   connector's unit tests) and runs each twice, each run one pytest process in a process group of
   its own, with a time limit, in a private tmpfs mounted over ``/dev/shm`` in a mount namespace
   of its own (the host's ``/dev/shm`` is never touched): once on vLLM's source (the baseline)
   and once with ``compat/adapter`` first on PYTHONPATH, which loads kvoffload under vLLM's module
   names in the test process and in every child it spawns. The group is killed when the run ends
   or runs out of time, so no child of a test outlives it. Every failure is run once more, alone.
4. Prints one table over the whole scope, per file: the tests; those that skip or fail on vLLM
   here (the reasons, from each file's own collection and skips, follow the table); how many pass
   on vLLM; how many pass on kvoffload with kvoffload code running (a probe records it per test);
   those that pass on kvoffload but ran no kvoffload code ("vLLM-only"); those that passed only
   when rerun ("flaky", never a plain pass); and kvoffload's failures, split into the deliberate
   differences listed in ``compat/differences.toml`` (each explained in docs/vllm-compat.md) and
   the unexpected ones.

Exit status: 0 when every test that passes on vLLM passes on kvoffload or is a listed
difference; 1 when one does not (it is named, with its first error line), or a listed
difference passes now (the list is stale); 2 when the setup failed (download, a pin outside
vLLM's ranges, venv, unshare); 130 on SIGINT, 143 on SIGTERM (every run's group is killed first).
Nothing from the sdist is copied into the repository.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from .comparison import FileRow, compare
from .differences import Difference, load_differences
from .environment import TORCH, ensure_venv, hf_hub_cache
from .errors import SetupError
from .isolation import EXIT_GRACE_S, Interrupted, ProcessGroups, Terminated, raise_terminated
from .outcomes import PSEUDO, Outcome, settle
from .pins import pins_outside_vllms_ranges, requirement_lines
from .runs import FILE_TIMEOUT_S, FileRun, run_file
from .scope import COMPAT, REPO, SCOPES, SDIST, TARGETS, TESTS, VERSION, discover
from .sdist import download, find_sdist, pip_index_config, unpack
from .tables import render_report

#: One file's run on one side: (target, test file).
RunKey = tuple[str, str]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.file_timeout <= 0:
        parser.error("--file-timeout must be positive")
    work: Path = args.work.resolve()
    targets = TARGETS if args.target == "both" else (args.target,)
    before = shm_listing()
    started = time.monotonic()
    try:
        setup = prepare(work, args.only)
    except SetupError as exc:
        print(f"vllm-compat: {exc}", file=sys.stderr)
        return 2
    for note in setup.notes:
        print(f"vllm-compat: note: {note}", file=sys.stderr)
    notes = list(setup.notes)
    out = work / "runs"
    out.mkdir(parents=True, exist_ok=True)
    hf_cache = hf_hub_cache(work / "hf-hub")
    groups = ProcessGroups()
    signal.signal(signal.SIGTERM, raise_terminated)

    def run(target: str, test_file: str, tests: Sequence[str] = ()) -> FileRun:
        return run_file(
            setup.python,
            setup.sdist,
            target,
            test_file,
            out,
            tests,
            timeout_s=args.file_timeout,
            groups=groups,
            hf_cache=hf_cache,
        )

    try:
        first, rerun, settled = run_and_rerun(run, args.jobs, targets, setup.files, setup.differences, groups)
    except (KeyboardInterrupt, Interrupted) as exc:
        groups.kill_all()
        print("vllm-compat: interrupted; every run's process group was killed", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
    except SetupError as exc:
        print(f"vllm-compat: {exc}", file=sys.stderr)
        return 2
    runs = [(k, "", v) for k, v in first.items()] + [(k, " (rerun)", v) for k, v in rerun.items()]
    notes += run_notes(runs, args.file_timeout)
    if args.target != "both":
        print_side_summaries(settled)
        return 0
    rows = compare_files(setup, first, rerun, settled)
    after = shm_listing()
    if after != before:
        notes.append(f"/dev/shm changed during the run: {sorted(after ^ before)}")
    report = render_report(rows, notes)
    print(report)
    print_problems(rows)
    document = results_document(setup, time.monotonic() - started, notes, rows, runs, rerun, settled)
    (args.json or work / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    (work / "results.md").write_text(report + "\n")
    return 1 if any(r.unexpected or r.stale for r in rows) else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m compat.vllm_compat",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=REPO / "build" / "vllm-compat",
        help="download, venv and reports (default: build/vllm-compat)",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="FILE",
        help=f"run only this test file, named relative to {TESTS} (repeatable)",
    )
    parser.add_argument(
        "--target",
        choices=("both", *TARGETS),
        default="both",
        help="run against vLLM, kvoffload or both (default)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="pytest processes at once (default: 2)")
    parser.add_argument(
        "--file-timeout",
        type=float,
        default=FILE_TIMEOUT_S,
        metavar="S",
        help=f"time limit of one file's run; then its process group is killed (default: {FILE_TIMEOUT_S})",
    )
    parser.add_argument("--json", type=Path, help="also write the results here (default: WORK/results.json)")
    return parser


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the runs need, all of it made before the first starts (``prepare``)."""

    differences: list[Difference]
    sdist_url: str
    sdist: Path
    python: Path
    files: list[str]
    notes: list[str]


def prepare(work: Path, only: Sequence[str] | None) -> Setup:
    """The sdist found, checked and unpacked, the pins checked, the venv built, the files chosen.

    Raises ``SetupError`` when any of it fails (exit 2): nothing has run yet.
    """
    differences = load_differences(COMPAT / "differences.toml")
    config = pip_index_config()
    candidate = find_sdist(config)
    print(f"vllm-compat: {SDIST} from {candidate.url}", file=sys.stderr)
    sdist = unpack(download(candidate, work / SDIST, config.cert), work)
    problems = pins_outside_vllms_ranges(requirement_lines(COMPAT / "requirements.txt"), sdist)
    if problems:
        raise SetupError("compat/requirements.txt: " + "; ".join(problems) + "; pin within vLLM's ranges")
    notes = [
        f"{TORCH} (the CPU build this machine installs; set TORCH to change it) {p.split(': ', 1)[1]}"
        for p in pins_outside_vllms_ranges([TORCH], sdist)
    ]
    python = ensure_venv(work / "venv", COMPAT / "requirements.txt")
    files = discover(sdist)
    unknown = sorted(set(only or ()) - set(files))
    if unknown:
        raise SetupError(f"no such test file: {', '.join(unknown)}; name one of: {' '.join(files)}")
    if only:
        files = [f for f in files if f in only]
    return Setup(differences, candidate.url, sdist, python, files, notes)


def run_and_rerun(
    run: Callable[..., FileRun],
    jobs: int,
    targets: Sequence[str],
    files: Sequence[str],
    differences: Sequence[Difference],
    groups: ProcessGroups,
) -> tuple[dict[RunKey, FileRun], dict[RunKey, FileRun], dict[RunKey, list[Outcome]]]:
    """Every file on every target, then each failure once more, alone: the first runs, the
    reruns, and each file's settled outcomes per target."""
    first = _run_all(jobs, [(t, f) for f in files for t in targets], run, groups)
    # Spawned creators and joiners wait on queues with timeouts that a loaded 2-core machine
    # can miss. Each failure is run once more, alone; one that passes then is "flaky" in the
    # table, never a plain pass. kvoffload's are rerun only where vLLM passes.
    rerun: dict[RunKey, FileRun] = {}
    settled: dict[RunKey, list[Outcome]] = {}
    for target in targets:
        for test_file in files:
            key = (target, test_file)
            worth = _worth_rerunning(target, settled.get(("vllm", test_file)), differences)
            failed = _failures(first[key].outcomes, worth)
            if failed:
                rerun[key] = run(target, test_file, failed)
                print(
                    f"vllm-compat: reran {len(failed)} failed test(s) of {test_file} on {target} alone",
                    file=sys.stderr,
                )
            settled[key] = settle(first[key].outcomes, rerun[key].outcomes if key in rerun else ())
    return first, rerun, settled


def _run_all(
    jobs: int, runs: Sequence[RunKey], run: Callable[[str, str], FileRun], groups: ProcessGroups
) -> dict[RunKey, FileRun]:
    results: dict[RunKey, FileRun] = {}
    pool = concurrent.futures.ThreadPoolExecutor(jobs)
    try:
        futures = {pool.submit(run, target, test_file): (target, test_file) for target, test_file in runs}
        for future in concurrent.futures.as_completed(futures):
            target, test_file = futures[future]
            results[target, test_file] = done = future.result()
            notes = " (timed out)" if done.timed_out else ""
            print(
                f"vllm-compat: ran {test_file} on {target} in {done.duration_s:.0f} s{notes}", file=sys.stderr
            )
    except BaseException:
        # Interrupted (or a run could not start): no queued file starts, no group survives.
        groups.kill_all()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results


def _failures(outcomes: Iterable[Outcome], worth: Callable[[str], bool]) -> tuple[str, ...]:
    return tuple(
        o.test
        for o in outcomes
        if o.outcome in ("failed", "error") and not o.test.endswith(PSEUDO) and worth(o.test)
    )


def _worth_rerunning(
    target: str, vllm: Sequence[Outcome] | None, differences: Sequence[Difference]
) -> Callable[[str], bool]:
    """A kvoffload failure is worth a rerun only where vLLM passes and no difference lists it."""
    if target != "kvoffload" or vllm is None:
        return lambda test: True
    passing = {o.test for o in vllm if o.outcome in ("passed", "flaky")}
    return lambda test: test in passing and not any(d.covers(test) for d in differences)


def run_notes(runs: Iterable[tuple[RunKey, str, FileRun]], file_timeout_s: float) -> list[str]:
    """What the runs' own ends say: a time limit hit, a hang at exit, processes left behind."""
    notes = []
    for (target, test_file), which, done in sorted(runs):
        if done.timed_out:
            notes.append(f"{test_file} on {target}{which} ran out of its {file_timeout_s:.0f} s; killed")
        if done.hung_at_exit:
            notes.append(
                f"{test_file} on {target}{which} wrote its report but had not exited {EXIT_GRACE_S} s"
                " later; killed with its group"
            )
        if done.leftovers:
            notes.append(
                f"{test_file} on {target}{which} left {done.leftovers} process(es); killed with its group"
            )
    return notes


def print_side_summaries(settled: dict[RunKey, list[Outcome]]) -> None:
    """One side alone (``--target``): each file's counts; there is nothing to compare."""
    for (target, test_file), outcomes in sorted(settled.items()):
        counts = collections.Counter(o.outcome for o in outcomes if not o.test.endswith(PSEUDO))
        summary = ", ".join(f"{counts[k]} {k}" for k in ("passed", "flaky", "failed", "error", "skipped"))
        print(f"{test_file} on {target}: {summary}")


def compare_files(
    setup: Setup,
    first: dict[RunKey, FileRun],
    rerun: dict[RunKey, FileRun],
    settled: dict[RunKey, list[Outcome]],
) -> list[FileRow]:
    """The table's rows: each file's settled outcomes on both sides, kvoffload's probe from
    its first run and its rerun."""
    return [
        compare(
            f,
            settled["vllm", f],
            settled["kvoffload", f],
            setup.differences,
            first["kvoffload", f].kvoffload_ran
            | (rerun["kvoffload", f].kvoffload_ran if ("kvoffload", f) in rerun else frozenset()),
        )
        for f in setup.files
    ]


def print_problems(rows: Sequence[FileRow]) -> None:
    for row in rows:
        for o in row.unexpected:
            print(f"unexpected: {o.test}: {o.outcome}: {o.message}")
        for test in row.stale:
            print(f"stale: {test} passes on kvoffload; take it out of compat/differences.toml")


def results_document(
    setup: Setup,
    duration_s: float,
    notes: Sequence[str],
    rows: Sequence[FileRow],
    runs: Iterable[tuple[RunKey, str, FileRun]],
    rerun: dict[RunKey, FileRun],
    settled: dict[RunKey, list[Outcome]],
) -> dict[str, object]:
    """results.json: the rows, every run's end, what was rerun, and every settled outcome."""
    return {
        "vllm": VERSION,
        "sdist": setup.sdist_url,
        "duration_s": duration_s,
        "scopes": list(SCOPES),
        "notes": list(notes),
        "files": [
            {**dataclasses.asdict(r), "unexpected": [dataclasses.asdict(o) for o in r.unexpected]}
            for r in rows
        ],
        "runs": {
            f"{t}:{f}{which}": {
                "duration_s": d.duration_s,
                "timed_out": d.timed_out,
                "hung_at_exit": d.hung_at_exit,
                "leftovers": d.leftovers,
            }
            for (t, f), which, d in sorted(runs)
        },
        "rerun": {f"{t}:{f}": [o.test for o in v.outcomes] for (t, f), v in sorted(rerun.items())},
        "outcomes": {f"{t}:{f}": [dataclasses.asdict(o) for o in v] for (t, f), v in sorted(settled.items())},
    }


def shm_listing() -> frozenset[str]:
    try:
        return frozenset(os.listdir("/dev/shm"))
    except OSError:
        return frozenset()
