"""``shmctl metrics``: Prometheus metrics of the shm root, on stdout or as a textfile.

With ``--textfile DIR`` the metrics go to ``DIR/shmctl.prom`` atomically (temp file +
rename), for node_exporter's textfile collector. Exit status: 0 written, 2 usage, 3 the
root or the directory cannot be used. Orphans are data here, not a failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from shmctl.commands.scan import (
    DEFAULT_ROOT,
    AllUsersOption,
    AssumeOption,
    NoLeaseOption,
    RootOption,
)


def metrics(
    root: RootOption = DEFAULT_ROOT,
    grace: Annotated[str, typer.Option("--grace", metavar="DURATION", help="As for scan.")] = "30s",
    all_users: AllUsersOption = False,
    assume_not_holding: AssumeOption = None,
    no_lease: NoLeaseOption = False,
    textfile: Annotated[
        Path | None,
        typer.Option("--textfile", metavar="DIR", help="Write DIR/shmctl.prom atomically instead of stdout."),
    ] = None,
) -> None:
    """Export region counts and bytes per status, mapped-but-deleted bytes and blind spots."""
    import shutil
    import time

    from kvoffload.durations import parse_duration
    from kvoffload.liveness.scan import scan
    from shmctl.render import metrics as render

    started = time.monotonic()
    report = scan(
        root,
        grace_s=parse_duration(grace, option="--grace"),
        all_users=all_users,
        assume_not_holding=frozenset(assume_not_holding or ()),
        use_lease=not no_lease,
    )
    usage = shutil.disk_usage(root)
    text = render.prometheus_text(report, usage, scan_seconds=time.monotonic() - started)
    if textfile is None:
        render.print_text(text)
    else:
        render.write_textfile(textfile, text)


def register(app: typer.Typer) -> None:
    app.command("metrics")(metrics)
