"""What a bring-up and a fault matrix report: frozen dataclasses, serialised as the JSON.

Times are seconds since the bring-up started (``started_s``, ``at_s``), so stages of
different processes line up on one clock. Residue is measured in the root after every
participant has exited: the files named after this engine's id, their apparent size
and their resident bytes (``st_blocks * 512``, what tmpfs charges).
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from kvoffload.bringup.plan import Capacity
from kvoffload.errors import InjectedFault
from kvoffload.shm import names

SCHEMA_VERSION = 1
_INJECTED_OSERROR = re.compile(r"\(injected at (?P<point>[A-Za-z0-9_.]+)\)$")


class Verdict(StrEnum):
    """The outcome of one bring-up, from which the CLI derives its exit status."""

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
class HeldHandle:
    """An fd or mapping of this engine's region that a participant still had after its release.

    It dies with the process, so it is no residue of the root; it says a release step
    did not release everything (a skipped primary shutdown, a buffer still exported).
    """

    participant: str
    kind: str  # "fd" or "map"
    target: str


@dataclass(frozen=True, slots=True)
class LogLine:
    """A warning or error a participant logged, one line (tracebacks stay in the process)."""

    participant: str
    level: str
    logger: str
    message: str
    at_s: float


@dataclass(frozen=True, slots=True)
class ResidueFile:
    path: Path
    size_bytes: int
    resident_bytes: int


@dataclass(frozen=True, slots=True)
class Residue:
    """This engine's files still in the root; ``bytes`` is resident memory."""

    paths: tuple[Path, ...]
    bytes: int
    size_bytes: int
    files: tuple[ResidueFile, ...]

    def __bool__(self) -> bool:
        return bool(self.paths)


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
    verdict: Verdict
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
    verdict: Verdict
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
) -> Verdict:
    """A bring-up's verdict, whoever its participants were (kvoffload's processes or a vLLM
    engine). ``crashed``: None without a crash, else whether the crash was the injected one;
    ``left_running``: a participant still had threads, sockets or processes after its release."""
    if crashed is not None:
        if residue:
            return Verdict.ORPHANED
        return Verdict.CONTRACT_HELD if crashed else Verdict.FAILED
    if residue or left_running:
        return Verdict.LEAKED
    if primary is not None and not primary.injected:
        return Verdict.FAILED
    if fault is not None:
        return Verdict.CONTRACT_HELD if fault.fired else Verdict.NOT_FIRED
    return Verdict.OK


def held_handles(participant: str, engine_id: str, proc_self: Path = Path("/proc/self")) -> list[HeldHandle]:
    """This process's fds and mappings of ``engine_id``'s region files (deleted or not)."""
    base = names.format_name(engine_id)
    found: list[HeldHandle] = []
    try:
        fds = os.listdir(proc_self / "fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(proc_self / "fd" / fd)
        except OSError:
            continue
        if _names_region(target, base):
            found.append(HeldHandle(participant, "fd", target))
    try:
        with open(proc_self / "maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and _names_region(fields[5].strip(), base):
                    found.append(HeldHandle(participant, "map", f"{fields[0]} {fields[5].strip()}"))
    except OSError:
        pass
    return found


@dataclass(frozen=True, slots=True)
class Footprint:
    """This process's Python threads and socket fds, to tell what a bring-up left running.

    A tier's control plane binds sockets and its data plane runs threads (vLLM's p2p tier:
    a ZMQ router and a NIXL registration pool; its object tier: a lookup thread). Neither
    is a file in the root, so the root's residue check cannot see them: a participant takes
    its footprint before init and compares after its release (``left_running``).
    """

    threads: frozenset[threading.Thread]
    #: One per fd: "socket:[inode]", or "anon_inode:[eventfd] (fd N)" for the kernel event
    #: handles a library's native threads poll (a ZMQ context holds eventfds and an epoll; its
    #: I/O threads are native, invisible to ``threading``, and go with the context).
    handles: frozenset[str]
    #: Whether ``handles`` counts event fds (False: sockets only; see ``now``).
    event_fds: bool = True

    @classmethod
    def now(cls, proc_self: Path = Path("/proc/self"), *, event_fds: bool = True) -> Footprint:
        """``event_fds=False`` counts sockets only: a worker's accelerator runtime (CUDA) may keep
        event fds for the life of the process, and no tier runs there."""
        handles = frozenset(_handle_fds(proc_self, event_fds))
        return cls(frozenset(threading.enumerate()), handles, event_fds)


#: How long a thread or socket may take to go after the release returned (a thread told to
#: stop may still be on its way out), before it counts as left running.
LEFT_RUNNING_GRACE_S = 1.0


def left_running(
    before: Footprint, *, grace_s: float = LEFT_RUNNING_GRACE_S, proc_self: Path = Path("/proc/self")
) -> tuple[str, ...]:
    """Threads and sockets this process has now and did not have at ``before``, one line each.

    Waits up to ``grace_s`` for them to go; empty when nothing is left (and then at once).
    """
    deadline = time.monotonic() + grace_s
    while True:
        now = Footprint.now(proc_self, event_fds=before.event_fds)
        threads = [t for t in now.threads - before.threads if t.is_alive()]
        sockets = sorted(now.handles - before.handles)
        left = time.monotonic() - deadline
        if not (threads or sockets) or left >= 0:
            break
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if not threads:
            time.sleep(min(0.05, -left))
    return (
        *(f"thread {t.name!r}{' (daemon)' if t.daemon else ''}" for t in sorted(threads, key=_name)),
        *(f"fd {s}" for s in sockets),
    )


def _name(thread: threading.Thread) -> str:
    return thread.name


def _handle_fds(proc_self: Path, event_fds: bool = True) -> list[str]:
    found: list[str] = []
    try:
        fds = os.listdir(proc_self / "fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(proc_self / "fd" / fd)
        except OSError:
            continue
        if target.startswith("socket:"):
            found.append(target)
        elif event_fds and target.startswith("anon_inode:"):
            found.append(f"{target} (fd {fd})")  # no inode to tell two apart: the fd does
    return found


def _names_region(target: str, base: str) -> bool:
    name = target.rsplit("/", 1)[-1].removesuffix(" (deleted)")
    return name == base or name.startswith(base + ".")


def measure_residue(root: Path, engine_id: str) -> Residue:
    """This engine's region files (base and segments) in ``root``; nothing else is looked at."""
    files: list[ResidueFile] = []
    try:
        entries = sorted(os.listdir(root))
    except FileNotFoundError:
        entries = []
    for entry in entries:
        parsed = names.parse(entry)
        if parsed is None or parsed.engine_id != engine_id:
            continue
        try:
            st = os.lstat(root / entry)
        except FileNotFoundError:
            continue
        files.append(ResidueFile(root / entry, st.st_size, st.st_blocks * 512))
    return Residue(
        paths=tuple(f.path for f in files),
        bytes=sum(f.resident_bytes for f in files),
        size_bytes=sum(f.size_bytes for f in files),
        files=tuple(files),
    )
