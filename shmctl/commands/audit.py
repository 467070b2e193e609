"""``shmctl audit -- CMD ...``: run a command and fail if it left shared memory behind.

The command's stdout and stderr are its own; the report never shares a stream with them
unless named (``/dev/stdout``): ``--report FILE`` writes the JSON document, ``--junit FILE``
a JUnit XML file, and a human summary goes to stderr after the command's output. ``--json``
is refused (it would mix the report into the command's stdout). The output paths are checked
before the command runs (a FIFO's write end is opened then and held, so one that nothing reads
is refused rather than waited on for ever), and the files are written whatever the command
did: failed, leaked, stopped by a signal or could not be started. A regular file is replaced
atomically; a device, a FIFO or an fd by name (``/dev/stdout``) is written in place, never
replaced (``shmctl.render.audit``, ``shmctl.output_files``).

Exit status (the report records it and why, ``exit_status`` and ``exit_reason``):
128 + N when signal N (SIGINT 130, SIGTERM 143, SIGHUP 129) stopped the audit (it is passed
on to the command, and the report of what it left still comes first); 127 when the command
was not found and 126 when it could not be executed, as a shell says (one error line, and
the report says why); the command's own status when it failed (exit code N, or 128 + N when
killed by signal N); else 1 if it leaked, else 0. Before anything runs: 2 for a usage error,
3 for an output the system will not let us write (as for an unreadable --root); after the
command ran, 3 when an output could not be written (the other is still written).
"""

from pathlib import Path
from typing import Annotated

import typer

from kvoffload.shm.names import DEFAULT_ROOT
from shmctl.options import RootOption


def audit(
    command: Annotated[
        list[str], typer.Argument(metavar="[--] COMMAND [ARGS]...", help="The command to run.")
    ],
    root: RootOption = DEFAULT_ROOT,
    report_path: Annotated[
        Path | None,
        typer.Option(
            "--report",
            metavar="FILE",
            help="Write the JSON report to FILE: a regular file atomically; a device, FIFO or "
            "/dev/stdout in place.",
        ),
    ] = None,
    junit_path: Annotated[
        Path | None,
        typer.Option(
            "--junit", metavar="FILE", help="Write a JUnit XML file to FILE: one testcase per leak."
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", hidden=True, help="Refused: the report goes to --report FILE.")
    ] = False,
    settle: Annotated[
        str,
        typer.Option(
            "--settle",
            metavar="DURATION",
            help="Wait this long after the command before looking (0s, 250ms, 2s).",
        ),
    ] = "0s",
) -> None:
    """Run COMMAND; fail if it leaves vllm_offload_* files or mapped-but-deleted regions."""
    from kvoffload.durations import parse_duration
    from kvoffload.errors import ConfigError
    from kvoffload.liveness.audit import audit as run_audit
    from shmctl.render import audit as render

    if json_output:
        raise ConfigError(
            "--json",
            "would print the report on the command's own stdout",
            fix="write it to a file with --report FILE",
        )
    settle_s = parse_duration(settle, option="--settle")
    with render.check_outputs(report_path, junit_path) as outputs:  # before anything runs
        report = run_audit(command, Path(root), settle_s=settle_s)
        render.print_summary(report)
        outputs.write(report)
    if report.interrupted_by is not None:
        from shmctl.app import Interrupted

        raise Interrupted(report.interrupted_by, "the command got it too and has exited")
    raise typer.Exit(report.exit_status)


def register(app: typer.Typer) -> None:
    app.command(
        "audit",
        context_settings={"allow_interspersed_args": False},
    )(audit)
