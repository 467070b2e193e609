"""``shmctl reap``: remove orphaned region files, after proving each one dead again.

Exit status: 0 done (also when some items were kept because they changed, and for
--dry-run), 2 usage (including no terminal to confirm on and no --yes), 3 the root cannot be
read, or is on neither a tmpfs nor a hugetlbfs without --any-filesystem, or a file proven
orphaned could not be removed for a failure of the reaper's own (``failed``: a root out of
inodes where others may rename, a file it could not open or unlink), 130 Ctrl-C.
"""

from typing import Annotated

import typer

from kvoffload.shm.names import DEFAULT_ROOT
from shmctl.options import (
    AssumeOption,
    BytesOption,
    FamilyOption,
    GraceOption,
    JsonOption,
    NoHeadersOption,
    NoLeaseOption,
    OwnOnlyOption,
    RemoveAllUsersOption,
    RootOption,
    scan_options,
)


def _complete_engines(ctx: typer.Context, incomplete: str) -> list[str]:
    """Engine ids of the region files in --root (a directory listing: cheap on every Tab)."""
    import os

    from kvoffload.shm import names

    root = ctx.params.get("root") or os.environ.get("SHMCTL_ROOT") or DEFAULT_ROOT
    return names.engine_ids(root, incomplete)


def reap(
    root: RootOption = DEFAULT_ROOT,
    grace: GraceOption = "30s",
    json_output: JsonOption = False,
    all_users: RemoveAllUsersOption = False,
    own_only: OwnOnlyOption = False,
    assume_not_holding: AssumeOption = None,
    no_lease: NoLeaseOption = False,
    family: FamilyOption = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", "-n", help="Show what would be removed; remove nothing.")
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    engine: Annotated[
        list[str] | None,
        typer.Option(
            "--engine",
            metavar="ID",
            help="Only these engines' regions. Repeatable; shell-style globs ('chat-*'; quote them).",
            autocompletion=_complete_engines,
        ),
    ] = None,
    pid: Annotated[
        list[int] | None,
        typer.Option(
            "--pid", metavar="PID", help="Only regions whose recorded owner is this dead pid. Repeatable."
        ),
    ] = None,
    older_than: Annotated[
        str | None,
        typer.Option(
            "--older-than",
            metavar="DURATION",
            help="Only orphans whose mtime is this old, as ls shows it (a filter, never evidence of death).",
        ),
    ] = None,
    exact_bytes: BytesOption = False,
    no_headers: NoHeadersOption = False,
    any_filesystem: Annotated[
        bool,
        typer.Option(
            "--any-filesystem",
            help=(
                "Remove on any filesystem. Without it region files are removed only on a tmpfs or "
                "hugetlbfs (where regions live and pin memory); a root elsewhere is an error (exit 3)."
            ),
        ),
    ] = False,
) -> None:
    """Remove orphaned region files (and their segments); live, unknown and starting ones stay."""
    import functools
    import sys

    from kvoffload.durations import parse_duration
    from kvoffload.errors import ConfigError
    from kvoffload.liveness import reap as library
    from kvoffload.shm.families import ordered
    from shmctl.exit import ExitStatus
    from shmctl.render import scan as render

    if not (dry_run or yes or sys.stdin.isatty()):
        raise ConfigError(
            "--yes",
            "refusing to remove files without confirmation: stdin is not a terminal",
            fix="pass --yes to confirm, or --dry-run to preview",
        )
    grace_s = parse_duration(grace, option="--grace")
    filters = library.ReapFilter(
        engine_ids=tuple(engine or ()),
        owner_pids=tuple(pid or ()),
        older_than_s=None if older_than is None else parse_duration(older_than, option="--older-than"),
    )
    options = scan_options(
        grace_s,
        all_users=all_users,
        own_only=own_only,
        assume_not_holding=assume_not_holding,
        no_lease=no_lease,
        family=family,
    )
    run = functools.partial(library.reap, root, options, filters=filters, any_filesystem=any_filesystem)
    writer = functools.partial(
        render.ReapWriter,
        json_output=json_output,
        families=ordered(options.families),
        filters_text=_filters_text(engine, pid, older_than),
        exact_bytes=exact_bytes,
        headers=not no_headers,
    )
    plan = None
    if not (dry_run or yes):
        plan = run(dry_run=True)  # what the operator confirms: held whole, and shown
        if not plan.removed:
            render.reap_report(
                plan,
                json_output=json_output,
                filters_text=_filters_text(engine, pid, older_than),
                exact_bytes=exact_bytes,
                headers=not no_headers,
            )
            raise typer.Exit(ExitStatus.OK)
        render.reap_preview(plan, exact_bytes=exact_bytes)
        if not typer.confirm(render.confirm_question(plan), default=False, err=True):
            render.reap_declined()
            raise typer.Exit(ExitStatus.OK)
    # One scan, a region at a time; each orphan the filters choose (and, confirmed, only what
    # the plan listed) is proven dead again as the stream reaches it, and every list of the
    # report is written out as it comes (a plan scan before it doubled a 10,000-file reap).
    out = writer(dry_run=dry_run)
    try:
        done = library.reap_into(
            out, root, options, filters=filters, dry_run=dry_run, only=plan, any_filesystem=any_filesystem
        )
    except BaseException:
        out.close()
        raise
    out.finish(done)
    failed = not dry_run and bool(out.lists["failed"].files)
    raise typer.Exit(ExitStatus.RUNTIME if failed else ExitStatus.OK)


def _filters_text(engine: list[str] | None, pid: list[int] | None, older_than: str | None) -> str:
    """The filters as the operator typed them, for "do not match --older-than 1h"."""
    import shlex

    words = [f"--engine {shlex.quote(e)}" for e in engine or ()]
    words += [f"--pid {p}" for p in pid or ()]
    if older_than is not None:
        words.append(f"--older-than {shlex.quote(older_than)}")
    return " ".join(words)


def register(app: typer.Typer) -> None:
    app.command("reap")(reap)
