"""Does this ``/proc`` show every process on the kernel?

A scanner in a child PID namespace (a sidecar, a DaemonSet without ``hostPID``,
``unshare --pid --mount-proc``) lists only its own namespace: the engines' processes
are not uninspectable there, they are absent, so "no holder found" proves nothing. The
write lease does not care (it counts open file descriptions kernel-wide); without it,
verdicts from such a ``/proc`` are fail-closed.

The initial PID namespace has the fixed inode ``PROC_PID_INIT_INO``. ``/proc/self`` names
the scanner in the namespace of whoever mounted that ``/proc``: if it resolves and its
namespace is the initial one, that ``/proc`` lists every process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvoffload import procfs

#: ``PROC_PID_INIT_INO`` (include/linux/proc_ns.h): the initial PID namespace.
INITIAL_PID_NAMESPACE = "pid:[4026531836]"


@dataclass(frozen=True, slots=True)
class Visibility:
    """``complete``: this ``/proc`` lists every process; ``detail`` says why or why not."""

    complete: bool
    pid_namespace: str | None
    depth: int | None
    detail: str


def visibility(proc_root: Path = procfs.PROC_ROOT) -> Visibility:
    own = procfs.pid_namespace("self", proc_root)
    depth = _nspid_depth(proc_root)
    if own is None:
        return Visibility(
            False, None, depth, f"cannot read {proc_root}/self/ns/pid: its namespace is unknown"
        )
    if own == INITIAL_PID_NAMESPACE:
        return Visibility(True, own, depth, "the initial PID namespace")
    return Visibility(
        False, own, depth, f"a child PID namespace {own}: processes outside it are invisible from here"
    )


def _nspid_depth(proc_root: Path) -> int | None:
    """How many PID namespaces this process is a member of, from ``NSpid`` (None: unknown)."""
    try:
        text = (proc_root / "self" / "status").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("NSpid:"):
            return len(line.split()) - 1
    return None
