"""One module per command; each exposes ``register(app)``. Keep imports here cheap."""

from __future__ import annotations

import typer


def register_all(app: typer.Typer) -> None:
    from shmctl.commands import faults_cmd

    for module in (faults_cmd,):
        module.register(app)
