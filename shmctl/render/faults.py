"""Rendering of the fault-point registry."""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.faults import INDEXED, FaultPoint
from shmctl.render import console, emit_json, plain_output


def fault_points(points: Sequence[FaultPoint], *, json_output: bool) -> None:
    if json_output:
        emit_json(
            {
                "points": [
                    {
                        "name": p.name,
                        "phase": p.phase,
                        "description": p.description,
                        "indexed": p.name in INDEXED,
                    }
                    for p in points
                ]
            }
        )
        return
    out = console()
    if plain_output():
        for p in points:
            out.print(f"{p.name}\t{p.phase}\t{p.description}")
        return
    from rich.table import Table

    table = Table(title="fault points (stage order)")
    table.add_column("point")
    table.add_column("phase")
    table.add_column("what fails there")
    for p in points:
        table.add_row(p.name + (".N" if p.name in INDEXED else ""), p.phase, p.description)
    out.print(table)
