"""One pytest process over one test file (or some of its tests), on vLLM or on kvoffload.

On vLLM the run has the sdist alone on ``PYTHONPATH``; on kvoffload ``compat/adapter`` comes
first, which loads kvoffload under vLLM's module names in the test process and in every child it
spawns, and a probe (``-p kvoffload_probe``) records the tests during which kvoffload code ran.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from .isolation import ProcessGroups, private_shm_argv, run_in_group
from .junit import parse_junit, raised
from .outcomes import Outcome
from .scope import COMPAT, REPO, TESTS

TEST_TIMEOUT_S = 300
FILE_TIMEOUT_S = 1200
#: The pytest plugin of ``compat/adapter`` that records the tests kvoffload code ran in.
PROBE = "kvoffload_probe"


@dataclasses.dataclass(frozen=True)
class FileRun:
    """One pytest process over one file (or some of its tests) on one side."""

    outcomes: tuple[Outcome, ...]
    kvoffload_ran: frozenset[str] = frozenset()  # tests during which kvoffload code ran
    timed_out: bool = False
    leftovers: int = 0
    duration_s: float = 0.0
    hung_at_exit: bool = False


def run_file(
    python: Path,
    sdist: Path,
    target: str,
    test_file: str,
    out: Path,
    tests: Sequence[str] = (),
    *,
    timeout_s: float = FILE_TIMEOUT_S,
    groups: ProcessGroups | None = None,
    hf_cache: Path | None = None,
) -> FileRun:
    """One pytest process for one file (or only ``tests`` of it); outcomes from its JUnit report."""
    stem = f"{target}-{test_file.replace('/', '_')}" + ("-rerun" if tests else "")
    junit = out / f"{stem}.xml"
    probe = out / f"{stem}.probe"
    log = junit.with_suffix(".log")
    junit.unlink(missing_ok=True)
    probe.unlink(missing_ok=True)
    paths = [str(sdist)] if target == "vllm" else [str(COMPAT / "adapter"), str(REPO), str(sdist)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    for name in [n for n in env if n.startswith(("COV_CORE", "COVERAGE_", "KVOFFLOAD_PROBE_"))]:
        del env[name]
    if hf_cache is not None:
        env["HF_HUB_CACHE"] = str(hf_cache)
    plugin: list[str] = []
    if target == "kvoffload":
        env |= {"KVOFFLOAD_PROBE_OUT": str(probe), "KVOFFLOAD_PROBE_ROOT": str(REPO / "kvoffload") + os.sep}
        plugin = ["-p", PROBE]
    argv = [
        *private_shm_argv(),
        str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin,
        f"--timeout={TEST_TIMEOUT_S}",
        f"--junitxml={junit}", "-o", "junit_family=xunit2",
        *([f"{TESTS}/{t}" for t in tests] or [f"{TESTS}/{test_file}"]),
    ]  # fmt: skip
    run = run_in_group(argv, cwd=sdist, env=env, log=log, timeout_s=timeout_s, groups=groups, report=junit)
    outcomes = parse_junit(junit.read_bytes(), test_file) if junit.is_file() else []
    if run.timed_out:
        outcomes.append(Outcome(f"{test_file}::<run>", "error", f"timed out after {timeout_s:.0f} s; killed"))
    elif not junit.is_file():  # pytest stopped before collecting: a conftest.py failed to import
        text = log.read_text(errors="replace")
        tail = text.strip().splitlines()[-1:] or ["no output"]
        outcomes.append(Outcome(f"{test_file}::<run>", "error", (raised(text) or tail[0])[:300]))
    ran = probe.read_text().splitlines() if probe.is_file() else []
    prefix = f"{TESTS}/"
    return FileRun(
        tuple(outcomes),
        frozenset(t.removeprefix(prefix) for t in ran),
        run.timed_out,
        run.leftovers,
        run.duration_s,
        run.hung_at_exit,
    )
