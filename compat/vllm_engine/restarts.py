"""The ``restart-*`` scenarios: vLLM #54002's crash loop, from a real engine, and its cures.

Each shrinks its private ``/dev/shm`` to ``TMPFS_MIB`` (one ``REGION_BYTES`` region plus less
than a second one, the issue's 256 MiB on 400 MiB) and runs the tiering spec with
``kvoffload_lifetime: vllm`` (the region's name stays for the engine's life, as vLLM's tiering
spec keeps it). An engine serves, its whole tree is SIGKILLed (an OOM kill, an eviction), and it
is started again in the same ``/dev/shm``, as a container restarting in place:

- ``restart-plain``: started again as it was: it fails as vLLM fails (the error is recorded);
- ``restart-wrapper``: through ``deploy/docker/entrypoint.sh``: it serves, and the wrapper's
  output names what it removed and why;
- ``restart-pinned``: the same ``engine_id`` on both starts (vLLM #51317), through the wrapper:
  the new engine creates its region again (a new inode), it joins no stale file;
- ``restart-partly-dead``: only the client killed, EngineCore and Worker alive and holding the
  region: the wrapper removes nothing and says so, the new start fails with vLLM's error (no
  traceback of ours), ``shmctl scan`` names the live holders; then the survivors are killed;
- ``restart-agent``: ``shmctl watch --reap`` running as the DaemonSet runs it (a short interval
  and grace here) frees the region; then a plain restart serves. Kill-to-freed is recorded;
- ``restart-cycles``: ``CYCLES`` kill-restart cycles through the wrapper with
  ``SHMCTL_FAMILIES="psm sem"``: each serves, and the files and bytes in ``/dev/shm`` after each
  cycle do not grow;
- ``restart-plugin``: a plain restart with ``SHMCTL_VLLM_REAP=1``: the ``shmctl_reap`` plugin
  (``vllm.general_plugins``) removes the dead region before the engine creates one; it serves.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .engine import Engine, engine
from .environment import REPO
from .inspection import regions, shmctl
from .kv_config import kv_transfer_config
from .processes import alive, comm
from .results import Row

SHM = Path("/dev/shm")
TMPFS_MIB = 400
REGION_BYTES = 256 << 20
WRAPPER = REPO / "deploy" / "docker" / "entrypoint.sh"
CYCLES = 10
#: The agent's passes here: the DaemonSet's flags, with an interval and grace short enough to watch.
AGENT_ARGS = ("watch", "--root", str(SHM), "--all-users", "--reap", "--interval", "2s", "--grace", "5s")
AGENT_LIMIT_S = 120.0
#: How long after the client's kill its survivors are named.
SETTLE_S = 5.0
RESTARTS = ("plain", "wrapper", "pinned", "partly-dead", "agent", "cycles", "plugin")
#: The lines of a failing start worth recording: vLLM's error, and any traceback of ours.
ERROR = re.compile(r"(RuntimeError|Error): .*")


def restart_names() -> list[str]:
    return [f"restart-{r}" for r in RESTARTS]


def shrink_shm(mib: int = TMPFS_MIB) -> None:
    """This scenario's private tmpfs, resized: the root holds one region and less than a second."""
    subprocess.run(["mount", "-o", f"remount,size={mib}m", str(SHM)], check=True)


def config(engine_id: str) -> dict[str, Any]:
    return kv_transfer_config("tiering", engine_id, kvoffload_lifetime="vllm", cpu_bytes_to_use=REGION_BYTES)


def engine_env(**more: str) -> dict[str, str]:
    """The scenario's environment with the venv's ``bin`` (its ``shmctl``) first on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "SHMCTL_ROOT": str(SHM), **more}


def wrapped(grace: str = "0s") -> tuple[Sequence[str], Mapping[str, str]]:
    return ("sh", str(WRAPPER)), engine_env(SHMCTL_GRACE=grace)


def usage() -> str:
    """Files and bytes (resident, as ``du``) in /dev/shm, and what is there besides regions."""
    files = [p for p in SHM.iterdir() if p.is_file()]
    used = sum(p.stat().st_blocks * 512 for p in files)
    others = sorted({family(p.name) for p in files if not p.name.startswith("vllm_offload_")})
    return f"{len(files)} files, {used >> 20} MiB ({', '.join(others) or 'regions only'})"


def family(name: str) -> str:
    """What a file of a dead engine is, by its name's prefix (vLLM's message queues, semaphores)."""
    return next((f"{p}*" for p in ("psm_", "sem.mp-", "nccl-", "torch_") if name.startswith(p)), name)


def counts() -> tuple[int, int]:
    files = [p for p in SHM.iterdir() if p.is_file()]
    return len(files), sum(p.stat().st_blocks * 512 for p in files)


def start_serve(e: Engine) -> tuple[dict[str, Any] | None, float]:
    started = time.monotonic()
    facts = e.wait_ready()
    return facts, time.monotonic() - started


def first_error(e: Engine) -> str:
    """vLLM's error of a failed start (its last ``...Error: ...`` line); a traceback of ours is named."""
    text = e.log.read_text(errors="replace") if e.log.is_file() else ""
    errors = [m.group(0) for m in ERROR.finditer(text)]
    ours = any(f'File "{REPO / package}' in text for package in ("kvoffload", "shmctl"))
    found = next((x for x in errors if "Insufficient space" in x), errors[-1] if errors else "no error line")
    return found[:240] + (" [a traceback through kvoffload]" if ours else "")


#: How reap's lines begin (rows, totals, warnings): the wrapper's say, before the engine's first line.
REAP_LINES = ("removed", "kept", "nothing to reap", "shmctl:", "RESULT")


def wrapper_said(e: Engine) -> list[str]:
    """The wrapper's lines (reap's), before the engine's first: what it removed or kept, and why."""
    text = e.log.read_text(errors="replace").splitlines() if e.log.is_file() else []
    said = []
    for line in text:
        if not line.startswith(REAP_LINES):
            break
        if not line.startswith("RESULT"):
            said.append(" ".join(line.split()))
    return said


def kill_whole(e: Engine, timeout_s: float = 30.0) -> None:
    """SIGKILL every process of the engine, and wait until each has exited, as a container runtime
    does before it restarts the container: a process SIGKILLed but not yet exited still maps the
    region, and a wrapper run then would rightly keep it as live."""
    e.kill_all()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in e.tree):
        time.sleep(0.1)


def serve_then_kill(args: argparse.Namespace, name: str, engine_id: str) -> tuple[dict[str, Any] | None, str]:
    """An engine that serves, then SIGKILL of its whole tree: its facts, and the region it left."""
    region = f"vllm_offload_{engine_id}.mmap"
    with engine(args, f"{name}-0", config(engine_id), env=engine_env()) as e:
        facts = e.wait_ready()
        kill_whole(e)
    return facts, region


def restart(args: argparse.Namespace, name: str, kind: str) -> list[Row]:
    import kvoffload

    print(f"{name}: kvoffload from {kvoffload.__file__}", flush=True)  # this checkout's, not the venv's
    shrink_shm()
    if kind == "partly-dead":
        return partly_dead(args, name)
    if kind == "cycles":
        return cycles(args, name)
    first_id = "vle-restart-pinned" if kind == "pinned" else "vle-restart-0"
    facts, left = serve_then_kill(args, name, first_id)
    if facts is None:
        return [Row(name, "the first engine serves", "it did not come up (see its log)", False)]
    before = f"killed a serving engine; left {'its region' if left in regions() else 'no region'}, {usage()}"
    again_id = first_id if kind == "pinned" else "vle-restart-1"
    if kind == "plain":
        with engine(args, f"{name}-1", config(again_id), env=engine_env()) as e:
            facts, took = start_serve(e)
            error = first_error(e) if facts is None else ""
        got = f"{before}; restart: {'served' if facts else 'failed'} after {took:.0f} s: {error}"
        return [
            Row(name, "the restart fails as vLLM fails (no room beside the dead region)", got, facts is None)
        ]
    if kind == "agent":
        return agent(args, name, again_id, before)
    prefix: Sequence[str] = ()
    env: Mapping[str, str] = engine_env()
    if kind in ("wrapper", "pinned"):
        prefix, env = wrapped()
    elif kind == "plugin":
        env = engine_env(SHMCTL_VLLM_REAP="1", SHMCTL_GRACE="0s")
    inode_before = (SHM / left).stat().st_ino if (SHM / left).exists() else None
    with engine(args, f"{name}-1", config(again_id), prefix=prefix, env=env) as e:
        facts, took = start_serve(e)
        new = SHM / f"vllm_offload_{again_id}.mmap"
        inode_after = new.stat().st_ino if new.exists() else None
        said = wrapper_said(e)
        error = first_error(e) if facts is None else ""
        e.stop()
    served = facts is not None
    got = (
        f"{before}; restart served in {took:.0f} s (to first output)"
        if served
        else f"{before}; restart failed: {error}"
    )
    if kind in ("wrapper", "pinned"):
        named = any(first_id in line and "write lease granted" in line for line in said)
        got += f"; the wrapper said: {said}"
        if kind == "pinned":
            fresh = inode_after is not None and inode_after != inode_before
            got += f"; region inode {inode_before} -> {inode_after}"
            return [
                Row(
                    name,
                    "pinned id: the wrapper removes the stale file, the new creator wins, serves",
                    got,
                    served and named and fresh,
                )
            ]
        return [
            Row(name, "serves; the wrapper names the dead region it removed and why", got, served and named)
        ]
    if kind == "plugin":
        plugin = [
            line for line in e.log.read_text(errors="replace").splitlines() if "shmctl" in line.lower()
        ][:4]
        got += f"; plugin log: {plugin or 'none'}"
        if not plugin_declared():
            got += (
                " [pyproject.toml declares no vllm.general_plugins entry point shmctl_reap: no plugin here]"
            )
        return [Row(name, "the shmctl_reap plugin removes the dead region; serves", got, served)]
    raise SystemExit(f"unknown restart {kind}")


def agent(args: argparse.Namespace, name: str, again_id: str, before: str) -> list[Row]:
    """``watch --reap`` over the root frees the dead region; then a plain restart serves."""
    killed = time.monotonic()
    log = Path(args.work) / "scenarios" / f"{name}.watch.log"
    with log.open("wb") as sink:
        watch = subprocess.Popen(
            [sys.executable, "-m", "shmctl", *AGENT_ARGS],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=engine_env(),
        )
    try:
        while regions() and time.monotonic() - killed < AGENT_LIMIT_S:
            time.sleep(0.2)
        freed_s = time.monotonic() - killed
        freed = not regions()
    finally:
        watch.terminate()
        watch.wait(30)
    got = f"{before}; `shmctl {' '.join(AGENT_ARGS)}`: "
    got += (
        f"region freed {freed_s:.1f} s after the kill"
        if freed
        else f"region still there after {AGENT_LIMIT_S:.0f} s"
    )
    with engine(args, f"{name}-1", config(again_id), env=engine_env()) as e:
        facts, took = start_serve(e)
        error = first_error(e) if facts is None else ""
        e.stop()
    got += f"; plain restart served in {took:.0f} s" if facts else f"; plain restart failed: {error}"
    return [
        Row(
            name,
            "the agent frees the region within its passes; a plain restart serves",
            got,
            freed and facts is not None,
        )
    ]


def partly_dead(args: argparse.Namespace, name: str) -> list[Row]:
    """Client killed, EngineCore and Worker alive: nothing is removed, the failure is vLLM's."""
    with engine(args, f"{name}-0", config("vle-restart-0"), env=engine_env()) as old:
        if old.wait_ready() is None:
            return [Row(name, "the first engine serves", "it did not come up (see its log)", False)]
        os.kill(old.proc.pid, 9)
        old.proc.wait()
        time.sleep(SETTLE_S)  # the rest of the engine outlives its client (kill-client shows it)
        survivors = {p: comm(p) for p in old.tree if alive(p)}
        prefix, env = wrapped()
        with engine(args, f"{name}-1", config("vle-restart-1"), prefix=prefix, env=env) as e:
            facts, took = start_serve(e)
            said = wrapper_said(e)
            error = first_error(e) if facts is None else ""
        _, scan, _ = shmctl(sys.executable, "scan", "--json", "--grace", "0s")
        kept = "vllm_offload_vle-restart-0.mmap" in regions()
        holders = sorted(
            {
                f"{h['name']} ({h['pid']})"
                for x in (scan or {}).get("entries", [])
                if x["name"] == "vllm_offload_vle-restart-0.mmap"
                for h in x["holders"]
            }
        )
        old.kill_all()
    ours = "traceback through kvoffload" in error
    got = (
        f"killed the client; alive: {sorted(survivors.values()) or 'none'}; the wrapper said: {said}; "
        f"restart {'served' if facts else 'failed'} ({took:.0f} s): {error}; "
        f"region kept {kept}; scan's holders {holders}"
    )
    # Before "; live: ": what the wrapper removed; after it, the live region it kept, named.
    removed = [line.split("; live: ")[0] for line in said if line.startswith("removed")]
    named = any("; live: vle-restart-0: held by " in line for line in said)
    ok = (
        bool(survivors)
        and kept
        and not any("vle-restart-0" in line for line in removed)
        and named
        and not ours
        and bool(holders)
    )
    return [
        Row(
            name,
            "live engine: the wrapper removes nothing and names the live holders; the failure is "
            "vLLM's; scan names them too",
            got,
            ok,
        )
    ]


def plugin_declared() -> bool:
    """Whether this checkout declares the plugin vLLM would load (``entry_points_path`` exposes it)."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return "shmctl_reap" in project.get("entry-points", {}).get("vllm.general_plugins", {})


def families_landed() -> bool:
    done = subprocess.run(
        [sys.executable, "-m", "shmctl", "reap", "--help"],
        capture_output=True,
        text=True,
        check=False,
        env=engine_env(),
    )
    return "--family" in done.stdout


def cycles(args: argparse.Namespace, name: str) -> list[Row]:
    """``CYCLES`` kill-restart cycles through the wrapper: each serves; nothing accumulates."""
    prefix, env = wrapped()
    env = {**env, "SHMCTL_FAMILIES": "psm sem"}
    landed = families_landed()
    seen: list[tuple[int, int]] = []
    notes: list[str] = []
    served = 0
    for n in range(CYCLES + 1):
        with engine(args, f"{name}-{n}", config(f"vle-cycle-{n}"), prefix=prefix, env=env) as e:
            facts, took = start_serve(e)
            if facts is None:
                notes.append(f"cycle {n}: failed: {first_error(e)}")
                break
            served += 1
            kill_whole(e)
        seen.append(counts())
        notes.append(f"cycle {n}: served in {took:.0f} s, after the kill {usage()}")
    files = [f for f, _ in seen]
    # The region of the engine just killed is always there (the next start's wrapper removes it):
    # nothing accumulates when every count after the first cycle equals the first's.
    steady = len(set(files[1:])) <= 1 and len(seen) == CYCLES + 1
    regions_steady = all(f >= 1 for f in files) and regions() == [f"vllm_offload_vle-cycle-{CYCLES}.mmap"]
    note = (
        ""
        if landed
        else " [families part not in this checkout: psm/sem accumulation reported, judged after merge]"
    )
    (Path(args.work) / "scenarios" / f"{name}.cycles.txt").write_text("\n".join(notes) + "\n")
    got = f"{served}/{CYCLES + 1} starts served; files after each kill {files}; last: {notes[-1]}{note}"
    passed = served == CYCLES + 1 and regions_steady and (steady or not landed)
    return [
        Row(
            name,
            f"{CYCLES} kill-restart cycles through the wrapper: each serves; nothing accumulates",
            got,
            passed,
        )
    ]
