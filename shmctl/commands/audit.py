"""``shmctl audit -- CMD ...``: run a command and fail if it left shared memory behind.

Exit status: 0 nothing left (and the command succeeded), 1 leaks found, 2 usage,
3 the command itself failed without leaking (its own exit code is in the report),
128 + N when signal N (SIGINT 130, SIGTERM 143, SIGHUP 129) stopped the audit: the
signal is passed on to the command, and the report of what it left still comes first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from shmctl.commands.scan import DEFAULT_ROOT, JsonOption, RootOption


def audit(
    command: Annotated[list[str], typer.Argument(metavar="-- COMMAND [ARGS]...", help="The command to run.")],
    root: RootOption = DEFAULT_ROOT,
    json_output: JsonOption = False,
    settle: Annotated[
        str,
        typer.Option(
            "--settle",
            metavar="DURATION",
            help="Wait this long after the command before looking (0s, 500ms is not a unit: use 1s).",
        ),
    ] = "0s",
) -> None:
    """Run COMMAND; fail (exit 1) if it leaves vllm_offload_* files or mapped-but-deleted regions."""
    from kvoffload.durations import parse_duration
    from kvoffload.liveness.audit import audit as run_audit
    from shmctl.exit import ExitStatus
    from shmctl.render import audit as render

    report = run_audit(command, Path(root), settle_s=parse_duration(settle, option="--settle"))
    render.audit_report(report, json_output=json_output)
    if report.interrupted_by is not None:
        from shmctl.app import Interrupted

        raise Interrupted(report.interrupted_by, "the command got it too and has exited")
    if not report.clean:
        raise typer.Exit(ExitStatus.FINDINGS)
    if report.command_exit_code != 0:
        raise typer.Exit(ExitStatus.RUNTIME)


def register(app: typer.Typer) -> None:
    app.command(
        "audit",
        context_settings={"allow_interspersed_args": False},
    )(audit)
