"""What a bring-up and a fault matrix report: frozen dataclasses, serialised as the JSON.

One report for both bring-ups (kvoffload's own participants and a vLLM engine's): the same
``InitReport``, the same outcome judged by ``judge`` from the same facts, so the CLI's exit
status and the JSON schema do not depend on who ran the stages. Times are seconds since the
bring-up started (``started_s``, ``at_s``), so stages of different processes line up on one
clock. What was left behind (residue, handles, threads) is measured in ``residue``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from kvoffload.bringup.plan import Capacity
from kvoffload.bringup.residue import HeldHandle, Residue
from kvoffload.errors import InjectedFault

SCHEMA_VERSION = 1
_INJECTED_OSERROR = re.compile(r"\(injected at (?P<point>[A-Za-z0-9_.]+)\)$")


class BringUpOutcome(StrEnum):
    """The outcome of one bring-up, from which the CLI derives its exit status.

    (``verdict`` in the reports and their JSON.)
    """

    OK = "ok"  # no fault asked; up and down; nothing left
    CONTRACT_HELD = "contract-held"  # the injected fault fired; nothing left
    NOT_FIRED = "not-fired"  # a fault was asked but never fired; nothing left
    LEAKED = "leaked"  # files left behind after a graceful or unwound run, or threads/sockets
    #                    a participant still ran after its release
    ORPHANED = "orphaned"  # a crash left files behind: orphans until reaped
    FAILED = "failed"  # failed for a reason that was not injected; nothing left


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    type: str
    message: str
    participant: str
    stage: str
    injected: bool
    point: str | None = None
    errno: int | None = None
    notes: tuple[str, ...] = ()

    @classmethod
    def of(cls, error: BaseException, participant: str, stage: str) -> ErrorInfo:
        """Describe ``error``; injected means a fault point raised it (InjectedFault, or its OSError)."""
        point: str | None = None
        if isinstance(error, InjectedFault):
            point = error.point
        elif isinstance(error, OSError) and isinstance(error.strerror, str):
            m = _INJECTED_OSERROR.search(error.strerror)
            point = m.group("point") if m else None
        return cls(
            type=type(error).__name__,
            message=str(error),
            participant=participant,
            stage=stage,
            injected=point is not None,
            point=point,
            errno=error.errno if isinstance(error, OSError) else None,
            notes=tuple(getattr(error, "__notes__", ())),
        )


@dataclass(frozen=True, slots=True)
class StageResult:
    """One step of one participant: a library call (``create_worker``, ``get_manager``, ...).

    ``points``: the fault points it passed, in order; ``bytes``: what it populated,
    allocated or moved.
    """

    name: str
    participant: str
    pid: int
    started_s: float
    seconds: float
    bytes: int
    result: str  # "ok" or "failed"
    detail: str | None = None
    points: tuple[str, ...] = ()
    error: ErrorInfo | None = None


@dataclass(frozen=True, slots=True)
class CleanupStep:
    """One release step, in the order it ran; ``parent`` steps are the orchestrator's."""

    participant: str
    what: str
    ok: bool
    error: str | None
    at_s: float


@dataclass(frozen=True, slots=True)
class LogLine:
    """A warning or error a participant logged, one line (tracebacks stay in the process)."""

    participant: str
    level: str
    logger: str
    message: str
    at_s: float


@dataclass(frozen=True, slots=True)
class InjectedFaultInfo:
    stages: tuple[str, ...]
    mode: str
    failpoints: str
    target: str
    seed: int | None
    fired: bool
    fired_in: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CrashInfo:
    """A participant died without releasing anything; the parent then SIGKILLed the rest."""

    participant: str
    pid: int
    exit_code: int | None
    injected: bool
    killed: tuple[str, ...]
    orphans: tuple[Path, ...]
    reap_command: str | None
    why_nothing_left: str | None


@dataclass(frozen=True, slots=True)
class EngineProcess:
    """One process of a real vLLM engine, as ``/proc`` named it (vLLM sets its title)."""

    participant: str  # "client", "scheduler" (the EngineCore), "worker R"
    pid: int
    title: str


@dataclass(frozen=True, slots=True)
class EngineRoundtrip:
    """A prompt, ``reset_prefix_cache()``, the same prompt: what the connector moved."""

    store_bytes: int
    load_bytes: int
    external_hits: int
    same_tokens: bool


@dataclass(frozen=True, slots=True)
class VllmEngineInfo:
    """``init --engine vllm``: the real engine the rehearsal ran, and what it left running."""

    model: str
    version: str | None
    #: The ``--kv-transfer-config`` the engine got (kvoffload's spec through ``spec_module_path``).
    kv_transfer_config: str
    #: ``KVOFFLOAD_FAILPOINTS`` in every engine process's environment (markers included).
    failpoints: str
    processes: tuple[EngineProcess, ...]
    up_s: float | None
    #: Participants that had this engine's region mapped once the engine was up.
    region_mapped_by: tuple[str, ...]
    roundtrip: EngineRoundtrip | None
    exit_code: int | None
    #: Engine processes still running after the client exited (killed by the parent then).
    processes_left: tuple[EngineProcess, ...]
    #: The engine's last log lines when it did not come up or did not end cleanly.
    log_tail: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class InitReport:
    schema_version: int
    engine_id: str
    spec: str
    root: Path
    lifetime: str
    world_size: int
    device: str | None
    fault: InjectedFaultInfo | None
    stages: tuple[StageResult, ...]
    error: ErrorInfo | None
    errors: tuple[ErrorInfo, ...]
    cleanup: tuple[CleanupStep, ...]
    residue: Residue
    held_after_release: tuple[HeldHandle, ...]
    crash: CrashInfo | None
    logs: tuple[LogLine, ...]
    held_s: float | None
    duration_s: float
    verdict: BringUpOutcome
    warnings: tuple[str, ...]
    #: Whose processes ran the bring-up: ``kvoffload`` (its own participants) or ``vllm``.
    engine: str = "kvoffload"
    vllm: VllmEngineInfo | None = None


@dataclass(frozen=True, slots=True)
class KeptFile:
    """A file a crash cell left that the reap after it did not remove, and the reap's reason."""

    path: Path
    status: str
    reason: str


@dataclass(frozen=True, slots=True)
class MatrixCell:
    stage: str
    mode: str
    engine_id: str
    verdict: BringUpOutcome
    passed: bool
    leaked: bool
    fired: bool
    error: ErrorInfo | None
    residue: Residue
    cleanup_steps: int
    cleanup_failures: int
    duration_s: float
    #: crash cells: what the crash left, what a scan called it, what a reap removed, what
    #: it kept (and why), and the command that removes the rest once that reason is gone.
    orphans: tuple[Path, ...] = ()
    scan_status: tuple[str, ...] = ()
    reaped: tuple[Path, ...] = ()
    kept: tuple[KeptFile, ...] = ()
    reap_command: str | None = None


@dataclass(frozen=True, slots=True)
class MatrixStop:
    """Why the matrix ended before its last cell; ``not_run`` cells from ``stage`` x ``mode`` on
    never started.

    ``reason`` is ``kept`` (a crash cell's files survived the reap: the next cells would pile
    theirs on top until the root is full) or ``capacity`` (the next cell no longer fits).
    """

    reason: str
    message: str
    stage: str
    mode: str
    not_run: int
    kept: tuple[KeptFile, ...] = ()
    reap_command: str | None = None
    capacity: Capacity | None = None


@dataclass(frozen=True, slots=True)
class MatrixReport:
    schema_version: int
    spec: str
    world_size: int
    lifetime: str
    root: Path
    target: str
    stages: tuple[str, ...]
    modes: tuple[str, ...]
    cells: tuple[MatrixCell, ...]
    passed: int
    failed: int
    leaked: int
    duration_s: float
    stopped: MatrixStop | None = None


def judge(
    residue: Residue,
    *,
    left_running: bool,
    primary: ErrorInfo | None,
    fault: InjectedFaultInfo | None,
    crashed: bool | None,
) -> BringUpOutcome:
    """A bring-up's verdict, whoever its participants were (kvoffload's processes or a vLLM
    engine). ``crashed``: None without a crash, else whether the crash was the injected one;
    ``left_running``: a participant still had threads, sockets or processes after its release."""
    if crashed is not None:
        if residue:
            return BringUpOutcome.ORPHANED
        return BringUpOutcome.CONTRACT_HELD if crashed else BringUpOutcome.FAILED
    if residue or left_running:
        return BringUpOutcome.LEAKED
    if primary is not None and not primary.injected:
        return BringUpOutcome.FAILED
    if fault is not None:
        return BringUpOutcome.CONTRACT_HELD if fault.fired else BringUpOutcome.NOT_FIRED
    return BringUpOutcome.OK
