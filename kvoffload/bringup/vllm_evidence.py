"""What the parent learns from a vLLM engine's processes without their cooperation.

vLLM starts its EngineCore and Workers itself, so the parent cannot talk to them. It reads:

* the fault journal (``KVOFFLOAD_FAILPOINTS_JOURNAL``): each engine process appends a line
  per fault point it passes, with its pid and vLLM's process title: ``Fired``;
* ``/proc``: the engine's process group (the client leads it) and each member's title.

vLLM's titles name the participants of the plan: the EngineCore is the scheduler side,
``VLLM::Worker_TP<R>`` is worker R, and the client (``CLIENT``) is the child the parent
started. A fault point belongs to the library call the kvoffload engine names its stage for.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvoffload import faults
from kvoffload.bringup.plan import SCHEDULER, WORKER
from kvoffload.bringup.report import ErrorInfo

#: The participant name of the engine's client process (the child running ``vllm.LLM``).
CLIENT = "client"


@dataclass(frozen=True, slots=True)
class Fired:
    """One journal line: ``point`` fired in ``pid`` (``action``: a marker, or the fault)."""

    point: str
    action: str
    pid: int
    title: str
    t: float

    @property
    def injected(self) -> bool:
        return not self.action.startswith("sleep")


def participant_of(pid: int, title: str, client_pid: int) -> str:
    """vLLM's process title as the plan's participant: the EngineCore is the scheduler side."""
    if pid == client_pid:
        return CLIENT
    if "EngineCore" in title:
        return SCHEDULER
    if "Worker" in title:
        rank = title.rsplit("_TP", 1)[1] if "_TP" in title else "0"
        digits = "".join(c for c in rank if c.isdigit()) or "0"
        return f"{WORKER} {int(digits)}"
    return CLIENT


def stage_of(point: str, participant: str) -> str:
    """The library call a fault point belongs to, in the kvoffload engine's stage names."""
    if point == "validate":
        return "validate"
    if point.startswith("cleanup."):
        return "shutdown"
    return "create_worker" if participant.startswith(WORKER) else "get_manager"


def injected_error(f: Fired, participant: str) -> ErrorInfo:
    """The error the fault ``f`` raised in ``participant``, as an exception there would describe it."""
    errno_value: int | None = None
    if "oserror(" in f.action:
        arg = f.action.split("oserror(", 1)[1].rstrip(")")
        parsed = faults.parse_actions(f"oserror({arg})")[0]
        errno_value = parsed.errno
    kind = "OSError" if errno_value is not None else "InjectedFault"
    message = (
        f"[Errno {errno_value}] {os.strerror(errno_value)} (injected at {f.point})"
        if errno_value is not None
        else f"injected fault at {f.point}"
    )
    return ErrorInfo(
        type=kind,
        message=message,
        participant=participant,
        stage=stage_of(f.point, participant),
        injected=True,
        point=f.point,
        errno=errno_value,
        notes=(f"in {f.title or 'pid ' + str(f.pid)} (pid {f.pid})",),
    )


def no_start_error() -> ErrorInfo:
    """The client exited before the engine came up, without a word on the pipe."""
    return ErrorInfo("EngineDied", "the engine exited before it came up or said why", CLIENT, "engine", False)


def read_journal(path: Path) -> list[Fired]:
    """Every whole line of the fault journal; a torn or foreign line is skipped."""
    fired: list[Fired] = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                d = json.loads(line)
                fired.append(
                    Fired(str(d["point"]), str(d["action"]), int(d["pid"]), str(d["title"]), float(d["t"]))
                )
    return fired


def process_group(pgid: int, proc: Path = Path("/proc")) -> dict[int, str]:
    """Live processes of process group ``pgid``, with their titles (zombies are gone already)."""
    found: dict[int, str] = {}
    for entry in _listdir(proc):
        if not entry.isdigit():
            continue
        try:
            stat = (proc / entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] == "Z" or int(fields[2]) != pgid:
                continue
            title = (proc / entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        found[int(entry)] = title
    return found


def _listdir(path: Path) -> Iterator[str]:
    with contextlib.suppress(OSError):
        yield from os.listdir(path)
