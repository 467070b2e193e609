"""What both bring-ups share: one run's state and clocks, the hold, and the assembly of its report.

A bring-up with kvoffload's own participant processes (``kvoffload_engine``) and one with a
real vLLM engine (``vllm_engine``) differ in who runs the stages and in how the parent learns
what each did (a pipe per participant; a fault journal, the client's pipe and ``/proc``).
The rest is one ``Rehearsal``: the request's settings, the plan and the fault, the steps the
parent itself takes, the hold, and the ``InitReport`` built from what the run found, so that
both report the same fields, choose the same primary error and are judged by the same rule.

Clocks: ``t0`` (monotonic) times the run (``duration_s``, ``held_s``) and the stages the
parent times; ``wall0`` (``time.time()``) is the origin of every ``at_s``, since release steps
and log lines are stamped in other processes, where only the wall clock is shared.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

from kvoffload.bringup.faultplan import FaultPlan
from kvoffload.bringup.plan import InitPlan
from kvoffload.bringup.report import (
    SCHEMA_VERSION,
    CleanupStep,
    CrashInfo,
    ErrorInfo,
    InitReport,
    InjectedFaultInfo,
    LogLine,
    StageResult,
    VllmEngineInfo,
    judge,
)
from kvoffload.bringup.request import BringUpRequest, LiveEngine
from kvoffload.bringup.residue import HeldHandle, Residue, measure_residue
from kvoffload.liveness.reap import reap_command


class Rehearsal(ABC):
    """One bring-up run; a subclass starts, drives and ends the engine's processes."""

    def __init__(self, request: BringUpRequest, the_plan: InitPlan, fault: FaultPlan | None) -> None:
        self.config = request.config
        self.plan = the_plan
        self.fault = fault
        self.roundtrip = request.roundtrip
        self.hold = request.hold
        self.hold_s = request.hold_s
        self.idle_timeout_s = request.idle_timeout_s
        self.parent_steps: list[CleanupStep] = []
        self.held_s: float | None = None
        self.t0 = time.monotonic()
        self.wall0 = time.time()

    @abstractmethod
    def run(self) -> InitReport:
        """Bring the engine up, tear it down whatever happened, and report."""

    @abstractmethod
    def _pids(self) -> dict[str, int]:
        """The engine's processes now, by participant name."""

    @abstractmethod
    def _stay_up(self, deadline: float | None) -> None:
        """Keep the engine up until ``deadline`` (None: until Ctrl-C), or until it dies."""

    def _hold(self) -> None:
        assert self.hold is not None
        live = LiveEngine(
            engine_id=self.config.engine_id,
            root=self.config.root,
            pids=self._pids(),
            files=measure_residue(self.config.root, self.config.engine_id).paths,
            path_lifetime=self.plan.path_lifetime,
        )
        started = time.monotonic()
        try:
            self.hold(live)
            deadline = None if self.hold_s is None else started + self.hold_s
            self._stay_up(deadline)
        except KeyboardInterrupt:
            pass
        self.held_s = time.monotonic() - started

    def _step(self, what: str, *, ok: bool = True, error: str | None = None) -> None:
        self.parent_steps.append(CleanupStep("parent", what, ok, error, time.time() - self.wall0))

    # ----------------------------------------------------------------- report

    def _injected_fault_info(self, fired_in: tuple[str, ...]) -> InjectedFaultInfo | None:
        """The fault as asked, and the participants it fired in (None: no fault was asked)."""
        if self.fault is None:
            return None
        return InjectedFaultInfo(
            stages=self.fault.stages,
            mode=str(self.fault.mode),
            failpoints=self.fault.failpoints,
            target=self.fault.target_name,
            seed=self.fault.seed,
            fired=bool(fired_in),
            fired_in=fired_in,
        )

    def _crash_info(
        self,
        residue: Residue,
        *,
        participant: str,
        pid: int,
        exit_code: int | None,
        injected: bool,
        killed: tuple[str, ...],
        why_nothing_left: str,
    ) -> CrashInfo:
        """A crash's orphans are what the root still holds, with the command that reaps them."""
        root, engine_id = self.config.root, self.config.engine_id
        return CrashInfo(
            participant=participant,
            pid=pid,
            exit_code=exit_code,
            injected=injected,
            killed=killed,
            orphans=residue.paths,
            reap_command=reap_command(root, engine_id) if residue else None,
            why_nothing_left=None if residue else why_nothing_left,
        )

    def _assemble(
        self,
        *,
        stages: tuple[StageResult, ...],
        errors: Sequence[ErrorInfo],
        fault: InjectedFaultInfo | None,
        crash: CrashInfo | None,
        crashed: bool | None,
        cleanup: Iterable[CleanupStep],
        residue: Residue,
        left_running: bool,
        warnings: tuple[str, ...],
        device: str | None = None,
        held_after_release: tuple[HeldHandle, ...] = (),
        logs: tuple[LogLine, ...] = (),
        engine: str = "kvoffload",
        vllm: VllmEngineInfo | None = None,
    ) -> InitReport:
        """The report of this run; ``crashed`` and ``left_running`` as ``judge`` takes them.

        The primary error is the first injected one (what the rehearsal was about), else the
        first; the cleanup steps of every process are put in the order they ran.
        """
        primary = next((e for e in errors if e.injected), errors[0] if errors else None)
        return InitReport(
            schema_version=SCHEMA_VERSION,
            engine_id=self.config.engine_id,
            spec=self.config.spec_name,
            root=self.config.root,
            lifetime=self.config.lifetime,
            world_size=self.config.world_size,
            device=device,
            fault=fault,
            stages=stages,
            error=primary,
            errors=tuple(errors),
            cleanup=tuple(sorted(cleanup, key=lambda s: s.at_s)),
            residue=residue,
            held_after_release=held_after_release,
            crash=crash,
            logs=logs,
            held_s=self.held_s,
            duration_s=time.monotonic() - self.t0,
            verdict=judge(residue, left_running=left_running, primary=primary, fault=fault, crashed=crashed),
            warnings=warnings,
            engine=engine,
            vllm=vllm,
        )
