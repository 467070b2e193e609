"""One module per command; each exposes ``register(app)``. Keep imports here cheap."""

from __future__ import annotations

import typer


def register_all(app: typer.Typer) -> None:
    from shmctl.commands import audit, doctor, faults_cmd, init, metrics, reap, scan, watch

    for module in (scan, reap, init, faults_cmd, audit, metrics, watch, doctor):
        module.register(app)
