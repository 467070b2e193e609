"""The fault matrix: every stage of the plan x every mode, one real bring-up per cell.

Each cell is a full ``bring_up`` with its own engine id (``{engine_id}-c{n}``) and fresh
participant processes, so no state (a fault configuration, a probed populate method, an
fd) carries from one cell to the next. A raise-type cell passes when the injected fault
fired and nothing was left in the root (a fault that cannot fire for the chosen target,
a creator-only stage aimed at a joiner, passes as not-fired). A crash cell leaves what an
OOM kill leaves; it passes when a scan (grace 0) calls every file it left orphaned and a
reap removes them all, which is the operator's recovery. That recovery runs before the
next cell starts, whatever the output.

Every cell needs the whole region in the root, so the root is checked before each one: the
dry-run plan's capacity pre-flight before the first (a root too small for one cell is an
error and nothing runs), a fresh ``statvfs`` before each later one. A crash cell whose files
survive the reap (live or unknown to the scan) stops the matrix: the cells after it would
only pile their files on top until every cell fails for lack of space. The report then
names the kept files, the reap's reason and the command that removes them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Sequence

from kvoffload.bringup.faultplan import FailMode, Target, build_fault_plan
from kvoffload.bringup.kvoffload_engine import bring_up, require_torch
from kvoffload.bringup.plan import (
    Capacity,
    CapacityError,
    check_capacity,
    plan,
    require_room,
    size_text,
)
from kvoffload.bringup.report import (
    SCHEMA_VERSION,
    BringUpOutcome,
    InitReport,
    KeptFile,
    MatrixCell,
    MatrixReport,
    MatrixStop,
)
from kvoffload.bringup.request import DEFAULT_IDLE_TIMEOUT_S, BringUpRequest
from kvoffload.bringup.residue import measure_residue
from kvoffload.errors import ConfigError
from kvoffload.settings import OffloadingSettings

#: raise, an errno vLLM really met (EFAULT from a full tmpfs, #54002), and failing cleanup.
DEFAULT_MODES = ("raise", "oserror:EFAULT", "cleanup-raise")
_PASSING = (BringUpOutcome.CONTRACT_HELD, BringUpOutcome.NOT_FIRED)


def run_matrix(
    config: OffloadingSettings,
    *,
    stages: Sequence[str] | None = None,
    modes: Sequence[str | FailMode] = DEFAULT_MODES,
    include_crash: bool = False,
    target_rank: Target = None,
    seed: int | None = None,
    roundtrip: bool = False,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    on_cell: Callable[[MatrixCell, int, int], None] | None = None,
    assume_not_holding: Collection[int] = (),
    start_method: str = "forkserver",
) -> MatrixReport:
    """Run every (stage, mode) cell; ``on_cell(cell, index, total)`` after each one.

    Every combination is checked before the first cell runs, so a typo is a usage error
    and not a half-run matrix; so is the root's room for one cell (``CapacityError``, with
    the plan's fix). ``assume_not_holding`` is passed to the scan and reap that follow a
    crash cell (pids the operator vouches for, as ``shmctl scan`` takes them). The report's
    ``stopped`` says why the matrix ended early, when it did.
    """
    the_plan = plan(config)
    require_torch()
    names = tuple(stages) if stages else tuple(s.name for s in the_plan.stages)
    parsed = [m if isinstance(m, FailMode) else FailMode.parse(m) for m in modes]
    if include_crash and not any(m.kind == "crash" for m in parsed):
        parsed.append(FailMode("crash"))
    if not parsed:
        raise ConfigError("--fail-mode", "the matrix needs at least one mode")
    for name in names:
        for mode in parsed:
            build_fault_plan(the_plan, (name,), mode, target_rank, seed)
    require_room(the_plan, "each cell of the matrix")
    vouched = frozenset(assume_not_holding)
    todo = [(name, mode) for name in names for mode in parsed]
    cells: list[MatrixCell] = []
    stopped: MatrixStop | None = None
    started = time.monotonic()
    for name, mode in todo:
        if cells:
            stopped = _stop_before(config, name, mode, cells, len(todo))
            if stopped is not None:
                break
        cell_config = dataclasses.replace(config, engine_id=f"{config.engine_id}-c{len(cells):03d}")
        request = BringUpRequest(
            cell_config,
            fail_at=(name,),
            fail_mode=mode,
            target_rank=target_rank,
            seed=seed,
            roundtrip=roundtrip,
            idle_timeout_s=idle_timeout_s,
        )
        try:
            report = bring_up(request, start_method=start_method)
        except CapacityError as e:
            # The root filled up between the check above and the cell's own: the same stop.
            stopped = _capacity_stop(config, e.capacity, name, mode, cells, len(todo))
            break
        # Recovered (scanned and reaped) before anyone hears of it, so before the next cell.
        cell = _cell(name, mode, report, vouched)
        cells.append(cell)
        if on_cell is not None:
            on_cell(cell, len(cells), len(todo))
    failed = [c for c in cells if not c.passed]
    return MatrixReport(
        schema_version=SCHEMA_VERSION,
        spec=config.spec_name,
        world_size=config.world_size,
        lifetime=config.lifetime,
        root=config.root,
        target="every participant" if target_rank is None else str(target_rank),
        stages=names,
        modes=tuple(str(m) for m in parsed),
        cells=tuple(cells),
        passed=len(cells) - len(failed),
        failed=len(failed),
        leaked=sum(1 for c in cells if c.leaked),
        duration_s=time.monotonic() - started,
        stopped=stopped,
    )


def _stop_before(
    config: OffloadingSettings, stage: str, mode: FailMode, cells: list[MatrixCell], total: int
) -> MatrixStop | None:
    """Why the cell ``stage`` x ``mode`` must not run after ``cells``, or None when it may."""
    last, not_run = cells[-1], total - len(cells)
    if last.kept:
        return MatrixStop(
            reason="kept",
            message=(
                f"the crash at {last.stage} left {len(last.kept)} file(s) that the reap kept; every "
                "later cell would leave its own on top until the root is full"
            ),
            stage=stage,
            mode=str(mode),
            not_run=not_run,
            kept=last.kept,
            reap_command=last.reap_command,
        )
    sizing = config.sizing
    capacity = check_capacity(config.root, sizing.total_bytes, sizing.kv_bytes_per_chunk)
    if capacity.fits:
        return None
    return _capacity_stop(config, capacity, stage, mode, cells, total)


def _capacity_stop(
    config: OffloadingSettings,
    capacity: Capacity,
    stage: str,
    mode: FailMode,
    cells: list[MatrixCell],
    total: int,
) -> MatrixStop:
    """The root cannot hold the cell ``stage`` x ``mode``: how much is free, and what cells left."""
    not_run = total - len(cells)
    left = sum(c.residue.bytes for c in cells if c.leaked)
    blame = f"; earlier cells left {size_text(left)} there" if left else ""
    return MatrixStop(
        reason="capacity",
        message=(
            f"{size_text(capacity.free_bytes)} free in {config.root}, the next cell needs "
            f"{size_text(capacity.needed_bytes)}{blame}"
        ),
        stage=stage,
        mode=str(mode),
        not_run=not_run,
        capacity=capacity,
    )


def _cell(stage: str, mode: FailMode, report: InitReport, vouched: frozenset[int]) -> MatrixCell:
    failures = sum(1 for s in report.cleanup if not s.ok)
    base = MatrixCell(
        stage=stage,
        mode=str(mode),
        engine_id=report.engine_id,
        verdict=report.verdict,
        passed=report.verdict in _PASSING,
        leaked=bool(report.residue) or report.verdict == BringUpOutcome.LEAKED,
        fired=bool(report.fault and report.fault.fired),
        error=report.error,
        residue=report.residue,
        cleanup_steps=len(report.cleanup),
        cleanup_failures=failures,
        duration_s=report.duration_s,
    )
    if mode.kind != "crash" or not report.residue:
        return base
    return _recover(base, report, vouched)


def _recover(cell: MatrixCell, report: InitReport, vouched: frozenset[int]) -> MatrixCell:
    """What an operator does after a crash: scan (the files must be orphaned), then reap."""
    from kvoffload.liveness.reap import ReapFilter, reap
    from kvoffload.liveness.scan import ScanOptions, Status, scan

    ours = {p.name for p in report.residue.paths}
    options = ScanOptions(grace_s=0.0, assume_not_holding=vouched)
    found = scan(report.root, options)
    statuses = tuple(str(e.status) for e in found.entries if e.name in ours)
    reaped = reap(report.root, options, filters=ReapFilter.exactly(report.engine_id))
    after = measure_residue(report.root, report.engine_id)
    # The reap's own reason for a file it chose and then kept; else the scan's verdict.
    judged = {e.name: e for e in found.entries} | {e.name: e for e in reaped.kept}
    kept = tuple(
        KeptFile(path, str(judged[path.name].status), judged[path.name].reason)
        if path.name in judged
        else KeptFile(path, str(Status.UNKNOWN), "appeared after the scan")
        for path in after.paths
    )
    all_orphaned = len(statuses) == len(ours) and all(s == Status.ORPHANED for s in statuses)
    return dataclasses.replace(
        cell,
        passed=all_orphaned and not after,
        leaked=bool(after),
        residue=after,
        orphans=report.residue.paths,
        scan_status=statuses,
        reaped=tuple(e.path for e in reaped.removed),
        kept=kept,
        reap_command=report.crash.reap_command if report.crash else None,
    )
