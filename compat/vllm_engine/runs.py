"""One scenario, run from outside: a process of the engine's venv, isolated, its rows read back.

The scenario is ``python HARNESS scenario NAME`` in the engine's venv, the leader of a process
group of its own with a time limit, in a mount namespace of its own with a fresh tmpfs on
``/dev/shm`` (``vllm_compat.isolation``, as each vLLM test file runs): the host's ``/dev/shm`` is
never touched, and the whole group (the scenario and every engine process it started) is killed
when it ends. Its rows come back as ``<work>/scenarios/<name>.json``; a scenario that wrote none
is one failed row naming its log.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_compat.isolation import ProcessGroups, private_shm_argv, run_in_group

from .environment import HARNESS, entry_points_path, offline_env
from .results import Row

SCENARIO_TIMEOUT_S = 900.0


def run_scenario(python: Path, name: str, work: Path, model: Path, groups: ProcessGroups) -> list[Row]:
    out = work / "scenarios" / f"{name}.json"
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    argv = [
        *private_shm_argv(),
        str(python),
        str(HARNESS),
        "scenario",
        name,
        "--model",
        str(model),
        "--work",
        str(work),
        "--out",
        str(out),
    ]
    run = run_in_group(
        argv,
        cwd=work,
        env=offline_env(entry_points_path(work)),
        log=log,
        timeout_s=SCENARIO_TIMEOUT_S,
        groups=groups,
    )
    if out.is_file():
        return [Row(**r) for r in json.loads(out.read_text())]
    why = "timed out" if run.timed_out else f"exit status {run.returncode}"
    return [Row(name, "a result", f"no result ({why}; see {log})", False)]
