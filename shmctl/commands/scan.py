"""``shmctl scan``: which region files are live, orphaned, starting, unknown or skipped.

Exit status: 0 nothing orphaned, 1 orphans found (or files a dead reap left parked), 2 usage,
3 the root cannot be read.
"""

from typing import Annotated

import typer

from kvoffload.shm.names import DEFAULT_ROOT
from shmctl.options import (
    AllUsersOption,
    AssumeOption,
    BytesOption,
    FamilyOption,
    GraceOption,
    JsonOption,
    NoHeadersOption,
    NoLeaseOption,
    OwnOnlyOption,
    RootOption,
    scan_options,
)


def scan(
    root: RootOption = DEFAULT_ROOT,
    grace: GraceOption = "30s",
    json_output: JsonOption = False,
    all_users: AllUsersOption = False,
    own_only: OwnOnlyOption = False,
    assume_not_holding: AssumeOption = None,
    no_lease: NoLeaseOption = False,
    family: FamilyOption = None,
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
    from kvoffload.liveness.oneshot import JudgedRoot
    from shmctl.exit import ExitStatus
    from shmctl.render import scan as render

    options = scan_options(
        parse_duration(grace, option="--grace"),
        all_users=all_users,
        own_only=own_only,
        assume_not_holding=assume_not_holding,
        no_lease=no_lease,
        family=family,
    )
    # Judged a region at a time and written as it goes: a root of 100,000 files is never one
    # report in memory (docs/agent-memory.md).
    with JudgedRoot(root, options) as judged:
        shown = render.scan_judged(
            judged,
            json_output=json_output,
            show_deleted=deleted,
            limit=limit,
            exact_bytes=exact_bytes,
            headers=not no_headers,
        )
    if not own_only:  # --own-only chose to skip them: nothing to say
        _note_others_skipped(shown.others_skipped)
    found = shown.unsettled or bool(shown.report.summary.orphaned)
    raise typer.Exit(ExitStatus.FINDINGS if found else ExitStatus.OK)


def _note_others_skipped(others: int) -> None:
    """One line on stderr when other users' files were skipped: exit 0 and ``N skipped`` alone
    read as "all clear" to a user who cannot judge them (only root can: ``--own-only``)."""
    from shmctl.render import warning_line

    if others:
        files = "1 file was" if others == 1 else f"{others} files were"
        warning_line(
            f"{files} skipped because they belong to other users, whose files only root can judge: "
            "run as root or as their owner to judge them (--own-only skips them without this note)",
            note=True,
        )


def register(app: typer.Typer) -> None:
    app.command("scan")(scan)
