"""``shmctl watch``: one agent per node that scans every shm root each interval and reaps the dead.

Events go to stdout as JSON lines (nothing else does); ``--listen`` serves ``/metrics`` and
``/healthz``. SIGTERM, SIGINT and SIGHUP finish the file at hand and exit 0. Which directories are
roots, and where ``--reap`` may remove, is in ``docs/watch-roots.md``. Exit status: 0 stopped
(or ``--once``/``--max-passes`` done), 2 usage (a bad glob or one whose fixed part does not
exist, ``--listen`` address or port in use, ``--reap`` with one pass: before anything is
scanned). A root's trouble is an event, never an exit.
"""

from typing import Annotated

import typer

from shmctl.options import (
    AssumeOption,
    FamilyOption,
    NoLeaseOption,
    OwnOnlyOption,
    RemoveAllUsersOption,
    scan_options,
)

DEFAULT_ROOTS = ["/dev/shm"]


def watch(
    root: Annotated[
        list[str] | None,
        typer.Option(
            "--root",
            metavar="GLOB",
            help=(
                "Directory or glob of directories to watch, matched again every pass. Repeatable; quote "
                "globs. Default /dev/shm (a node's pods: their kubelet emptyDir volumes, see the README). "
                "Symlinks in a path are resolved once, at start; below a glob's fixed part none is followed."
            ),
        ),
    ] = None,
    interval: Annotated[
        str,
        typer.Option("--interval", metavar="DURATION", help="Time from the start of one pass to the next."),
    ] = "1m",
    reap: Annotated[
        bool,
        typer.Option(
            "--reap",
            help="Remove regions orphaned (the same files) in two passes running, each proven dead again.",
        ),
    ] = False,
    any_filesystem: Annotated[
        bool,
        typer.Option(
            "--any-filesystem",
            help=(
                "With --reap, remove on any filesystem. Without it a root on neither a tmpfs nor a "
                "hugetlbfs is scanned but nothing in it is removed (a removal_refused event says so)."
            ),
        ),
    ] = False,
    grace: Annotated[
        str,
        typer.Option(
            "--grace",
            metavar="DURATION",
            help="Files changed more recently than this are 'starting', never orphaned.",
        ),
    ] = "10m",
    listen: Annotated[
        str | None,
        typer.Option(
            "--listen",
            metavar="HOST:PORT",
            help=(
                "Serve /metrics and /healthz here: HOST:PORT, [IPV6]:PORT, or :PORT for every "
                "address (e.g. 127.0.0.1:9477; port 0: any)."
            ),
        ),
    ] = None,
    once: Annotated[
        bool, typer.Option("--once", help="One pass, then exit (not with --reap: removal needs two passes).")
    ] = False,
    max_passes: Annotated[
        int | None, typer.Option("--max-passes", min=1, metavar="N", help="Exit after N passes.")
    ] = None,
    all_users: RemoveAllUsersOption = False,
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
            help='Orphaned engines exported by engine_id per root; the rest are summed as "other".',
        ),
    ] = 10,
    top_roots: Annotated[
        int,
        typer.Option(
            "--top-roots",
            min=0,
            metavar="N",
            help='Roots exported by name (most orphaned bytes first); the rest are folded into root="other".',
        ),
    ] = 100,
    walk_every: Annotated[
        int,
        typer.Option(
            "--walk-every",
            min=1,
            metavar="N",
            help=(
                "Walk /proc at least every N passes (1: every pass). Between, write leases judge the "
                "regions; unlinked-but-mapped bytes, uninspected processes and holders' names are then "
                "at most N intervals old."
            ),
        ),
    ] = 10,
) -> None:
    """Watch every shm root of a node: JSON events on stdout, metrics over HTTP, --reap the dead."""
    import contextlib
    import signal
    import threading

    from kvoffload.durations import parse_duration
    from kvoffload.errors import ConfigError
    from kvoffload.liveness.watch import WatchConfig, Watcher
    from shmctl.exit import ExitStatus
    from shmctl.render import warning_line
    from shmctl.render.watch import EventWriter
    from shmctl.serve.agent import serving
    from shmctl.serve.state import WatchMetrics

    passes = 1 if once else max_passes
    if reap and passes == 1:
        key, flag = ("--once", "--once") if once else ("--max-passes", "--max-passes 1")
        raise ConfigError(
            key,
            f"with --reap nothing would ever be removed: removal needs two passes ({flag} runs one)",
            fix="pass --max-passes 2 instead, or run 'shmctl reap' for a one-off removal",
        )
    interval_s = parse_duration(interval, option="--interval")
    if interval_s <= 0:
        raise ConfigError("--interval", "must be more than 0", fix="pass a duration such as 30s or 1m")
    config = WatchConfig(
        roots=tuple(root or DEFAULT_ROOTS),
        interval_s=interval_s,
        reap=reap,
        scan=scan_options(
            parse_duration(grace, option="--grace"),
            all_users=all_users,
            own_only=own_only,
            assume_not_holding=assume_not_holding,
            no_lease=no_lease,
            family=family,
        ),
        any_filesystem=any_filesystem,
        top_engines=top_engines,
        walk_every=walk_every,
    )
    stop = threading.Event()

    def _stop(signum: int, frame: object) -> None:
        stop.set()

    metrics = WatchMetrics(interval_s=interval_s, top_engines=top_engines, top_roots=top_roots, reaping=reap)
    watcher = Watcher(config, on_event=EventWriter(), should_stop=stop.is_set)
    # A service stop, Ctrl-C and a closed terminal all end the agent after the current pass.
    # SIGHUP that a caller chose to ignore (nohup) stays ignored.
    stopping = [signal.SIGTERM, signal.SIGINT]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        stopping.append(signal.SIGHUP)
    previous = {sig: signal.signal(sig, _stop) for sig in stopping}
    try:
        with serving(listen, metrics) if listen is not None else contextlib.nullcontext() as bound:
            if bound is not None:
                warning_line(f"serving /metrics and /healthz on http://{_hostport(*bound)}", note=True)
            watcher.run(max_passes=passes, on_pass=metrics.record)
            metrics.alive = False
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    raise typer.Exit(ExitStatus.OK)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def register(app: typer.Typer) -> None:
    app.command("watch")(watch)
