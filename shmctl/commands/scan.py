"""``shmctl scan``: which region files are live, orphaned, starting, unknown or skipped.

Exit status: 0 nothing orphaned, 1 orphans found (or files a dead reap left parked), 2 usage,
3 the root cannot be read.
"""

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from kvoffload.liveness.scan import ScanOptions


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
    bool,
    typer.Option(
        "--all-users",
        help="Judge every user's files: root's default, so a no-op for root; refused to other users.",
    ),
]
#: ``reap`` and ``watch``: root judges every user's files anyway; the flag is what removes them.
RemoveAllUsersOption = Annotated[
    bool,
    typer.Option(
        "--all-users",
        help=(
            "Also remove other users' orphaned files (root only). Without it root judges them "
            "and leaves them, saying so."
        ),
    ),
]
OwnOnlyOption = Annotated[
    bool,
    typer.Option("--own-only", help="Judge only your own files, even as root (others' are skipped)."),
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


def whose_files(all_users: bool, own_only: bool) -> bool | None:
    """``--all-users`` and ``--own-only`` as the library's ``all_users``: True, False, or None
    (the default: every user's files as root, your own otherwise)."""
    from kvoffload.errors import ConfigError

    if all_users and own_only:
        raise ConfigError(
            "--own-only", "cannot be combined with --all-users", fix="pass one of them, or neither"
        )
    return True if all_users else False if own_only else None


def scan_options(
    grace_s: float,
    *,
    all_users: bool,
    own_only: bool,
    assume_not_holding: list[int] | None,
    no_lease: bool,
) -> "ScanOptions":
    """The scan flags (``--grace`` parsed) as the library's ``ScanOptions``."""
    from kvoffload.liveness.scan import ScanOptions

    return ScanOptions(
        grace_s=grace_s,
        all_users=whose_files(all_users, own_only),
        assume_not_holding=frozenset(assume_not_holding or ()),
        use_lease=not no_lease,
    )


def scan(
    root: RootOption = DEFAULT_ROOT,
    grace: GraceOption = "30s",
    json_output: JsonOption = False,
    all_users: AllUsersOption = False,
    own_only: OwnOnlyOption = False,
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

    options = scan_options(
        parse_duration(grace, option="--grace"),
        all_users=all_users,
        own_only=own_only,
        assume_not_holding=assume_not_holding,
        no_lease=no_lease,
    )
    report = run_scan(root, options)
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
