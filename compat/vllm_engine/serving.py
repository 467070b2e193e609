"""The scenarios that serve: ``baseline``, and ``serve-<spec>`` with kvoffload's spec.

``baseline`` runs the engine without offload; its greedy tokens are the reference (kept in
``<work>/baseline.json``, so it runs first). ``serve-<spec>`` checks that the region is held by
the engine's processes alone, that blocks were stored and then loaded back after
``reset_prefix_cache()``, that the tokens are the baseline's, and that a clean exit leaves
nothing in ``/dev/shm``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .engine import engine
from .inspection import regions, shmctl
from .kv_config import kv_transfer_config
from .processes import comm
from .results import Row


def baseline(args: argparse.Namespace, name: str) -> list[Row]:
    with engine(args, name, None) as e:
        facts = e.wait_ready()
        status = e.stop()
    if facts is None:
        return [Row(name, "serves without offload", f"did not come up: {e.tail()}", False)]
    (Path(args.work) / "baseline.json").write_text(json.dumps(facts))
    got = f"up in {facts['up_s']} s, {len(facts['tokens'])} tokens, exit {status}"
    return [Row(name, "serves without offload; greedy tokens are the reference", got, status == 0)]


def serve(args: argparse.Namespace, name: str, spec: str) -> list[Row]:
    engine_id = f"vle-{spec}"
    region = f"vllm_offload_{engine_id}.mmap"
    reference_path = Path(args.work) / "baseline.json"
    reference = json.loads(reference_path.read_text())["tokens"] if reference_path.is_file() else None
    rows: list[Row] = []
    with engine(args, name, kv_transfer_config(spec, engine_id)) as e:
        facts = e.wait_ready()
        if facts is None:
            return [Row(name, "serves with kvoffload's spec", f"did not come up: {e.tail()}", False)]
        _, doc, _ = shmctl(sys.executable, "scan", "--json", "--grace", "0s")
        doc = doc or {}
        holders = {h["pid"] for x in doc.get("entries", []) if x["name"] == region for h in x["holders"]}
        holders |= {d["pid"] for d in doc.get("deleted", []) if Path(d["path"]).name == region}
        live = [x["status"] for x in doc.get("entries", []) if x["name"] == region]
        held = bool(holders) and holders <= set(e.tree)
        where = f"live file ({live})" if live else "deleted, still mapped"
        rows.append(
            Row(
                f"{name}: region",
                f"{region} created by kvoffload, held only by the engine's processes",
                f"{where}; holders {sorted(comm(p) for p in holders)}",
                held and all(s == "live" for s in live),
            )
        )
        moved = facts["store_bytes"] > 0 and facts["load_bytes"] > 0 and facts["external_hits"] > 0
        rows.append(
            Row(
                f"{name}: offload",
                "blocks stored, and loaded back after reset_prefix_cache()",
                f"stored {facts['store_bytes']} B, loaded {facts['load_bytes']} B, "
                f"{facts['external_hits']} tokens from the region",
                moved,
            )
        )
        same = facts["tokens_after_reset"] == facts["tokens"] and (
            reference is None or reference == facts["tokens"]
        )
        rows.append(
            Row(
                f"{name}: outputs",
                "greedy tokens equal the no-offload run's",
                "equal"
                if same
                else f"differ: {facts['tokens']} / {facts['tokens_after_reset']} / {reference}",
                same and reference is not None,
            )
        )
        status = e.stop()
    left = regions()
    rows.append(
        Row(
            f"{name}: exit",
            "clean exit, nothing left in /dev/shm",
            f"exit {status}, left {left}",
            status == 0 and not left,
        )
    )
    return rows
