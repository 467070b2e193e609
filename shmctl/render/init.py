"""Rendering of ``shmctl init``: the plan, the bring-up report, the matrix, and live progress.

JSON is the library's dataclass serialised (``InitPlan``, ``InitReport``, ``MatrixReport``).
On a terminal the sections are rich tables; otherwise (a pipe, ``NO_COLOR``) each section
is a ``# title`` line followed by tab-separated rows, for grep and awk. Names (engine ids,
paths, error messages) are arbitrary strings, so nothing is ever read as rich markup.
Progress bars appear only on a terminal.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from shmctl.render import console, emit_json, human_bytes, plain_output, printable, warning_line

if TYPE_CHECKING:
    from rich.console import Console

    from kvoffload.engine import InitPlan, InitReport, LiveEngine, MatrixCell, MatrixReport, ProgressEvent
    from kvoffload.engine.report import ErrorInfo, KeptFile, MatrixStop, Residue, StageResult

VERDICT_TEXT = {
    "ok": "up and down cleanly; nothing left behind",
    "contract-held": "the injected failure was cleaned up: nothing left behind",
    "not-fired": "the fault never fired; nothing left behind",
    "leaked": "files were left behind (the cleanup contract did not hold)",
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


def _section(out: Console, title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    if plain_output():
        # Written verbatim: rich would expand the tabs that cut and awk split on.
        _write(f"# {title}")
        for row in rows:
            _write("\t".join(_cell(v) for v in row))
        return
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", show_edge=False)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(v if isinstance(v, Text) else Text(_cell(v)) for v in row))
    out.print(table)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return printable(str(value), escape_backslash=False)


def _fields(text: str) -> str:
    """Escape control characters field by field: our tabs separate columns, theirs must not."""
    return "\t".join(printable(field, escape_backslash=False) for field in text.split("\t"))


def _write(text: str) -> None:
    # Engine ids and paths may carry control characters: one report line stays one line.
    sys.stdout.write(_fields(text) + "\n")


def _line(out: Console, text: str, style: str | None = None) -> None:
    if plain_output():
        _write(text)
        return
    text = _fields(text)
    if style is None:
        out.print(text, markup=False, highlight=False)
        return
    from rich.text import Text

    out.print(Text(text, style=style))


def _command(out: Console, command: str) -> None:
    """A shell command to copy, indented, on one line even on a narrow terminal.

    It is built shell-quoted in visible characters (``bringup.shell_word``), so it is
    printed as it is: a line rich wrapped would paste as two commands.
    """
    if plain_output():
        _write(f"  {command}")
        return
    out.print(f"  {_fields(command)}", markup=False, highlight=False, soft_wrap=True)


def _bytes(n: int | None) -> str:
    return "-" if n is None else f"{n} ({human_bytes(n)})"


# ----------------------------------------------------------------- plan


def plan(the_plan: InitPlan, *, json_output: bool) -> None:
    if json_output:
        emit_json(the_plan)
        return
    out = console()
    p = the_plan
    _line(
        out,
        f"plan: {p.spec}, engine {p.engine_id}, world size {p.world_size}, lifetime {p.lifetime} "
        "(dry run: nothing allocated)",
    )
    g, s = p.geometry, p.sizing
    _section(
        out,
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
        out,
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
        out,
        f"worker slots: {layout.rows} rows x {layout.row_bytes} bytes; slot {layout.slot_bytes} bytes"
        f" x {layout.copies} cop{'y' if layout.copies == 1 else 'ies'}; padding {layout.padding} bytes/row",
        ("participant", "bytes of every row", "pre-faults"),
        rows,
    )
    if p.tiers:
        _section(
            out,
            "tiers (creation order)",
            ("tier", "type", "chunks", "bytes", "options"),
            [
                (
                    f"{t.role}" + (f" {t.index}" if t.role == "secondary" else ""),
                    t.type,
                    t.chunks,
                    _bytes(t.bytes),
                    _options(t.options),
                )
                for t in p.tiers
            ],
        )
    _section(
        out,
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
        out,
        f"capacity: {c.root}{fs}: {human_bytes(c.free_bytes)} free of {human_bytes(c.mount_bytes)}, "
        f"{human_bytes(c.needed_bytes)} needed: {verdict}",
        "green" if c.fits else "bold red",
    )
    if c.fix:
        _line(out, f"fix: {c.fix}", "yellow")


def _options(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "-"


# ----------------------------------------------------------------- bring-up


@contextlib.contextmanager
def progress(*, json_output: bool) -> Iterator[Callable[[ProgressEvent], None] | None]:
    """A rich progress bar per participant's populate, on a terminal only (never in JSON mode)."""
    if json_output or plain_output():
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    bars: dict[str, Any] = {}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TimeRemainingColumn(),
        console=console(),
        transient=True,
    ) as bar:

        def update(event: ProgressEvent) -> None:
            key = f"{event.participant} {event.stage}"
            if key not in bars:
                bars[key] = bar.add_task(f"{key}: populate", total=event.total)
            bar.update(bars[key], completed=event.done, total=event.total)

        yield update


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
    err.print(
        f"`shmctl scan --root {live.root}` in another terminal shows it; Ctrl-C tears it down",
        markup=False,
        highlight=False,
    )


def init_report(report: InitReport, *, json_output: bool) -> None:
    if json_output:
        emit_json(report)
        return
    out = console()
    r = report
    fault = ""
    if r.fault is not None:
        fired = f"fired in {', '.join(r.fault.fired_in)}" if r.fault.fired else "did not fire"
        seed = f", seed {r.fault.seed}" if r.fault.seed is not None else ""
        fault = f"; fault {r.fault.mode} at {', '.join(r.fault.stages)} in {r.fault.target} ({fired}{seed})"
    _line(
        out,
        f"engine {r.engine_id}: {r.spec}, world size {r.world_size}, lifetime {r.lifetime}, "
        f"device {r.device or '-'}{fault}",
    )
    plain = plain_output()
    columns = ("participant", "stage", "start", "time", "bytes", "result", "detail")
    # The points each stage passed are long; a terminal table shows where a failure happened.
    _section(
        out,
        "stages",
        (*columns, "points passed") if plain else columns,
        [
            (
                s.participant,
                s.name,
                f"{s.started_s:.3f}s",
                f"{s.seconds:.3f}s",
                human_bytes(s.bytes) if s.bytes else "-",
                _result(s),
                s.detail,
                *((" ".join(s.points) or "-",) if plain else ()),
            )
            for s in r.stages
        ],
    )
    if r.error is not None:
        _line(out, "error: " + _error_text(r.error), "green" if r.error.injected else "bold red")
        for other in r.errors:
            if other is not r.error and other != r.error:
                _line(out, "  also: " + _error_text(other))
    _section(
        out,
        "cleanup (in the order it ran)",
        ("at", "participant", "step", "result"),
        [
            (f"{c.at_s:.3f}s", c.participant, c.what, "ok" if c.ok else f"FAILED: {c.error}")
            for c in r.cleanup
        ],
    )
    if r.held_after_release:
        _section(
            out,
            "still held after release (the kernel frees these with the process)",
            ("participant", "kind", "target"),
            [(h.participant, h.kind, h.target) for h in r.held_after_release],
        )
    if r.logs:
        _section(
            out,
            "participant warnings",
            ("at", "participant", "level", "message"),
            [(f"{line.at_s:.3f}s", line.participant, line.level, line.message) for line in r.logs],
        )
    _residue(out, r.residue, r.root, r.engine_id)
    if r.crash is not None:
        c = r.crash
        killed = f"; SIGKILLed with it: {', '.join(c.killed)}" if c.killed else ""
        _line(out, f"crash: {c.participant} (pid {c.pid}) died, exit status {c.exit_code}{killed}")
        if c.orphans and c.reap_command:
            _line(out, "these files are orphans now; remove them with:", "yellow")
            _command(out, c.reap_command)
        elif c.why_nothing_left:
            _line(out, c.why_nothing_left)
    if r.held_s is not None:
        _line(out, f"held for {r.held_s:.1f}s")
    verdict = str(r.verdict)
    _line(
        out,
        f"verdict: {verdict}: {VERDICT_TEXT.get(verdict, '')} ({r.duration_s:.2f}s)",
        VERDICT_STYLE.get(verdict),
    )


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


def _residue(out: Console, residue: Residue, root: object, engine_id: str) -> None:
    if not residue.paths:
        _line(out, f"residue: none ({root} holds no file of engine {engine_id})", "green")
        return
    _section(
        out,
        f"residue: {len(residue.paths)} file(s), {human_bytes(residue.bytes)} resident",
        ("path", "size", "resident"),
        [(f.path, _bytes(f.size_bytes), _bytes(f.resident_bytes)) for f in residue.files],
    )


# ----------------------------------------------------------------- matrix


@contextlib.contextmanager
def matrix_progress(*, json_output: bool) -> Iterator[Callable[[MatrixCell, int, int], None] | None]:
    """One bar over the cells on a terminal; nothing otherwise."""
    if json_output or plain_output():
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("matrix"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console(),
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
    out = console()
    r = report
    _line(
        out,
        f"fault matrix: {r.spec}, world size {r.world_size}, lifetime {r.lifetime}, root {r.root}, "
        f"target {r.target}",
    )
    cells = {(c.stage, c.mode): c for c in r.cells}
    if plain_output():
        _section(
            out,
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
    else:
        from rich.table import Table
        from rich.text import Text

        table = Table(title="stage x mode", title_justify="left", show_edge=False)
        table.add_column("stage")
        for mode in r.modes:
            table.add_column(mode)
        for stage in r.stages:
            row: list[Text] = [Text(stage)]
            for mode in r.modes:
                cell = cells.get((stage, mode))
                row.append(_matrix_cell(cell))
            table.add_row(*row)
        out.print(table)
    for c in r.cells:
        if c.orphans:
            status = ", ".join(c.scan_status) or "-"
            _line(
                out,
                f"crash at {c.stage}: left {len(c.orphans)} file(s); scan said {status}; "
                f"reap removed {len(c.reaped)}",
            )
        if c.kept:
            _kept(out, f"kept by the reap after the crash at {c.stage}", c.kept, c.reap_command)
    if r.stopped is not None:
        _stopped(out, r.stopped, len(r.cells))
    style = "green" if not r.failed and r.stopped is None else "bold red"
    not_run = f", {r.stopped.not_run} not run" if r.stopped is not None else ""
    _line(
        out,
        f"{r.passed} passed, {r.failed} failed, {r.leaked} leaked{not_run}: "
        f"{len(r.cells)} cells in {r.duration_s:.1f}s",
        style,
    )


def _kept(out: Console, title: str, kept: Sequence[KeptFile], reap_command: str | None) -> None:
    _section(out, title, ("path", "status", "reason"), [(k.path, k.status, k.reason) for k in kept])
    if reap_command:
        _line(out, "remove them, once that reason is gone, with:", "yellow")
        _command(out, reap_command)


def _stopped(out: Console, stop: MatrixStop, ran: int) -> None:
    _line(
        out,
        f"matrix stopped after {ran} of {ran + stop.not_run} cells, before {stop.stage} x {stop.mode}: "
        f"{stop.message}",
        "bold red",
    )
    if stop.capacity is not None and stop.capacity.fix:
        _line(out, f"fix: {stop.capacity.fix}", "yellow")


def _matrix_cell(cell: MatrixCell | None) -> Any:
    from rich.text import Text

    if cell is None:
        return Text("-")
    if cell.leaked:
        return Text(f"LEAK {human_bytes(cell.residue.bytes)}", style="bold red")
    if not cell.passed:
        return Text(f"FAIL {cell.error.type if cell.error else cell.verdict}", style="bold red")
    if str(cell.verdict) == "not-fired":
        return Text("not fired", style="yellow")
    return Text("pass" + (" (reaped)" if cell.reaped else ""), style="green")


def _short_error(error: ErrorInfo | None) -> str:
    return "-" if error is None else f"{error.type}: {error.message}"
