"""The fault matrix: every stage of the plan x every mode, one real bring-up per cell.

Each cell is a full ``bring_up`` with its own engine id (``{engine_id}-c{n}``) and fresh
participant processes, so no state (a fault configuration, a probed populate method, an
fd) carries from one cell to the next. A raise-type cell passes when the injected fault
fired and nothing was left in the root (a fault that cannot fire for the chosen target,
a creator-only stage aimed at a joiner, passes as not-fired). A crash cell leaves what an
OOM kill leaves; it passes when a scan (grace 0) calls every file it left orphaned and a
reap removes them all, which is the operator's recovery.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Sequence

from kvoffload.config import OffloadingConfig
from kvoffload.engine.bringup import DEFAULT_IDLE_TIMEOUT_S, bring_up
from kvoffload.engine.faultplan import FailMode, Target, build_fault_plan
from kvoffload.engine.plan import plan
from kvoffload.engine.report import (
    SCHEMA_VERSION,
    InitReport,
    MatrixCell,
    MatrixReport,
    Verdict,
    measure_residue,
)
from kvoffload.errors import ConfigError

#: raise, an errno vLLM really met (EFAULT from a full tmpfs, #54002), and failing cleanup.
DEFAULT_MODES = ("raise", "oserror:EFAULT", "cleanup-raise")
_PASSING = (Verdict.CONTRACT_HELD, Verdict.NOT_FIRED)


def run_matrix(
    config: OffloadingConfig,
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
    and not a half-run matrix. ``assume_not_holding`` is passed to the scan and reap that
    follow a crash cell (pids the operator vouches for, as ``shmctl scan`` takes them).
    """
    the_plan = plan(config)
    names = tuple(stages) if stages else tuple(s.name for s in the_plan.stages)
    parsed = [m if isinstance(m, FailMode) else FailMode.parse(m) for m in modes]
    if include_crash and not any(m.kind == "crash" for m in parsed):
        parsed.append(FailMode("crash"))
    if not parsed:
        raise ConfigError("--fail-mode", "the matrix needs at least one mode")
    for name in names:
        for mode in parsed:
            build_fault_plan(the_plan, (name,), mode, target_rank, seed)
    cells: list[MatrixCell] = []
    total = len(names) * len(parsed)
    started = time.monotonic()
    for name in names:
        for mode in parsed:
            cell_config = dataclasses.replace(config, engine_id=f"{config.engine_id}-c{len(cells):03d}")
            report = bring_up(
                cell_config,
                fail_at=(name,),
                fail_mode=mode,
                target_rank=target_rank,
                seed=seed,
                roundtrip=roundtrip,
                idle_timeout_s=idle_timeout_s,
                start_method=start_method,
            )
            cell = _cell(name, mode, report, frozenset(assume_not_holding))
            cells.append(cell)
            if on_cell is not None:
                on_cell(cell, len(cells), total)
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
    )


def _cell(stage: str, mode: FailMode, report: InitReport, vouched: frozenset[int]) -> MatrixCell:
    failures = sum(1 for s in report.cleanup if not s.ok)
    base = MatrixCell(
        stage=stage,
        mode=str(mode),
        engine_id=report.engine_id,
        verdict=report.verdict,
        passed=report.verdict in _PASSING,
        leaked=bool(report.residue),
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
    from kvoffload.liveness.scan import Status, scan

    ours = {p.name for p in report.residue.paths}
    found = scan(report.root, grace_s=0.0, assume_not_holding=vouched)
    statuses = tuple(str(e.status) for e in found.entries if e.name in ours)
    reaped = reap(
        report.root, grace_s=0.0, filters=ReapFilter(engine_id=report.engine_id), assume_not_holding=vouched
    )
    after = measure_residue(report.root, report.engine_id)
    all_orphaned = len(statuses) == len(ours) and all(s == Status.ORPHANED for s in statuses)
    return dataclasses.replace(
        cell,
        passed=all_orphaned and not after,
        leaked=bool(after),
        residue=after,
        orphans=report.residue.paths,
        scan_status=statuses,
        reaped=tuple(e.path for e in reaped.removed),
    )
