"""The ``init-vllm`` scenario: ``shmctl init --engine vllm --json``, as an operator runs it.

Twice: the CPU spec without a fault (verdict ok) and the tiering spec with ``--fail-at
secondary`` (verdict contract-held, the fault fired in the scheduler); each exits 0, leaves no
residue and no engine process, and its report is valid against the init schema (checked with
the test suite's schemas when jsonschema is installed in the engine's venv).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from .engine import ENGINE_TIMEOUT_S
from .environment import REPO
from .inspection import regions
from .kv_config import kv_transfer_config
from .processes import others_in_my_group
from .results import Row


def init_vllm(args: argparse.Namespace, name: str) -> list[Row]:
    """``shmctl init --engine vllm``: no fault (ok), then ``--fail-at secondary`` (contract held)."""
    runs: tuple[tuple[str, str, list[str], str], ...] = (
        ("ok", "cpu", [], "ok"),
        ("fail-at-secondary", "tiering", ["--fail-at", "secondary"], "contract-held"),
    )
    rows = []
    for label, spec, more, verdict in runs:
        extra = kv_transfer_config(spec, "unused")["kv_connector_extra_config"]
        config = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}
        for key in ("spec_module_path", "spec_name"):
            config["kv_connector_extra_config"].pop(key, None)
        if spec == "tiering":
            config["kv_connector_extra_config"]["spec_name"] = "TieringOffloadingSpec"
        argv = [sys.executable, "-m", "shmctl", "init", "--engine", "vllm", "--model", str(args.model)]
        argv += ["--kv-transfer-config", json.dumps(config), "--json", *more]
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=2 * ENGINE_TIMEOUT_S)
        try:
            report = json.loads(done.stdout)
        except json.JSONDecodeError:
            rows.append(
                Row(
                    f"{name}: {label}",
                    f"verdict {verdict}",
                    f"exit {done.returncode}: {done.stderr[-300:]}",
                    False,
                )
            )
            continue
        schema_error = _init_schema_error(report)
        engine = report.get("vllm") or {}
        fault = report.get("fault") or {}
        left = [p["title"] for p in engine.get("processes_left", [])]
        got = (
            f"exit {done.returncode}, verdict {report['verdict']}"
            + (f", fired in {fault.get('fired_in')}" if fault else "")
            + (f", round trip {engine['roundtrip']}" if engine.get("roundtrip") else "")
            + f", residue {[Path(p).name for p in report['residue']['paths']] or 'none'}"
            + f", processes left {left or 'none'}, files left {regions()}"
            + ("" if schema_error is None else f", schema: {schema_error}")
        )
        ok = report["verdict"] == verdict and done.returncode == 0 and not regions() and not left
        ok = ok and schema_error is None and not others_in_my_group()
        if fault:
            ok = ok and fault.get("fired_in") == ["scheduler"]
        rows.append(Row(f"{name}: {label}", f"verdict {verdict}, exit 0, nothing left", got, ok))
    return rows


def _init_schema_error(report: Any) -> str | None:
    """The init schema's complaint about ``report``, or None (jsonschema is optional here)."""
    try:
        sys.path.insert(0, str(REPO))
        from tests.support.schemas import validate
    except ImportError:
        return None
    try:
        validate(report, "init")
    except Exception as e:
        return str(e).splitlines()[0][:200]
    return None
