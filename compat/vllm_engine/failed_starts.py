"""The scenarios whose engine must fail to start, under ``shmctl audit``, and leave nothing.

``fault-<spec>-<point>`` injects a fault at one init point (``KVOFFLOAD_FAILPOINTS``);
``vllm-own-spec`` starts vLLM's own CPU spec, which refuses this platform. Either way the start
must fail with the original error in the engine's log, the audit must find no file and no
deleted mapping left, and no process of the engine may outlive it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .engine import ENGINE_TIMEOUT_S
from .environment import HARNESS
from .inspection import regions
from .kv_config import kv_transfer_config
from .processes import kill_tree, others_in_my_group
from .results import Row


def audited_start(
    args: argparse.Namespace, name: str, config: Mapping[str, Any], env: Mapping[str, str]
) -> Row:
    """``shmctl audit -- <engine>``: the start must fail as ``expect`` says and leave nothing."""
    out = Path(args.work) / "scenarios" / f"{name}.engine.json"
    log = out.with_suffix(".log")
    report_path = out.with_suffix(".audit.json")
    report_path.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "shmctl", "audit", "--report", str(report_path), "--"]
    argv += [sys.executable, str(HARNESS), "engine", "--model", str(args.model)]
    argv += ["--out", str(out), "--kv-config", json.dumps(config)]
    with log.open("wb") as sink:
        # In the scenario's process group, as the engines are (see ``Engine``).
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **env})
        try:
            proc.wait(timeout=ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Row(name, "start fails", "timed out", False)
        finally:
            kill_tree(proc.pid)
            proc.wait()
    try:
        report = json.loads(report_path.read_text())
    except (OSError, json.JSONDecodeError):
        return Row(name, "an audit report", f"audit exit {proc.returncode}, no report", False)
    text = log.read_text(errors="replace")
    expect: Callable[[str], str | None] = args.expect
    error = expect(text)
    left_procs = others_in_my_group()
    leaked = [x["name"] for x in report.get("leaked", [])] + [
        d["path"] for d in report.get("leaked_deleted", [])
    ]
    failed = report.get("command_exit_code") not in (0, None) or report.get("command_signal") is not None
    got = (
        f"exit {report.get('command_exit_code')}, "
        + (f"error {error}" if error else "original error not found")
        + f"; audit: {'clean' if report.get('clean') and not leaked else f'leaked {leaked}'}"
        + f"; processes left {len(left_procs)}, files left {regions()}"
    )
    ok = failed and error is not None and report.get("clean") is True and not leaked and not left_procs
    ok = ok and not regions()
    return Row(name, args.expected, got, ok)


def fault(args: argparse.Namespace, name: str, spec: str, point: str) -> list[Row]:
    needle = f"InjectedFault: injected fault at {point}"

    def expect(text: str) -> str | None:
        """The original error, and the engine processes it was raised in (vLLM's log prefix)."""
        where = sorted(
            {
                line[1:].split(" pid=")[0] if line.startswith("(") and " pid=" in line else "client"
                for line in text.splitlines()
                if needle in line
            }
        )
        return f"InjectedFault at {point} in {', '.join(where)}" if where else None

    args.expect = expect
    args.expected = f"start fails with InjectedFault at {point}; audit clean; no process left"
    env = {"KVOFFLOAD_FAILPOINTS": f"{point}=raise"}
    return [audited_start(args, name, kv_transfer_config(spec, f"vle-fault-{spec}"), env)]


def vllm_own_spec(args: argparse.Namespace, name: str) -> list[Row]:
    refusal = "only supported on CUDA-alike"

    def expect(text: str) -> str | None:
        return f"'{refusal}'" if refusal in text else None

    args.expect = expect
    args.expected = "vLLM 0.32's own CPU spec refuses this platform at start; audit clean"
    return [audited_start(args, name, kv_transfer_config("vllm", "vle-own"), {})]
