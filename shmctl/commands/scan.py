"""``shmctl scan``: which region files are live, orphaned, starting, unknown or skipped.

Exit status: 0 nothing orphaned, 1 orphans found (or files a dead reap left parked), 2 usage,
3 the root cannot be read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def _root_path(text: str | Path) -> Path:
    # Path("") is ".": an empty --root (or SHMCTL_ROOT='') would judge the current directory.
    if isinstance(text, str) and not text.strip():
        raise typer.BadParameter("is empty (it would mean the current directory); pass --root /dev/shm")
    return Path(text)


RootOption = Annotated[
    Path,
    typer.Option(
        "--root",
        envvar="SHMCTL_ROOT",
        metavar="PATH",
        help="Directory holding the region files.",
        show_default=True,
        # The library reports an unreadable root (exit 3, with a fix); click's own path check
        # would make it a usage error (exit 2) without one.
        parser=_root_path,
    ),
]
GraceOption = Annotated[
    str,
    typer.Option(
        "--grace",
        metavar="DURATION",
        help="Files changed more recently than this are 'starting', never orphaned (30s, 5m, 1h30m).",
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]
AllUsersOption = Annotated[
    bool, typer.Option("--all-users", help="Also judge other users' files (root only).")
]
AssumeOption = Annotated[
    list[int] | None,
    typer.Option(
        "--assume-not-holding",
        metavar="PID",
        help=(
            "Vouch that PID maps no region although it cannot be inspected. Repeatable. Needed only "
            "where no write lease can be taken (--no-lease, another uid's files without root)."
        ),
    ),
]

NoLeaseOption = Annotated[
    bool,
    typer.Option(
        "--no-lease",
        envvar="SHMCTL_NO_LEASE",
        help=(
            "Do not take write leases: judge from /proc, locks and owner records alone "
            "(fail-closed: what they cannot prove stays unknown)."
        ),
    ),
]

BytesOption = Annotated[
    bool, typer.Option("--bytes", help="Print sizes as exact integers of bytes, not KiB/MiB/GiB.")
]
NoHeadersOption = Annotated[
    bool, typer.Option("--no-headers", help="Print rows only: no header line (the summary is on stderr).")
]

DEFAULT_ROOT = Path("/dev/shm")


def scan(
    root: RootOption = DEFAULT_ROOT,
    grace: GraceOption = "30s",
    json_output: JsonOption = False,
    all_users: AllUsersOption = False,
    assume_not_holding: AssumeOption = None,
    no_lease: NoLeaseOption = False,
    deleted: Annotated[
        bool,
        typer.Option("--deleted", help="Also list unlinked regions still mapped or open, per process."),
    ] = False,
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit",
            min=0,
            metavar="N",
            help="Regions shown (0: all). Default: 50 on a terminal, all in a pipe. JSON is never cut.",
        ),
    ] = None,
    exact_bytes: BytesOption = False,
    no_headers: NoHeadersOption = False,
) -> None:
    """Tell live region files from orphans by kernel evidence (lease, holders, locks), never by age."""
    from kvoffload.durations import parse_duration
    from kvoffload.liveness.scan import Status
    from kvoffload.liveness.scan import scan as run_scan
    from shmctl.exit import ExitStatus
    from shmctl.render import scan as render

    report = run_scan(
        root,
        grace_s=parse_duration(grace, option="--grace"),
        all_users=all_users,
        assume_not_holding=frozenset(assume_not_holding or ()),
        use_lease=not no_lease,
    )
    render.scan_report(
        report,
        json_output=json_output,
        show_deleted=deleted,
        limit=limit,
        exact_bytes=exact_bytes,
        headers=not no_headers,
    )
    unsettled = any(e.parked is not None and not e.parked.reaper_running for e in report.entries)
    found = unsettled or bool(report.with_status(Status.ORPHANED))
    raise typer.Exit(ExitStatus.FINDINGS if found else ExitStatus.OK)


def register(app: typer.Typer) -> None:
    app.command("scan")(scan)
