"""The engine process of ``shmctl init --engine vllm``: one ``vllm.LLM``, its facts on a pipe.

    python -m kvoffload.vllm_engine.child --model DIR --kv-config JSON --report-fd N
        [--tensor-parallel-size N] [--no-roundtrip]

Protocol, child -> parent: one JSON object a line on fd ``N``, each with ``event`` and ``t``
(``time.time()``):

    {"event": "starting", "pid"}                           before vLLM is imported
    {"event": "up", "seconds", "version"}                  ``vllm.LLM(...)`` returned
    {"event": "failed", "seconds", "type", "message"}      it raised; the process then exits 1
    {"event": "roundtrip", "seconds", "store_bytes", "load_bytes", "external_hits", "same_tokens"}
    {"event": "roundtrip-failed", "seconds", "type", "message"}
    {"event": "released", "seconds"}                       the engine was shut down

Parent -> child: closing the child's stdin means "shut the engine down" (a parent that dies
closes it too, so the engine never outlives its orchestrator up and serving). The round trip
is the one ``make vllm-engine`` checks: a prompt of whole blocks, ``reset_prefix_cache()``,
the same prompt again, which must take its prefix from the region and give the same tokens.

SIGINT is ignored: the parent alone decides how the engine ends. vLLM's own processes (the
EngineCore and its Workers) read ``KVOFFLOAD_FAILPOINTS`` and its journal from the
environment they inherit from this one.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

#: Nine full blocks of 16 tokens with the tiny model's tokenizer (``make vllm-engine``'s prompt).
_SENTENCES = (
    "the quick brown fox jumps over a lazy dog while seven small robots paint blue red green houses",
    "near one old river under bright stars every cat sings quietly to its friend",
)
_WORDS = " ".join(_SENTENCES).split()
PROMPT = " ".join((_WORDS * 8)[:150])


class _Reporter:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, event: str, **fields: Any) -> None:
        data = (json.dumps({"event": event, "t": time.time(), **fields}) + "\n").encode()
        with contextlib.suppress(OSError):
            os.write(self.fd, data)


def _error_fields(error: BaseException) -> dict[str, str]:
    return {
        "type": type(error).__name__,
        "message": str(error).strip().splitlines()[0][:500] if str(error) else "",
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvoffload.vllm_engine.child")
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv-config", required=True)
    parser.add_argument("--report-fd", type=int, required=True)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--no-roundtrip", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    report = _Reporter(args.report_fd)
    report.send("starting", pid=os.getpid())
    started = time.monotonic()
    try:
        import vllm  # type: ignore[import-not-found]

        llm = vllm.LLM(
            model=args.model,
            max_model_len=256,
            enforce_eager=True,
            tensor_parallel_size=args.tensor_parallel_size,
            # On CPU: the share of host memory vLLM insists on having free; the KV cache itself
            # is sized by kv_cache_memory_bytes.
            gpu_memory_utilization=0.05,
            kv_cache_memory_bytes=32 << 20,
            disable_log_stats=False,
            seed=0,
            kv_transfer_config=json.loads(args.kv_config),
        )
    except Exception as e:
        report.send("failed", seconds=time.monotonic() - started, **_error_fields(e))
        return 1
    report.send("up", seconds=time.monotonic() - started, version=str(getattr(vllm, "__version__", "?")))
    if not args.no_roundtrip:
        _roundtrip(llm, report)
    sys.stdin.read()  # until the parent closes it: "shut down"
    stopping = time.monotonic()
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None:
        with contextlib.suppress(Exception):
            engine_core.shutdown()
    del llm
    gc.collect()
    report.send("released", seconds=time.monotonic() - stopping)
    return 0


def _roundtrip(llm: Any, report: _Reporter) -> None:
    from vllm import SamplingParams

    started = time.monotonic()
    try:
        params = SamplingParams(temperature=0, max_tokens=16)
        first = llm.generate([PROMPT], params, use_tqdm=False)[0]
        llm.reset_prefix_cache()
        again = llm.generate([PROMPT], params, use_tqdm=False)[0]
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    except Exception as e:
        report.send("roundtrip-failed", seconds=time.monotonic() - started, **_error_fields(e))
        return
    report.send(
        "roundtrip",
        seconds=time.monotonic() - started,
        store_bytes=int(metrics.get("vllm:kv_offload_store_bytes") or 0),
        load_bytes=int(metrics.get("vllm:kv_offload_load_bytes") or 0),
        external_hits=int(metrics.get("vllm:external_prefix_cache_hits") or 0),
        same_tokens=list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids),
    )


if __name__ == "__main__":
    sys.exit(main())
