"""One vLLM engine: the ``engine`` command that runs ``vllm.LLM``, and a scenario's handle on it.

The command brings the engine up on the tiny model (with the ``kv_transfer_config`` it is
given, if any), generates, resets the prefix cache, generates again and writes what it saw (the
facts: tokens, offloaded bytes, prefix hits) to ``--out``, atomically: the file appearing is the
sign that the engine is up. With ``--hold`` it then waits for its stdin to close. A scenario
starts it as ``python HARNESS engine --hold`` (``Engine``): it closes stdin for a clean exit
(``stop``) and kills the engine's process tree in any case, each start bounded by
``ENGINE_TIMEOUT_S``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .environment import HARNESS
from .model import prompt
from .processes import comm, kill_tree, process_tree

ENGINE_TIMEOUT_S = 240.0
#: Each engine process a ``kill-<role>`` scenario can kill, by its process title (comm).
ROLES = {"client": "client", "enginecore": "VLLM::EngineCor", "worker": "VLLM::Worker"}


def engine_main(args: argparse.Namespace) -> int:
    """Bring up ``vllm.LLM``, generate, reset the prefix cache, generate again; write the facts."""
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    started = time.monotonic()
    kwargs: dict[str, Any] = {}
    if args.kv_config:
        kwargs["kv_transfer_config"] = json.loads(args.kv_config)
    llm = LLM(
        model=str(args.model),
        max_model_len=256,
        enforce_eager=True,
        # On CPU this is the share of host memory vLLM insists on having free; the KV cache
        # itself is sized by kv_cache_memory_bytes.
        gpu_memory_utilization=0.05,
        kv_cache_memory_bytes=32 << 20,
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )
    up_s = time.monotonic() - started
    params = SamplingParams(temperature=0, max_tokens=16)
    first = llm.generate([prompt()], params, use_tqdm=False)[0]
    llm.reset_prefix_cache()
    again = llm.generate([prompt()], params, use_tqdm=False)[0]
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    facts = {
        "up_s": round(up_s, 1),
        "tokens": list(first.outputs[0].token_ids),
        "tokens_after_reset": list(again.outputs[0].token_ids),
        "cached_after_reset": again.num_cached_tokens,
        "store_bytes": metrics.get("vllm:kv_offload_store_bytes") or 0,
        "load_bytes": metrics.get("vllm:kv_offload_load_bytes") or 0,
        "external_hits": metrics.get("vllm:external_prefix_cache_hits") or 0,
    }
    tmp = Path(str(args.out) + ".tmp")
    tmp.write_text(json.dumps(facts))
    tmp.rename(args.out)
    if args.hold:
        sys.stdin.read()  # until the scenario closes our stdin (or kills us)
    return 0


class Engine:
    """One ``python HARNESS engine --hold`` process and its tree, killed on exit.

    It stays in the scenario's process group (no session of its own), so the harness's kill of
    that group reaches every engine process even when the scenario itself is killed.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        name: str,
        config: Mapping[str, Any] | None,
        *,
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``prefix`` runs before the engine (a wrapper that ``exec``s it); ``env`` replaces ours."""
        self.facts_path = Path(args.work) / "scenarios" / f"{name}.engine.json"
        self.facts_path.unlink(missing_ok=True)
        self.log = self.facts_path.with_suffix(".log")
        argv = [*prefix, sys.executable, str(HARNESS), "engine", "--model", str(args.model)]
        argv += ["--out", str(self.facts_path), "--hold"]
        if config is not None:
            argv += ["--kv-config", json.dumps(config)]
        with self.log.open("wb") as sink:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=sink, stderr=subprocess.STDOUT, env=env
            )
        self.tree: list[int] = []

    def wait_ready(self) -> dict[str, Any] | None:
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.facts_path.is_file():
                self.tree = process_tree(self.proc.pid)
                facts: dict[str, Any] = json.loads(self.facts_path.read_text())
                return facts
            time.sleep(0.5)
        return None

    def role(self, role: str) -> int | None:
        if role == "client":
            return self.proc.pid
        return next((p for p in self.tree if comm(p) == ROLES[role]), None)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """Close stdin (a clean exit); kill the session after ``timeout_s``; the exit status."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL the engine's tree: as recorded when it came up, and as it is now."""
        kill_tree(self.proc.pid, self.tree)
        self.proc.wait()

    def tail(self, lines: int = 3) -> str:
        text = self.log.read_text(errors="replace").strip().splitlines() if self.log.is_file() else []
        return " / ".join(text[-lines:])[-300:]


@contextlib.contextmanager
def engine(
    args: argparse.Namespace,
    name: str,
    config: Mapping[str, Any] | None,
    *,
    prefix: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[Engine]:
    e = Engine(args, name, config, prefix=prefix, env=env)
    try:
        yield e
    finally:
        e.kill_all()
