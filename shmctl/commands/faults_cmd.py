"""``shmctl faults``: list every fault point in stage order."""

from typing import Annotated

import typer

from shmctl.options import JsonOption


def faults(
    json_output: JsonOption = False,
    no_headers: Annotated[
        bool, typer.Option("--no-headers", help="Print rows only: no header line.")
    ] = False,
) -> None:
    """List every fault point that `init --fail-at` and KVOFFLOAD_FAILPOINTS accept, in stage order."""
    from kvoffload import faults as registry
    from shmctl.render import faults as render

    render.fault_points(registry.REGISTRY, json_output=json_output, headers=not no_headers)


def register(app: typer.Typer) -> None:
    app.command("faults")(faults)
