"""``shmctl init --engine vllm``: the rehearsal with a real vLLM engine as its participants.

The request, the plan, the fault plan, the report and its outcome are the ones kvoffload's
own bring-up (``kvoffload_engine``) uses, through the ``Rehearsal`` both share; only who runs
the stages differs. One child process (``kvoffload.vllm_engine.child``, which stays in the
package a vLLM engine loads) constructs ``vllm.LLM`` with kvoffload's spec
(``spec_module_path``) and a kv-transfer config built from the plan's settings
(``vllm_inputs``); vLLM starts its EngineCore (the scheduler side: ``get_manager``) and its
Workers (``create_worker``) itself. So the parent cannot talk to those processes: it learns
what each one did from three sources that need no cooperation from vLLM (``vllm_evidence``
reads the journal and ``/proc``):

* ``KVOFFLOAD_FAILPOINTS`` in the environment every engine process inherits: the fault at the
  chosen stage and a no-op marker at every other stage of the plan, as in the kvoffload engine;
  ``KVOFFLOAD_FAILPOINTS_JOURNAL`` makes each process record the points it passes and the
  fault that fired in it, with its pid and vLLM's process title (``VLLM::Worker``...);
* the child's JSON lines on a pipe: engine up (or the error ``LLM()`` raised), the round trip,
  released;
* ``/proc``: which engine processes map the region once up, which ones outlive the client.

Every engine start is bounded (``start_timeout_s``), every later wait too (``idle_timeout_s``).
The child runs in a session of its own, so Ctrl-C at the terminal reaches only this process,
which then shuts the engine down (gracefully first), SIGKILLs its process group, and removes
region files its own kill left (every process of the engine is gone by then, so they are
this rehearsal's orphans). Nothing outlives the bring-up on any path but the orphans of an
injected crash, which the report lists with the reap command, as for kvoffload's engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvoffload import faults
from kvoffload.bringup.faultplan import FaultPlan, markers_only
from kvoffload.bringup.plan import InitPlan, require_room
from kvoffload.bringup.rehearsal import Rehearsal
from kvoffload.bringup.report import (
    CleanupStep,
    CrashInfo,
    EngineProcess,
    EngineRoundtrip,
    ErrorInfo,
    InitReport,
    InjectedFaultInfo,
    StageResult,
    VllmEngineInfo,
)
from kvoffload.bringup.request import BringUpRequest
from kvoffload.bringup.residue import Residue, held_handles, measure_residue
from kvoffload.bringup.vllm_evidence import (
    CLIENT,
    Fired,
    injected_error,
    no_start_error,
    participant_of,
    process_group,
    read_journal,
    stage_of,
)
from kvoffload.bringup.vllm_inputs import (
    check_vllm_target,
    engine_kv_transfer_config,
    require_model_dir,
    require_vllm,
)
from kvoffload.errors import ConfigError

DEFAULT_START_TIMEOUT_S = 300.0
#: How long the EngineCore and Workers get to exit after the client did, before they count as left.
SETTLE_S = 15.0
#: After Ctrl-C or a timeout: how long the engine gets to shut down before its group is killed.
_GRACE_S = 10.0
_LOG_TAIL = 12


def bring_up_vllm(
    request: BringUpRequest,
    *,
    model: Path | str,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    settle_s: float = SETTLE_S,
    command: Sequence[str] | None = None,
) -> InitReport:
    """Start a vLLM engine with kvoffload's spec, fault and all; shut it down; report like ``bring_up``.

    ``command`` replaces ``python -m kvoffload.vllm_engine.child`` (a stand-in speaking the same
    protocol, for tests); vLLM is required only without it. Raises ``ConfigError`` before
    anything starts for an invalid fault, an unreadable model or a missing vLLM, and
    ``CapacityError`` when the root cannot hold the region (the dry run's rule).
    """
    the_plan, fault = request.plan_fault()
    check_vllm_target(the_plan, fault)
    for option, value in (("--start-timeout", start_timeout_s), ("--timeout", request.idle_timeout_s)):
        if value <= 0:
            raise ConfigError(option, f"must be positive, got {value:g}")
    require_model_dir(model)
    if command is None:
        require_vllm()
        command = [sys.executable, "-m", "kvoffload.vllm_engine.child"]
    # The rehearsal's own check, as with kvoffload's processes; vLLM's spec still checks for
    # itself when it creates the region (InsufficientSpaceError), unchanged.
    require_room(the_plan)
    run = _VllmBringUp(
        request,
        the_plan,
        fault,
        model=str(model),
        command=list(command),
        start_timeout_s=start_timeout_s,
        settle_s=settle_s,
    )
    return run.run()


@dataclass
class _Engine:
    process: subprocess.Popen[bytes]
    report_fd: int
    buffer: bytes = b""
    events: list[dict[str, Any]] = field(default_factory=list)
    seen: dict[int, str] = field(default_factory=dict)  # pid -> title, every engine process seen

    @property
    def pid(self) -> int:
        return self.process.pid


class _Timeout(Exception):
    pass


class _VllmBringUp(Rehearsal):
    def __init__(
        self,
        request: BringUpRequest,
        the_plan: InitPlan,
        fault: FaultPlan | None,
        *,
        model: str,
        command: list[str],
        start_timeout_s: float,
        settle_s: float,
    ) -> None:
        super().__init__(request, the_plan, fault)
        self.model = model
        self.command = command
        self.start_timeout_s = start_timeout_s
        self.settle_s = settle_s
        configs = fault.per_participant if fault else markers_only(the_plan)
        # One environment for every engine process: the targeted participant's configuration
        # (check_vllm_target made sure no other process reaches the fault's stage).
        self.failpoints = configs[fault.targeted[0] if fault else the_plan.participants[0]]
        self.kv_config = engine_kv_transfer_config(self.config)
        self.engine: _Engine | None = None
        self.errors: list[ErrorInfo] = []
        self.up_s: float | None = None
        self.version: str | None = None
        self.region_mapped_by: tuple[str, ...] = ()
        self.roundtrip_result: EngineRoundtrip | None = None
        self.processes_left: list[EngineProcess] = []
        self.killed: list[str] = []
        self.ended_by_us = False
        self.exit_code: int | None = None
        self.log_tail: tuple[str, ...] = ()

    # ----------------------------------------------------------------- phases

    def run(self) -> InitReport:
        workdir = Path(tempfile.mkdtemp(prefix="shmctl-init-vllm-"))
        journal, log = workdir / "faults.jsonl", workdir / "engine.log"
        try:
            interrupted = True
            try:
                self._start(journal, log)
                self._drive()
                interrupted = False
            except _Timeout:
                interrupted = False
            finally:
                self._end(interrupted=interrupted)
            fired = read_journal(journal)
            self.log_tail = self._log_tail(log)
            return self._report(fired)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _start(self, journal: Path, log: Path) -> None:
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            faults.ENV_VAR: self.failpoints,
            faults.JOURNAL_ENV_VAR: str(journal),
        }
        env.pop(faults.SEED_ENV_VAR, None)
        if self.fault is not None and self.fault.seed is not None:
            env[faults.SEED_ENV_VAR] = str(self.fault.seed)
        read_end, write_end = os.pipe()
        argv = [*self.command, "--model", self.model, "--kv-config", json.dumps(self.kv_config)]
        argv += ["--report-fd", str(write_end), "--tensor-parallel-size", str(self.config.world_size)]
        if not self.roundtrip:
            argv.append("--no-roundtrip")
        try:
            with log.open("wb") as sink:
                process = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    pass_fds=(write_end,),
                    env=env,
                    # Its own session: Ctrl-C reaches only us, and its group is the engine's.
                    start_new_session=True,
                )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        os.set_blocking(read_end, False)
        self.engine = _Engine(process, read_end)

    def _drive(self) -> None:
        assert self.engine is not None
        event = self._wait({"up", "failed"}, self.start_timeout_s, "engine start")
        if event is None or event["event"] == "failed":
            if event is not None:
                self.errors.append(self._client_error(event, "engine"))
            return
        self.up_s = float(event["seconds"])
        self.version = str(event.get("version")) or None
        self._look_at_engine()
        if self.roundtrip:
            done = self._wait({"roundtrip", "roundtrip-failed"}, self.idle_timeout_s, "round trip")
            if done is not None:
                self._roundtrip_done(done)
        if self.hold is not None:
            self._hold()

    def _pids(self) -> dict[str, int]:
        assert self.engine is not None
        return {participant_of(pid, title, self.engine.pid): pid for pid, title in self.engine.seen.items()}

    def _stay_up(self, deadline: float | None) -> None:
        assert self.engine is not None
        while self.engine.process.poll() is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.2)

    def _end(self, *, interrupted: bool) -> None:
        """Shut the engine down: its stdin closed, then its group killed; our own kill's files removed."""
        engine = self.engine
        if engine is None:
            return
        try:
            if engine.process.poll() is None:
                self._step("close the engine's stdin: shut down")
                with contextlib.suppress(OSError):
                    if engine.process.stdin is not None:
                        engine.process.stdin.close()
                grace = _GRACE_S if interrupted or self.ended_by_us else self.idle_timeout_s
                with contextlib.suppress(_Timeout):
                    if self._wait({"released"}, grace, "shutdown", quiet=interrupted) is not None:
                        self._step("the client released the engine")
                try:
                    engine.process.wait(grace)
                except subprocess.TimeoutExpired:
                    self.ended_by_us = True
            self._drain()
            self.exit_code = engine.process.poll()
            self._settle(interrupted or self.ended_by_us)
        finally:
            self._kill_group()
            with contextlib.suppress(OSError):
                os.close(engine.report_fd)
            if engine.process.stdin is not None:
                with contextlib.suppress(OSError):
                    engine.process.stdin.close()
            if self.ended_by_us or interrupted:
                self._remove_what_our_kill_left()

    def _settle(self, ours: bool) -> None:
        """Give the EngineCore and Workers ``settle_s`` to follow the client out; note who stays."""
        assert self.engine is not None
        deadline = time.monotonic() + (0.0 if ours else self.settle_s)
        group = process_group(self.engine.pid)
        while group and time.monotonic() < deadline:
            time.sleep(0.2)
            group = process_group(self.engine.pid)
        for pid, title in group.items():
            who = EngineProcess(participant_of(pid, title, self.engine.pid), pid, title)
            if not ours:
                self.processes_left.append(who)

    def _kill_group(self) -> None:
        assert self.engine is not None
        engine = self.engine
        members = process_group(engine.pid)
        for pid, title in members.items():
            engine.seen.setdefault(pid, title)
            self.killed.append(participant_of(pid, title, engine.pid))
            self._step(f"SIGKILL {participant_of(pid, title, engine.pid)} (pid {pid}, {title})")
        # A group id stays taken while a member lives or its leader is unreaped; once the group is
        # empty and the leader reaped, the number may be a new process's group: never signal it.
        if members or engine.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(engine.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            engine.process.wait(5.0)
        deadline = time.monotonic() + 5.0
        while process_group(engine.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.exit_code is None:
            self.exit_code = engine.process.poll()

    def _remove_what_our_kill_left(self) -> None:
        """Files of this engine left by our own SIGKILL (a timeout, Ctrl-C): nobody is left to hold them."""
        left = measure_residue(self.config.root, self.config.engine_id)
        if not left:
            return
        from kvoffload.liveness.reap import ReapFilter, reap

        try:
            done = reap(self.config.root, grace_s=0.0, filters=ReapFilter.exactly(self.config.engine_id))
        except Exception as e:  # a failed removal is reported as residue, never raised over the cause
            self._step("remove the files the killed engine left", ok=False, error=f"{type(e).__name__}: {e}")
            return
        names = ", ".join(p.name for p in (e.path for e in done.removed)) or "none"
        self._step(f"remove the files the killed engine left: {names}", ok=not done.kept)

    # ----------------------------------------------------------------- messages

    def _wait(
        self, wanted: set[str], timeout_s: float, phase: str, *, quiet: bool = False
    ) -> dict[str, Any] | None:
        """The next event in ``wanted``; None when the child exits first, or at the timeout."""
        assert self.engine is not None
        engine = self.engine
        deadline = time.monotonic() + timeout_s
        while True:
            for i, event in enumerate(engine.events):
                if event["event"] in wanted:
                    del engine.events[: i + 1]
                    return event
            engine.events.clear()
            self._remember_processes()
            if engine.process.poll() is not None:
                self._drain()
                if any(e["event"] in wanted for e in engine.events):
                    continue
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                if not quiet:
                    self.errors.append(
                        ErrorInfo(
                            type="TimeoutError",
                            message=f"the engine sent nothing for {timeout_s:g}s during {phase}; killed",
                            participant=CLIENT,
                            stage="engine"
                            if phase == "engine start"
                            else "roundtrip"
                            if phase == "round trip"
                            else "shutdown",
                            injected=False,
                        )
                    )
                self.ended_by_us = True
                raise _Timeout
            select.select([engine.report_fd], [], [], min(left, 0.5))
            self._drain()

    def _drain(self) -> None:
        assert self.engine is not None
        engine = self.engine
        while True:
            try:
                chunk = os.read(engine.report_fd, 65536)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            engine.buffer += chunk
        *lines, engine.buffer = engine.buffer.split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict) and isinstance(event.get("event"), str):
                    engine.events.append(event)

    def _remember_processes(self) -> None:
        assert self.engine is not None
        for pid, title in process_group(self.engine.pid).items():
            self.engine.seen[pid] = title

    def _look_at_engine(self) -> None:
        """Up: which of its processes map the region (deleted or not)."""
        assert self.engine is not None
        self._remember_processes()
        mapped = []
        for pid, title in sorted(self.engine.seen.items()):
            name = participant_of(pid, title, self.engine.pid)
            if held_handles(name, self.config.engine_id, Path(f"/proc/{pid}")):
                mapped.append(name)
        self.region_mapped_by = tuple(dict.fromkeys(mapped))

    def _roundtrip_done(self, event: Mapping[str, Any]) -> None:
        if event["event"] == "roundtrip-failed":
            self.errors.append(self._client_error(event, "roundtrip"))
            return
        result = EngineRoundtrip(
            store_bytes=int(event["store_bytes"]),
            load_bytes=int(event["load_bytes"]),
            external_hits=int(event["external_hits"]),
            same_tokens=bool(event["same_tokens"]),
        )
        self.roundtrip_result = result
        if not (result.store_bytes and result.load_bytes and result.same_tokens):
            what = "the tokens after reset_prefix_cache() differ" if not result.same_tokens else "no bytes"
            self.errors.append(
                ErrorInfo(
                    type="RoundtripError",
                    message=f"the round trip through the region failed: {what} "
                    f"(stored {result.store_bytes} B, loaded {result.load_bytes} B)",
                    participant=CLIENT,
                    stage="roundtrip",
                    injected=False,
                )
            )

    def _client_error(self, event: Mapping[str, Any], stage: str) -> ErrorInfo:
        return ErrorInfo(
            type=str(event.get("type", "Error")),
            message=str(event.get("message", "")),
            participant=CLIENT,
            stage=stage,
            injected=False,
        )

    def _log_tail(self, log: Path) -> tuple[str, ...]:
        healthy = not self.errors and not self.processes_left and not self.ended_by_us
        if healthy:
            return ()
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            return ()
        return tuple(line[-300:] for line in lines[-_LOG_TAIL:])

    # ----------------------------------------------------------------- report

    def _report(self, fired: list[Fired]) -> InitReport:
        assert self.engine is not None
        engine = self.engine
        for f in fired:
            # The title when the point fired: /proc may have shown the process before vLLM titled it.
            if f.title or f.pid not in engine.seen:
                engine.seen[f.pid] = f.title
        name_of = {pid: participant_of(pid, title, engine.pid) for pid, title in engine.seen.items()}
        stages = self._stages(fired, name_of)
        injected = [
            injected_error(f, name_of.get(f.pid, CLIENT)) for f in fired if f.injected and f.action != "crash"
        ]
        errors = [*injected, *self.errors]
        crash_fired = next((f for f in fired if f.action.endswith("crash")), None)
        residue = measure_residue(self.config.root, self.config.engine_id)
        fault_info = self._fault_info(fired, name_of)
        crash = self._crash(crash_fired, name_of, residue)
        processes = tuple(
            EngineProcess(name_of[pid], pid, title) for pid, title in sorted(engine.seen.items())
        )
        info = VllmEngineInfo(
            model=self.model,
            version=self.version,
            kv_transfer_config=json.dumps(self.kv_config, sort_keys=True),
            failpoints=self.failpoints,
            processes=processes,
            up_s=self.up_s,
            region_mapped_by=self.region_mapped_by,
            roundtrip=self.roundtrip_result,
            exit_code=self.exit_code,
            processes_left=tuple(self.processes_left),
            log_tail=self.log_tail,
        )
        return self._assemble(
            stages=stages,
            errors=errors,
            fault=fault_info,
            crash=crash,
            crashed=None if crash is None else True,  # a crash here is always the injected one
            cleanup=[*self.parent_steps, *self._release_steps(fired, name_of)],
            residue=residue,
            left_running=bool(self.processes_left),
            warnings=self._warnings(fault_info),
            engine="vllm",
            vllm=info,
        )

    def _stages(self, fired: list[Fired], name_of: Mapping[int, str]) -> tuple[StageResult, ...]:
        """The engine's own stage (client), then each process's library calls, from the journal."""
        assert self.engine is not None
        results: list[StageResult] = []
        up_at = self.up_s
        failed_start = next((e for e in self.errors if e.stage == "engine"), None)
        results.append(
            StageResult(
                name="engine",
                participant=CLIENT,
                pid=self.engine.pid,
                started_s=0.0,
                seconds=up_at if up_at is not None else time.monotonic() - self.t0,
                bytes=0,
                result="ok" if up_at is not None else "failed",
                detail=f"vllm.LLM({Path(self.model).name}) up"
                if up_at is not None
                else "vllm.LLM() did not come up",
                error=None if up_at is not None else failed_start or no_start_error(),
            )
        )
        groups: dict[tuple[int, str], list[Fired]] = {}
        for f in sorted(fired, key=lambda f: f.t):
            participant = name_of.get(f.pid, CLIENT)
            groups.setdefault((f.pid, stage_of(f.point, participant)), []).append(f)
        order = {s.name: i for i, s in enumerate(self.plan.stages)}
        for (pid, stage), hits in groups.items():
            participant = name_of.get(pid, CLIENT)
            points = tuple(
                sorted(dict.fromkeys(h.point for h in hits), key=lambda p: order.get(p, len(order)))
            )
            error = next(
                (injected_error(h, participant) for h in hits if h.injected and h.action != "crash"), None
            )
            detail = None
            if stage == "create_worker":
                detail = "created the region" if "region.space" in points else "joined the region"
            results.append(
                StageResult(
                    name=stage,
                    participant=participant,
                    pid=pid,
                    started_s=hits[0].t - self.wall0,
                    seconds=max(0.0, hits[-1].t - hits[0].t),
                    bytes=0,
                    result="ok" if error is None else "failed",
                    detail=detail,
                    points=points,
                    error=error,
                )
            )
        if self.roundtrip_result is not None or any(e.stage == "roundtrip" for e in self.errors):
            rt = self.roundtrip_result
            error = next((e for e in self.errors if e.stage == "roundtrip"), None)
            results.append(
                StageResult(
                    name="roundtrip",
                    participant=CLIENT,
                    pid=self.engine.pid,
                    started_s=up_at or 0.0,
                    seconds=0.0,
                    bytes=(rt.store_bytes + rt.load_bytes) if rt else 0,
                    result="ok" if error is None else "failed",
                    detail=f"{rt.external_hits} tokens from the region after reset_prefix_cache()"
                    if rt
                    else None,
                    error=error,
                )
            )
        return tuple(sorted(results, key=lambda s: s.started_s))

    def _release_steps(self, fired: list[Fired], name_of: Mapping[int, str]) -> list[CleanupStep]:
        steps = []
        for f in fired:
            if f.point.startswith("cleanup."):
                error = f"{f.action} (injected)" if f.injected else None
                steps.append(
                    CleanupStep(
                        name_of.get(f.pid, CLIENT),
                        f"passed {f.point}",
                        not f.injected,
                        error,
                        f.t - self.wall0,
                    )
                )
        return steps

    def _fault_info(self, fired: list[Fired], name_of: Mapping[int, str]) -> InjectedFaultInfo | None:
        if self.fault is None:
            return None
        asked = set(self.fault.stages)
        fired_in = tuple(
            dict.fromkeys(name_of.get(f.pid, CLIENT) for f in fired if f.injected and f.point in asked)
        )
        return self._injected_fault_info(fired_in)

    def _crash(self, crash: Fired | None, name_of: Mapping[int, str], residue: Residue) -> CrashInfo | None:
        if crash is None:
            return None
        victim = name_of.get(crash.pid, CLIENT)
        return self._crash_info(
            residue,
            participant=victim,
            pid=crash.pid,
            exit_code=-signal.SIGKILL,
            injected=True,
            killed=tuple(k for k in dict.fromkeys(self.killed) if k != victim),
            why_nothing_left="the crash left nothing: the engine's other processes released the region, "
            "or no file existed yet",
        )

    def _warnings(self, fault: InjectedFaultInfo | None) -> tuple[str, ...]:
        warnings = list(self.plan.warnings)
        if fault is not None and not fault.fired:
            warnings.append("the injected fault never fired in any engine process")
        return tuple(warnings)
