"""Rendering of ``shmctl init``: the plan, the bring-up report, the matrix, and live progress.

JSON is the library's dataclass serialised (``InitPlan``, ``InitReport``, ``MatrixReport``).
Each section is a ``# title`` line and rows under aligned columns (``write_table``): the
same on a terminal and in a pipe, colour aside. Names (engine ids, paths, error messages)
are arbitrary strings: their control characters are escapes, and nothing is ever read as
markup. Progress (a spinner from the first moment, then populate bars) goes to stderr, and
only when stderr is a terminal.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from shmctl.render import (
    Column,
    color_enabled,
    console,
    emit_json,
    human_bytes,
    printable,
    size_text,
    styled,
    warning_line,
    write_table,
)

if TYPE_CHECKING:
    from kvoffload.bringup import InitPlan, InitReport, LiveEngine, MatrixCell, MatrixReport, ProgressEvent
    from kvoffload.bringup.report import ErrorInfo, KeptFile, MatrixStop, StageResult, VllmEngineInfo
    from kvoffload.bringup.residue import Residue

VERDICT_TEXT = {
    "ok": "up and down cleanly; nothing left behind",
    "contract-held": "the injected failure was cleaned up: nothing left behind",
    "not-fired": "the fault never fired; nothing left behind",
    "leaked": "files, threads or sockets were left behind (the cleanup contract did not hold)",
    "orphaned": "the crash left files behind: they are orphans now",
    "failed": "init failed for a reason that was not injected",
}
VERDICT_STYLE = {
    "ok": "green",
    "contract-held": "green",
    "not-fired": "yellow",
    "leaked": "bold red",
    "orphaned": "bold red",
    "failed": "bold red",
}


def warnings(lines: Sequence[str]) -> None:
    for line in lines:
        warning_line(line)


# ----------------------------------------------------------------- sections


def _section(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """``# title`` and the rows under aligned columns: the same on a terminal and in a pipe."""
    _write(f"# {title}", "bold")
    write_table([Column(c.upper()) for c in columns], [[_cell(v) for v in row] for row in rows])


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return printable(str(value), escape_backslash=False)


def _write(text: str, style: str | None = None) -> None:
    # Engine ids and paths may carry control characters: one report line stays one line, and
    # a tab in an engine id is an escape like the rest (no line of ours holds a tab).
    sys.stdout.write(styled(printable(text, escape_backslash=False), style, color=color_enabled()) + "\n")


def _line(text: str, style: str | None = None) -> None:
    _write(text, style)


def _command(command: str) -> None:
    """A shell command to copy, indented, on one line however narrow the terminal.

    It is built shell-quoted in visible characters (``kvoffload.liveness.reap.shell_word``) and written
    as it is: a line wrapped by a renderer would paste as two commands.
    """
    _write(f"  {command}")


def _bytes(n: int | None) -> str:
    return "-" if n is None else f"{n} ({human_bytes(n)})"


# ----------------------------------------------------------------- plan


def plan(the_plan: InitPlan, *, json_output: bool) -> None:
    if json_output:
        emit_json(the_plan)
        return
    p = the_plan
    _line(
        f"plan: {p.spec}, engine {p.engine_id}, world size {p.world_size}, lifetime {p.lifetime} "
        "(dry run: nothing allocated)",
    )
    g, s = p.geometry, p.sizing
    _section(
        "sizing (vLLM's names)",
        ("figure", "value"),
        [
            ("cpu_bytes_to_use", _bytes(g.cpu_bytes_to_use)),
            ("worker_kv_bytes_per_block", g.worker_kv_bytes_per_block),
            ("gpu_block_size", g.gpu_block_size),
            ("blocks_per_chunk", g.blocks_per_chunk),
            ("replicated_layout", g.replicated_layout),
            ("num_chunks", s.num_chunks),
            ("kv_bytes_per_chunk", s.kv_bytes_per_chunk),
            ("cpu_page_size_per_worker", s.cpu_page_size_per_worker),
            ("row_padding", s.row_padding),
            ("total_bytes", _bytes(s.total_bytes)),
        ],
    )
    _section(
        f"files ({len(p.files)}); path: {p.path_lifetime}",
        ("path", "segment", "offset", "bytes"),
        [(f.path, f.segment, f.offset, _bytes(f.bytes)) for f in p.files],
    )
    layout = p.layout
    rows: list[tuple[object, ...]] = [
        (f"worker {w.rank}", f"[{w.offset}, {w.offset + w.bytes})", _bytes(w.populate_bytes))
        for w in layout.slots
    ]
    if layout.scheduler_populate_bytes:
        rows.append(("scheduler", "whole rows", _bytes(layout.scheduler_populate_bytes)))
    _section(
        f"worker slots: {layout.rows} rows x {layout.row_bytes} bytes; slot {layout.slot_bytes} bytes"
        f" x {layout.copies} cop{'y' if layout.copies == 1 else 'ies'}; padding {layout.padding} bytes/row",
        ("participant", "bytes of every row", "pre-faults"),
        rows,
    )
    if p.tiers:
        _section(
            "tiers (creation order)",
            ("tier", "type", "chunks", "bytes", "options"),
            [
                (
                    f"{t.role}" + (f" {t.index}" if t.role == "secondary" else ""),
                    t.type,
                    t.chunks,
                    size_text(t.bytes, exact=False) if t.bytes is not None else "-",  # one field
                    _options(t.options),
                )
                for t in p.tiers
            ],
        )
    _section(
        "stages (in order; --fail-at takes these names)",
        ("stage", "phase", "runs in", "what fails there"),
        [
            (
                st.name,
                st.phase,
                ", ".join(st.sides) + (" (creator only)" if st.creator_only else ""),
                st.description,
            )
            for st in p.stages
        ],
    )
    c = p.capacity
    fs = f" ({c.fs_type})" if c.fs_type else ""
    verdict = "fits" if c.fits else "DOES NOT FIT"
    _line(
        f"capacity: {c.root}{fs}: {human_bytes(c.free_bytes)} free of {human_bytes(c.mount_bytes)}, "
        f"{human_bytes(c.needed_bytes)} needed: {verdict}",
        "green" if c.fits else "bold red",
    )
    if c.fix:
        _line(f"fix: {c.fix}", "yellow")
    h = p.huge_pages
    where = f"{h.mount_point} ({h.fs_type})" if h.mount_point is not None else "the root's mount (unknown)"
    policy = f"huge={h.huge}, " if h.huge is not None else ""
    system = f"shmem_enabled {h.shmem_enabled}" if h.shmem_enabled is not None else "no shmem_enabled"
    verdict = "off: 4 KiB pages" if h.effective == "never" else f"on ({h.effective})"
    _line(f"huge pages: {where}: {policy}{system}: {verdict}")
    if h.fix:
        _line(f"fix: {h.fix}", "yellow")


def _options(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "-"


# ----------------------------------------------------------------- bring-up


@contextlib.contextmanager
def progress(*, json_output: bool, starting: str = "") -> Iterator[Callable[[ProgressEvent], None] | None]:
    """Live progress on a terminal's stderr (never in JSON mode, never in a pipe).

    ``starting`` shows at once, with a spinner and the elapsed time: spawning the
    participants and importing torch take seconds before the first populate bar.
    """
    if json_output or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    class PopulatedColumn(DownloadColumn):
        """Bytes pre-faulted of the total; nothing for the spinner line, which has no total."""

        def render(self, task: Any) -> Any:
            return "" if task.total is None else super().render(task)

    bars: dict[str, Any] = {}
    with Progress(
        SpinnerColumn(),
        # Not markup: "[bold]" in an engine id is its text, not a style.
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        PopulatedColumn(binary_units=True),
        TimeRemainingColumn(),
        TimeElapsedColumn(),
        console=console(stderr=True),
        transient=True,
    ) as bar:
        if starting:
            bar.add_task(printable(starting, escape_backslash=False), total=None)

        def update(event: ProgressEvent) -> None:
            key = f"{event.participant} {event.stage}"
            if key not in bars:
                bars[key] = bar.add_task(f"{key}: populate", total=event.total)
            bar.update(bars[key], completed=event.done, total=event.total)

        yield update


def dry_run_injects_nothing(points: Sequence[str]) -> None:
    """``--dry-run --fail-at X``: the fault is parsed and planned, never fired. Say so."""
    shown = " ".join(f"--fail-at {p}" for p in points)
    warning_line(
        f"a dry run injects nothing: {shown} was checked and is shown in the plan, not fired; "
        "drop --dry-run to inject it",
        note=True,
    )


def announce_hold(live: LiveEngine) -> None:
    """``--hold``: say what is up, on stderr (stdout stays the report)."""
    err = console(stderr=True)
    pids = ", ".join(f"{name} pid {pid}" for name, pid in live.pids.items())
    files = ", ".join(str(f) for f in live.files) or "none visible (the path is already unlinked)"
    for line in (
        f"engine {live.engine_id} is up: {pids}",
        f"region files in {live.root}: {files}",
        f"path: {live.path_lifetime}",
    ):
        err.print(printable(line, escape_backslash=False), markup=False, highlight=False)
    # An unlinked path has no name left to list: only --deleted finds it (by its mappings).
    deleted = "" if live.files else " --deleted"
    err.print(
        f"`shmctl scan{deleted} --root {live.root}` in another terminal shows it; "
        "Ctrl-C (or SIGTERM, SIGHUP) tears it down",
        markup=False,
        highlight=False,
    )


def init_report(report: InitReport, *, json_output: bool) -> None:
    if json_output:
        emit_json(report)
        return
    r = report
    fault = ""
    if r.fault is not None:
        fired = f"fired in {', '.join(r.fault.fired_in)}" if r.fault.fired else "did not fire"
        seed = f", seed {r.fault.seed}" if r.fault.seed is not None else ""
        fault = f"; fault {r.fault.mode} at {', '.join(r.fault.stages)} in {r.fault.target} ({fired}{seed})"
    runner = ", in a vLLM engine" if r.engine == "vllm" else ""
    _line(
        f"engine {r.engine_id}: {r.spec}{runner}, world size {r.world_size}, lifetime {r.lifetime}, "
        f"device {r.device or '-'}{fault}",
    )
    if r.vllm is not None:
        _vllm_engine(r.vllm)
    # The points each stage passed are long: last, where a terminal may wrap them.
    columns = ("participant", "stage", "start", "time", "bytes", "result", "detail", "points passed")
    _section(
        "stages",
        columns,
        [
            (
                s.participant,
                s.name,
                f"{s.started_s:.3f}s",
                f"{s.seconds:.3f}s",
                size_text(s.bytes, exact=False) if s.bytes else "-",  # one field, as in scan
                _result(s),
                s.detail,
                " ".join(s.points) or "-",
            )
            for s in r.stages
        ],
    )
    if r.error is not None:
        _line("error: " + _error_text(r.error), "green" if r.error.injected else "bold red")
        for other in r.errors:
            if other is not r.error and other != r.error:
                _line("  also: " + _error_text(other))
    _section(
        "cleanup (in the order it ran)",
        ("at", "participant", "step", "result"),
        [
            (f"{c.at_s:.3f}s", c.participant, c.what, "ok" if c.ok else f"FAILED: {c.error}")
            for c in r.cleanup
        ],
    )
    if r.held_after_release:
        _section(
            "still held after release (the kernel frees these with the process)",
            ("participant", "kind", "target"),
            [(h.participant, h.kind, h.target) for h in r.held_after_release],
        )
    if r.logs:
        _section(
            "participant warnings",
            ("at", "participant", "level", "message"),
            [(f"{line.at_s:.3f}s", line.participant, line.level, line.message) for line in r.logs],
        )
    _residue(r.residue, r.root, r.engine_id)
    if r.crash is not None:
        c = r.crash
        killed = f"; SIGKILLed with it: {', '.join(c.killed)}" if c.killed else ""
        _line(f"crash: {c.participant} (pid {c.pid}) died, exit status {c.exit_code}{killed}")
        if c.orphans and c.reap_command:
            _line("these files are orphans now; remove them with:", "yellow")
            _command(c.reap_command)
        elif c.why_nothing_left:
            _line(c.why_nothing_left)
    if r.held_s is not None:
        _line(f"held for {r.held_s:.1f}s")
    verdict = str(r.verdict)
    _line(
        f"verdict: {verdict}: {VERDICT_TEXT.get(verdict, '')} ({r.duration_s:.2f}s)",
        VERDICT_STYLE.get(verdict),
    )


def _vllm_engine(v: VllmEngineInfo) -> None:
    """``--engine vllm``: the engine, its processes, the region's holders and the round trip."""
    up = f"up in {v.up_s:.1f}s" if v.up_s is not None else "did not come up"
    _line(f"vLLM {v.version or '?'} with kvoffload's spec, model {v.model}: {up}")
    _section(
        "engine processes",
        ("participant", "pid", "title", "mapped the region"),
        [
            (p.participant, p.pid, p.title, "yes" if p.participant in v.region_mapped_by else "-")
            for p in v.processes
        ],
    )
    if v.roundtrip is not None:
        rt = v.roundtrip
        same = "same tokens" if rt.same_tokens else "DIFFERENT tokens"
        _line(
            f"round trip: stored {human_bytes(rt.store_bytes)}, loaded {human_bytes(rt.load_bytes)}, "
            f"{rt.external_hits} prompt tokens from the region after reset_prefix_cache(), {same}"
        )
    if v.processes_left:
        _line(
            "left running after the client exited (killed): "
            + ", ".join(f"{p.participant} pid {p.pid} ({p.title})" for p in v.processes_left),
            "bold red",
        )
    if v.log_tail:
        _section("engine log (last lines)", ("line",), [(line,) for line in v.log_tail])


def _result(stage: StageResult) -> str:
    e = stage.error
    if e is None:
        return stage.result
    if e.injected:
        return f"failed at {e.point}"
    where = f" after {stage.points[-1]}" if stage.points else ""
    return f"failed{where} ({e.type})"


def _error_text(e: ErrorInfo) -> str:
    how = f"injected at {e.point}" if e.injected else "NOT injected"
    notes = "".join(f"; {n}" for n in e.notes)
    return f"{e.type}: {e.message} ({e.participant}, {e.stage}, {how}){notes}"


def _residue(residue: Residue, root: object, engine_id: str) -> None:
    if not residue.paths:
        _line(f"residue: none ({root} holds no file of engine {engine_id})", "green")
        return
    _section(
        f"residue: {len(residue.paths)} file(s), {human_bytes(residue.bytes)} resident",
        ("path", "size", "resident"),
        [(f.path, _bytes(f.size_bytes), _bytes(f.resident_bytes)) for f in residue.files],
    )


# ----------------------------------------------------------------- matrix


@contextlib.contextmanager
def matrix_progress(*, json_output: bool) -> Iterator[Callable[[MatrixCell, int, int], None] | None]:
    """One bar over the cells on a terminal's stderr; nothing otherwise."""
    if json_output or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("matrix"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("", total=None)

        def update(cell: MatrixCell, index: int, total: int) -> None:
            bar.update(task, completed=index, total=total, description=f"{cell.stage} x {cell.mode}")

        yield update


def matrix(report: MatrixReport, *, json_output: bool) -> None:
    if json_output:
        emit_json(report)
        return
    r = report
    _line(
        f"fault matrix: {r.spec}, world size {r.world_size}, lifetime {r.lifetime}, root {r.root}, "
        f"target {r.target}",
    )
    _section(
        "cells",
        ("stage", "mode", "verdict", "result", "leaked_bytes", "error"),
        [
            (
                c.stage,
                c.mode,
                str(c.verdict),
                "pass" if c.passed else "FAIL",
                c.residue.bytes,
                _short_error(c.error),
            )
            for c in r.cells
        ],
    )
    for c in r.cells:
        if c.orphans:
            status = ", ".join(c.scan_status) or "-"
            _line(
                f"crash at {c.stage}: left {len(c.orphans)} file(s); scan said {status}; "
                f"reap removed {len(c.reaped)}",
            )
        if c.kept:
            _kept(f"kept by the reap after the crash at {c.stage}", c.kept, c.reap_command)
    if r.stopped is not None:
        _stopped(r.stopped, len(r.cells))
    style = "green" if not r.failed and r.stopped is None else "bold red"
    not_run = f", {r.stopped.not_run} not run" if r.stopped is not None else ""
    _line(
        f"{r.passed} passed, {r.failed} failed, {r.leaked} leaked{not_run}: "
        f"{len(r.cells)} cells in {r.duration_s:.1f}s",
        style,
    )


def _kept(title: str, kept: Sequence[KeptFile], reap_command: str | None) -> None:
    _section(title, ("path", "status", "reason"), [(k.path, k.status, k.reason) for k in kept])
    if reap_command:
        _line("remove them, once that reason is gone, with:", "yellow")
        _command(reap_command)


def _stopped(stop: MatrixStop, ran: int) -> None:
    _line(
        f"matrix stopped after {ran} of {ran + stop.not_run} cells, before {stop.stage} x {stop.mode}: "
        f"{stop.message}",
        "bold red",
    )
    if stop.capacity is not None and stop.capacity.fix:
        _line(f"fix: {stop.capacity.fix}", "yellow")


def _short_error(error: ErrorInfo | None) -> str:
    return "-" if error is None else f"{error.type}: {error.message}"
