"""``shmctl init`` (``--engine kvoffload``): the rehearsal in kvoffload's own participant
processes: an engine's offload bring-up, a fault at a chosen stage, a graceful teardown, and
a residue check of the root. Its sibling ``vllm_engine`` runs the same ``BringUpRequest``
through a real vLLM engine; the state and the report they share are ``rehearsal``'s.

The order is vLLM's: every worker process constructs the spec and ``create_worker``
(maps its slot of the region) first; only when all of them are up does the scheduler
process ``get_manager`` (the tiering spec maps the whole region there). A failed worker
fails the engine: the scheduler is never started, and the workers still waiting in the
CPU spec's barrier are released by aborting it (``BrokenBarrierError``), as an executor
tearing down its worker group would. Teardown is graceful and in vLLM's order too:
every worker shuts down, then the scheduler; each participant reports the release steps
its spec journaled. A participant that dies before releasing (a crash, an OOM kill) ends
the engine the way an OOM kill of its container does: the parent SIGKILLs every other
participant, no cleanup code runs, and the files left are orphans.

Every wait is bounded: a participant that sends nothing for ``idle_timeout_s`` while the
parent waits on it is SIGKILLed and reported (progress messages count as word from it,
so populating 100 GiB is not a hang).

The residue check lists the root's entries named after this engine's id once every
participant has exited; each run uses its own engine id, so nothing else is looked at.

Participants start from a forkserver that has imported torch once, so a bring-up costs
tens of milliseconds per process instead of a torch import each. Like spawn, every
participant is a fresh process that has never touched CUDA; ``start_method="spawn"``
is accepted too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from kvoffload.bringup import participant
from kvoffload.bringup.faultplan import FaultPlan, markers_only
from kvoffload.bringup.plan import SCHEDULER, WORKER, InitPlan, require_room
from kvoffload.bringup.rehearsal import Rehearsal
from kvoffload.bringup.report import (
    CleanupStep,
    CrashInfo,
    ErrorInfo,
    InitReport,
    InjectedFaultInfo,
    LogLine,
    StageResult,
)
from kvoffload.bringup.request import BringUpRequest
from kvoffload.bringup.residue import HeldHandle, Residue, measure_residue
from kvoffload.errors import ConfigError, KvOffloadError

#: Test-only switch: ``worker`` or ``scheduler`` exits without releasing what it holds.
SKIP_RELEASE_ENV = "KVOFFLOAD_INIT_SKIP_RELEASE"
SKIP_RELEASE_ROLES = (WORKER, SCHEDULER)
_PRELOAD = [
    "kvoffload.bringup.participant",
    "kvoffload.cpu.spec",
    "kvoffload.tiering.spec",
    "kvoffload.tiering.manager",
    "kvoffload.cpu.gpu_worker",
    "numpy",
    "torch",
]
_JOIN_S = 5.0


@dataclass(frozen=True, slots=True)
class ProgressEvent:
    """``done`` of ``total`` bytes of ``participant``'s ``stage`` (populating the region)."""

    participant: str
    stage: str
    done: int
    total: int


def require_torch() -> None:
    """Refuse a real bring-up before any process starts when torch is missing.

    Workers need torch for their KV cache; without this check they would start, create the
    region and fail at ``kv_cache``, a multi-line report for what is an installation fact.
    ``find_spec`` looks without importing (torch takes seconds to import).
    """
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise KvOffloadError(
            "torch is not installed: a real init brings up workers, which need it for their KV cache",
            fix="pip install 'shmctl[torch]' (scan, reap, audit, metrics and init --dry-run work without it)",
        )


def bring_up(
    request: BringUpRequest,
    *,
    progress: Callable[[ProgressEvent], None] | None = None,
    skip_release: str | None = None,
    start_method: str = "forkserver",
) -> InitReport:
    """Bring the engine up in ``world_size`` worker processes and a scheduler process, tear it
    down, and report every stage, the injected fault, the cleanup steps and the residue.

    ``progress``: called as a participant populates the region. ``skip_release`` (default:
    ``$KVOFFLOAD_INIT_SKIP_RELEASE``) is the test-only switch that makes the workers or the
    scheduler exit without releasing anything.
    Raises ``ConfigError`` before starting anything when the fault or the config is invalid,
    and ``CapacityError`` (the dry run's capacity rule) when the root cannot hold the region.
    """
    the_plan, fault = request.plan_fault()
    skip = os.environ.get(SKIP_RELEASE_ENV) if skip_release is None else skip_release
    if skip and skip not in SKIP_RELEASE_ROLES:
        raise ConfigError(SKIP_RELEASE_ENV, f"{skip!r} is neither 'worker' nor 'scheduler'")
    if request.idle_timeout_s <= 0:
        raise ConfigError("idle_timeout_s", f"must be positive, got {request.idle_timeout_s:g}")
    require_room(the_plan)
    require_torch()
    run = _BringUp(
        request,
        the_plan,
        fault,
        progress=progress,
        skip_release=skip or None,
        start_method=start_method,
    )
    return run.run()


def mp_context(start_method: str = "forkserver") -> Any:
    import multiprocessing

    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        # Import torch once in the server; each participant then starts in milliseconds.
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


@dataclass(eq=False)
class _Child:
    name: str
    role: str
    rank: int | None
    process: Any
    conn: Connection
    last_heard: float
    state: str = "starting"  # -> ready | failed -> released -> exited; or dead
    detail: str | None = None
    hits: dict[str, int] = field(default_factory=dict)
    steps: tuple[CleanupStep, ...] = ()
    held: tuple[HeldHandle, ...] = ()
    #: Threads and sockets it still had after its release (see ``report.left_running``).
    left_running: tuple[str, ...] = ()
    roundtrip_done: bool = False
    eof: bool = False

    @property
    def pid(self) -> int:
        return int(self.process.pid or 0)

    @property
    def gone(self) -> bool:
        return self.state in ("exited", "dead")

    def send(self, *message: object) -> None:
        self.last_heard = time.monotonic()
        with contextlib.suppress(BrokenPipeError, EOFError, OSError):
            self.conn.send(message)


@dataclass(frozen=True, slots=True)
class _Crash:
    child: _Child
    exit_code: int | None
    injected: bool
    killed: tuple[str, ...]


class _BringUp(Rehearsal):
    def __init__(
        self,
        request: BringUpRequest,
        the_plan: InitPlan,
        fault: FaultPlan | None,
        *,
        progress: Callable[[ProgressEvent], None] | None,
        skip_release: str | None,
        start_method: str,
    ) -> None:
        super().__init__(request, the_plan, fault)
        self.progress = progress
        self.skip_release = skip_release
        self.ctx = mp_context(start_method)
        self.failpoints = fault.per_participant if fault else markers_only(the_plan)
        # vLLM's CPU spec waits for every worker in a barrier before unlinking; tiering has none.
        self.barrier = None if self.config.is_tiering else self.ctx.Barrier(self.config.world_size)
        self.barrier_aborted = False
        self.children: list[_Child] = []
        self.stages: list[StageResult] = []
        self.extra_errors: list[ErrorInfo] = []
        self.logs: list[LogLine] = []
        self.crash: _Crash | None = None

    # ----------------------------------------------------------------- phases

    def run(self) -> InitReport:
        try:
            self._bring_up()
        finally:
            try:
                if self.crash is None:
                    self._teardown()
            finally:
                self._kill_stragglers()
        return self._report()

    def _bring_up(self) -> None:
        workers = [self._start(WORKER, rank) for rank in range(self.config.world_size)]
        self._pump(workers, lambda c: c.state != "starting", "init")
        if self.crash or any(c.state != "ready" for c in workers):
            return
        scheduler = self._start(SCHEDULER, None)
        self._pump([scheduler], lambda c: c.state != "starting", "init")
        if self.crash or scheduler.state != "ready":
            return
        if self.roundtrip:
            # One worker at a time: in the replicated layout every worker writes the same slot.
            for worker in workers:
                worker.send("roundtrip")
                self._pump([worker], lambda c: c.roundtrip_done, "roundtrip")
                if self.crash:
                    return
        if self.hold is not None:
            self._hold()

    def _start(self, role: str, rank: int | None) -> _Child:
        name = SCHEDULER if role == SCHEDULER else f"{WORKER} {rank}"
        parent_end, child_end = self.ctx.Pipe()
        args = participant.ParticipantArgs(
            name=name,
            role=role,
            rank=rank,
            config=self.config if rank is None else self.config.for_rank(rank),
            failpoints=self.failpoints[name],
            seed=self.fault.seed if self.fault else None,
            barrier_timeout_s=self.idle_timeout_s,
            skip_release=self.skip_release == role,
        )
        process = self.ctx.Process(
            target=participant.main,
            args=(child_end, args, self.barrier if role == WORKER else None),
            name=f"kvoffload-{name.replace(' ', '')}",
            daemon=True,
        )
        process.start()
        child_end.close()
        child = _Child(name, role, rank, process, parent_end, time.monotonic())
        self.children.append(child)
        return child

    def _pids(self) -> dict[str, int]:
        return {c.name: c.pid for c in self.children}

    def _stay_up(self, deadline: float | None) -> None:
        # Ends at the deadline, at Ctrl-C, or when a participant dies; a held engine is silent.
        self._pump(self.children, lambda c: False, "hold", deadline=deadline, idle=False)

    def _teardown(self) -> None:
        """Graceful, in vLLM's order: every worker shuts down, then the scheduler."""
        for role in (WORKER, SCHEDULER):
            group = [c for c in self.children if c.role == role and not c.gone]
            for child in group:
                self._step(f"ask {child.name} to shut down")
                child.send("shutdown")
            self._pump(group, lambda c: c.gone, "shutdown")
            if self.crash:
                return

    def _kill_stragglers(self) -> None:
        for child in self.children:
            if child.process.is_alive():
                self._kill(child, "still running when the bring-up ended")
            child.process.join(_JOIN_S)
            if child.state not in ("exited", "dead"):
                child.state = "dead"
            child.conn.close()

    # ----------------------------------------------------------------- messages

    def _pump(
        self,
        waiting: Sequence[_Child],
        done: Callable[[_Child], bool],
        phase: str,
        *,
        deadline: float | None = None,
        idle: bool = True,
    ) -> None:
        """Handle messages until ``done`` holds for every child in ``waiting``.

        Every live child is watched, not only the awaited ones: a death anywhere ends the
        engine at once. Returns early on a crash or at ``deadline``. With ``idle``, a child
        awaited but silent for ``idle_timeout_s`` is killed.
        """
        from multiprocessing.connection import wait

        while not self.crash:
            pending = [c for c in waiting if not c.gone and not done(c)]
            now = time.monotonic()
            if not pending or (deadline is not None and now >= deadline):
                return
            watched = [c for c in self.children if not c.gone]
            objects: list[Any] = [c.conn for c in watched if not c.eof]
            objects += [c.process.sentinel for c in watched]
            timeout: float | None = None if deadline is None else deadline - now
            if idle:
                silence = max(0.0, min(c.last_heard for c in pending) + self.idle_timeout_s - now)
                timeout = silence if timeout is None else min(timeout, silence)
            ready = set(wait(objects, timeout=timeout))
            for child in watched:
                if child.conn in ready:
                    self._drain(child)
            for child in watched:
                if child.process.sentinel in ready:
                    self._drain(child)
                    self._exited(child)
                    if self.crash:
                        return
            if idle:
                now = time.monotonic()
                for child in pending:
                    if not child.gone and not done(child) and now - child.last_heard > self.idle_timeout_s:
                        self._hung(child, phase)

    def _drain(self, child: _Child) -> None:
        while not child.eof:
            try:
                if not child.conn.poll():
                    return
                message = child.conn.recv()
            except (EOFError, OSError):
                child.eof = True
                return
            child.last_heard = time.monotonic()
            self._handle(child, message)

    def _handle(self, child: _Child, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "stage":
            stage: StageResult = message[1]
            self.stages.append(dataclasses.replace(stage, started_s=stage.started_s - self.t0))
        elif kind == "progress":
            if self.progress is not None:
                self.progress(ProgressEvent(child.name, message[1], message[2], message[3]))
        elif kind == "ready":
            child.state, child.detail = "ready", message[1]
        elif kind == "failed":
            child.state = "failed"
            if child.role == WORKER:
                self._abort_barrier(child)
        elif kind == "roundtrip-done":
            child.roundtrip_done = True
        elif kind == "log":
            line: LogLine = message[1]
            self.logs.append(dataclasses.replace(line, at_s=line.at_s - self.wall0))
        elif kind == "released":
            child.state = "released"
            child.steps = tuple(dataclasses.replace(s, at_s=s.at_s - self.wall0) for s in message[1])
            child.hits = dict(message[2])
            child.held = tuple(message[3])
            child.left_running = tuple(message[4])

    def _exited(self, child: _Child) -> None:
        child.process.join(_JOIN_S)
        code = child.process.exitcode
        if child.state == "released":
            # It released everything before it went; how it exited does not change that.
            child.state = "exited"
            if code != 0:
                self._step(f"{child.name} exited with status {code} after releasing", ok=False)
            return
        child.state = "dead"
        injected = (
            code == -signal.SIGKILL
            and self.fault is not None
            and self.fault.mode.kind == "crash"
            and child.name in self.fault.targeted
        )
        how = "was SIGKILLed" if code == -signal.SIGKILL else f"exited with status {code}"
        self._step(f"{child.name} (pid {child.pid}) died before releasing anything", ok=False, error=how)
        if not injected:
            self.extra_errors.append(
                ErrorInfo(
                    type="ParticipantDied",
                    message=f"{child.name} (pid {child.pid}) {how}",
                    participant=child.name,
                    stage=self._last_stage(child),
                    injected=False,
                )
            )
        killed = []
        for other in self.children:
            if other is not child and not other.gone and other.process.is_alive():
                self._kill(other, "the engine died with it (an OOM kill takes the whole container)")
                killed.append(other.name)
        self._abort_barrier(child)
        self.crash = _Crash(child, code, injected, tuple(killed))

    def _hung(self, child: _Child, phase: str) -> None:
        self._kill(child, f"sent nothing for {self.idle_timeout_s:g}s during {phase}")
        self.extra_errors.append(
            ErrorInfo(
                type="TimeoutError",
                message=f"{child.name} sent nothing for {self.idle_timeout_s:g}s during {phase}; killed",
                participant=child.name,
                stage=phase,
                injected=False,
            )
        )
        if child.role == WORKER:
            self._abort_barrier(child)

    def _kill(self, child: _Child, why: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
        child.process.join(_JOIN_S)
        child.state = "dead"
        self._step(f"SIGKILL {child.name} (pid {child.pid}): {why}")

    def _abort_barrier(self, child: _Child) -> None:
        if self.barrier is None or self.barrier_aborted:
            return
        self.barrier_aborted = True
        self.barrier.abort()
        self._step(f"abort the workers' barrier ({child.name} failed): peers waiting there fail, not hang")

    def _last_stage(self, child: _Child) -> str:
        mine = [s.name for s in self.stages if s.participant == child.name]
        return mine[-1] if mine else "start"

    # ----------------------------------------------------------------- report

    def _report(self) -> InitReport:
        residue = measure_residue(self.config.root, self.config.engine_id)
        stages = tuple(sorted(self.stages, key=lambda s: s.started_s))
        order = {s.name: i for i, s in enumerate(self.plan.stages)}
        stages = tuple(
            dataclasses.replace(s, points=tuple(sorted(s.points, key=lambda p: order.get(p, len(order)))))
            for s in stages
        )
        errors = [s.error for s in stages if s.error is not None] + self.extra_errors
        fault_info = self._fault_info(errors)
        devices = {c.detail for c in self.children if c.role == WORKER and c.detail}
        return self._assemble(
            stages=stages,
            errors=errors,
            fault=fault_info,
            crash=self._crash(residue),
            crashed=None if self.crash is None else self.crash.injected,
            cleanup=[*self.parent_steps, *(s for c in self.children for s in c.steps)],
            residue=residue,
            left_running=any(c.left_running for c in self.children),
            warnings=self._warnings(fault_info),
            device=", ".join(sorted(devices)) or None,
            held_after_release=tuple(h for c in self.children for h in c.held),
            logs=tuple(self.logs),
        )

    def _fault_info(self, errors: list[ErrorInfo]) -> InjectedFaultInfo | None:
        if self.fault is None:
            return None
        asked = set(self.fault.stages)
        fired_in = []
        for child in self.children:
            if child.name not in self.fault.targeted:
                continue
            by_hits = any(child.hits.get(name, 0) > 0 for name in asked)
            by_error = any(e.participant == child.name and e.injected and e.point in asked for e in errors)
            by_crash = self.crash is not None and self.crash.injected and self.crash.child is child
            if by_hits or by_error or by_crash:
                fired_in.append(child.name)
        return self._injected_fault_info(tuple(fired_in))

    def _crash(self, residue: Residue) -> CrashInfo | None:
        if self.crash is None:
            return None
        return self._crash_info(
            residue,
            participant=self.crash.child.name,
            pid=self.crash.child.pid,
            exit_code=self.crash.exit_code,
            injected=self.crash.injected,
            killed=self.crash.killed,
            why_nothing_left=_why_nothing_left(self.plan),
        )

    def _warnings(self, fault: InjectedFaultInfo | None) -> tuple[str, ...]:
        warnings = list(self.plan.warnings)
        if fault is not None and not fault.fired and self.fault is not None:
            creator_only = [s for s in self.fault.stages if (st := self.plan.stage(s)) and st.creator_only]
            if creator_only and isinstance(self.fault.target, int):
                warnings.append(
                    f"{', '.join(creator_only)} runs only in the region's creator, and "
                    f"{self.fault.target_name} joined instead: drop --rank to hit it"
                )
            elif self.fault.mode.percent is not None:
                warnings.append(
                    f"the fault fires with probability {self.fault.mode.percent:g}% and did not fire "
                    f"(seed {self.fault.seed}); another --seed may"
                )
            else:
                warnings.append("the injected fault never fired")
        return tuple(warnings)


def _why_nothing_left(the_plan: InitPlan) -> str:
    return (
        "the crash left nothing: the path was already unlinked "
        f"({the_plan.path_lifetime}), or no file had been created yet"
    )
