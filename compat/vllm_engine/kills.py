"""The ``kill-<role>`` scenarios: SIGKILL of one engine process beside a bystander's live region.

The engine runs the tiering spec with ``kvoffload_lifetime: vllm`` (the path stays for the
engine's life). After the kill the rest of the engine gets ``SETTLE_S`` to exit and is then
killed; ``shmctl scan`` must judge every leftover orphaned and ``shmctl reap --yes`` remove
exactly those, keeping the bystander's region.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from .engine import engine
from .inspection import regions, shmctl
from .kv_config import kv_transfer_config
from .processes import alive, comm
from .results import Row

#: How long the rest of an engine gets to exit after one of its processes was killed.
SETTLE_S = 30.0


@contextlib.contextmanager
def bystander(root: Path = Path("/dev/shm")) -> Iterator[Path]:
    """A process holding a region file of its own, mapped: a live region nothing may remove."""
    path = root / "vllm_offload_vle-bystander.mmap"
    code = (
        "import mmap, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600); "
        "os.ftruncate(fd, 1 << 20); m = mmap.mmap(fd, 1 << 20); print('ready', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        yield path
    finally:
        proc.kill()
        proc.wait()
        path.unlink(missing_ok=True)


def kill(args: argparse.Namespace, name: str, role: str) -> list[Row]:
    engine_id = f"vle-kill-{role}"
    config = kv_transfer_config("tiering", engine_id, kvoffload_lifetime="vllm")
    with bystander() as held, engine(args, name, config) as e:
        facts = e.wait_ready()
        if facts is None:
            return [Row(name, "the engine comes up", f"did not come up: {e.tail()}", False)]
        before = regions()
        victim = e.role(role)
        if victim is None:
            return [Row(name, f"a {role} process", f"none among {[comm(p) for p in e.tree]}", False)]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and any(alive(p) for p in e.tree):
            time.sleep(0.5)
        survivors = [comm(p) for p in e.tree if alive(p)]
        e.kill_all()
        leftovers = [r for r in regions() if r != held.name]
        _, scan, _ = shmctl(sys.executable, "scan", "--json", "--grace", "0s")
        status = {x["name"]: x["status"] for x in (scan or {}).get("entries", [])}
        _, reaped, _ = shmctl(sys.executable, "reap", "--yes", "--json", "--grace", "0s")
        removed = sorted(x["name"] for x in (reaped or {}).get("removed", []))
        after = regions()
    judged = all(status.get(r) == "orphaned" for r in leftovers) and status.get(held.name) == "live"
    exact = removed == sorted(leftovers) and held.name in after and not [r for r in after if r != held.name]
    got = (
        f"before {len(before)} file(s); killed {role}; "
        f"still running after {SETTLE_S:.0f} s: {survivors or 'none'}; "
        f"leftovers {leftovers or 'none'} judged {[status.get(r) for r in leftovers]}; "
        f"removed {removed or 'none'}; "
        f"bystander {status.get(held.name)}, kept {held.name in after}"
    )
    expected = "every leftover orphaned and reaped; the bystander's live region kept"
    return [Row(name, expected, got, judged and exact)]
