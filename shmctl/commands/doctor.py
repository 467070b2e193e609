"""``shmctl doctor``: is this node ready for shmctl and vLLM's KV offload? A verdict per check, with the fix.

Exit status: 0 no check failed (warnings allowed: shmctl works there, with less certainty or
speed), 1 a check failed (a finding: a planned region does not fit, the root is not in
memory, reap could prove nothing, the textfile cannot be written), 2 usage (a bad --need, a
--plan that cannot be sized), 3 the root cannot be looked at (missing, not a directory,
unreadable), as for every command with --root.
"""

from pathlib import Path
from typing import Annotated

import typer

from kvoffload.shm.names import DEFAULT_ROOT
from shmctl.options import (
    JsonOption,
    PlanGpuBlockSizeOption,
    PlanKvBytesPerBlockOption,
    PlanModelOption,
    PlanWorldSizeOption,
    RootOption,
)


def doctor(
    root: RootOption = DEFAULT_ROOT,
    plan: Annotated[
        list[Path] | None,
        typer.Option(
            "--plan",
            metavar="FILE",
            help="An engine's --kv-transfer-config (JSON, or TOML *.toml) whose region must fit, sized as "
            "`init --dry-run` sizes it. Repeatable: every engine of the node.",
        ),
    ] = None,
    kv_bytes_per_block: PlanKvBytesPerBlockOption = None,
    model: PlanModelOption = None,
    world_size: PlanWorldSizeOption = 1,
    gpu_block_size: PlanGpuBlockSizeOption = 16,
    need: Annotated[
        list[str] | None,
        typer.Option(
            "--need",
            metavar="BYTES",
            help="Bytes a region needs (40g, 512m: powers of 1024). Repeatable; adds to --plan.",
        ),
    ] = None,
    textfile: Annotated[
        Path | None,
        typer.Option(
            "--textfile",
            metavar="DIR",
            help="node_exporter's textfile directory to check. Default: "
            "/var/lib/prometheus/node-exporter, skipped where it does not exist.",
        ),
    ] = None,
    json_output: JsonOption = False,
) -> None:
    """Check the node for what shmctl and KV offload need: a verdict per line, with the fix."""
    from kvoffload import doctor as library
    from shmctl.exit import ExitStatus
    from shmctl.render import doctor as render

    planned = library.planned_from_files(
        plan or (),
        kv_bytes_per_block=kv_bytes_per_block,
        model=model,
        world_size=world_size,
        gpu_block_size=gpu_block_size,
        root=root,
    )
    planned += [library.planned_bytes(text) for text in need or ()]
    report = library.diagnose(root, planned=planned, textfile=textfile)
    render.doctor_report(report, json_output=json_output)
    raise typer.Exit(ExitStatus.FINDINGS if report.failed else ExitStatus.OK)


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
