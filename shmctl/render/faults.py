"""Rendering of the fault-point registry: a table, or one JSON document (``faults.schema.json``)."""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.faults import INDEXED, FaultPoint
from shmctl.render import Column, emit_json, write_table

#: 1: ``points`` with name, phase, description, indexed.
SCHEMA_VERSION = 1
COLUMNS = (Column("POINT"), Column("PHASE"), Column("WHAT FAILS THERE"))


def fault_points(points: Sequence[FaultPoint], *, json_output: bool, headers: bool = True) -> None:
    if json_output:
        emit_json(
            {
                "schema_version": SCHEMA_VERSION,
                "points": [
                    {
                        "name": p.name,
                        "phase": p.phase,
                        "description": p.description,
                        "indexed": p.name in INDEXED,
                        "tier": p.tier,
                    }
                    for p in points
                ],
            }
        )
        return
    rows = [(p.name + (".N" if p.name in INDEXED else ""), p.phase, p.description) for p in points]
    write_table(COLUMNS, rows, headers=headers)
