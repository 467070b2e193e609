"""``shmctl metrics``: Prometheus metrics of the shm root, on stdout or as a textfile.

With ``--textfile DIR`` the metrics go to ``DIR/shmctl.prom`` atomically (temp file +
rename), for node_exporter's textfile collector. Exit status: 0 written, 2 usage, 3 the
root or the directory cannot be used. Orphans are data here, not a failure.

A root that cannot be read still gets an exposition (``shmctl_scan_success 0`` and the
error), written before the exit 3: the textfile of the last good run must not outlive it
and keep vouching for a root nobody can read.
"""

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvoffload.shm.names import DEFAULT_ROOT
from shmctl.options import (
    AllUsersOption,
    AssumeOption,
    FamilyOption,
    NoLeaseOption,
    OwnOnlyOption,
    RootOption,
    scan_options,
)

if TYPE_CHECKING:
    from shmctl.render.metrics import DiskUsage


def metrics(
    root: RootOption = DEFAULT_ROOT,
    grace: Annotated[str, typer.Option("--grace", metavar="DURATION", help="As for scan.")] = "30s",
    all_users: AllUsersOption = False,
    own_only: OwnOnlyOption = False,
    assume_not_holding: AssumeOption = None,
    no_lease: NoLeaseOption = False,
    family: FamilyOption = None,
    top_engines: Annotated[
        int,
        typer.Option(
            "--top-engines",
            min=0,
            metavar="N",
            help='Orphaned engines exported by engine_id, largest first; the rest are summed as "other".',
        ),
    ] = 10,
    textfile: Annotated[
        Path | None,
        typer.Option("--textfile", metavar="DIR", help="Write DIR/shmctl.prom atomically instead of stdout."),
    ] = None,
) -> None:
    """Export region counts and bytes per status, orphaned bytes per engine, blind spots and scan health."""
    import time

    from kvoffload.durations import parse_duration
    from kvoffload.errors import RootError
    from kvoffload.liveness import lease
    from kvoffload.liveness.oneshot import count_root
    from shmctl.render import metrics as render

    options = scan_options(
        parse_duration(grace, option="--grace"),
        all_users=all_users,
        own_only=own_only,
        assume_not_holding=assume_not_holding,
        no_lease=no_lease,
        family=family,
    )
    if textfile is not None:
        render.check_textfile_directory(textfile)
    exposition = render.Exposition(top_engines=top_engines)
    exposition.add_lease_break_time(lease.break_time_s())
    started = time.monotonic()
    try:
        # Counted a region at a time: no report of the root's every file is ever held.
        counted = count_root(root, options, top_engines=top_engines)
        usage = _disk_usage(root)
    except RootError as error:
        carried = None if textfile is None else render.previous_success(textfile, root)
        exposition.add_failure(root, error, attempted_at=time.time(), last_success=carried)
        render.publish(exposition, textfile)
        raise  # the one-line error and exit 3, from shmctl.app
    exposition.add_counted(counted, usage, scan_seconds=time.monotonic() - started)
    render.publish(exposition, textfile)


def _disk_usage(root: Path) -> "DiskUsage":
    import shutil

    from kvoffload.errors import RootError

    try:
        return shutil.disk_usage(root)
    except OSError as e:  # removed or unmounted since the scan opened it
        raise RootError(root, f"cannot read its filesystem's size: {e.strerror or e}") from None


def register(app: typer.Typer) -> None:
    app.command("metrics")(metrics)
