"""The processes a scenario watches, read from ``/proc``.

An engine is a tree (the client, ``VLLM::EngineCore``, ``VLLM::Worker``), found by parent pid;
a zombie counts as gone. Killing a tree kills the descendants found now and those recorded
before (maybe orphaned since). Every engine stays in its scenario's process group, so what is
left of that group when a scenario checks is what its engines left running.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Sequence
from pathlib import Path


def children_of(pid: int, proc: Path = Path("/proc")) -> list[int]:
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def process_tree(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children_of(p)
    return tree


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def kill_tree(pid: int, known: Sequence[int] = ()) -> None:
    """SIGKILL ``pid``, its descendants now, and ``known`` (descendants seen before, maybe orphaned)."""
    for p in dict.fromkeys([*process_tree(pid), *known]):
        if alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def others_in_my_group() -> list[int]:
    """Processes of this scenario's group still running, other than this one."""
    me, group = os.getpid(), os.getpgid(0)
    left = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me:
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry.name)) == group and alive(int(entry.name)):
                    left.append(int(entry.name))
    return left
