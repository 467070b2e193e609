"""A stand-in for ``kvoffload.vllm_engine.child``: the same protocol, no vLLM, real processes.

    python tests/support/vllm_standin.py --model DIR --kv-config JSON --report-fd N [...]

Like vLLM, it starts an EngineCore and a Worker as processes of its own (titled
``VLLM::EngineCore`` and ``VLLM::Worker`` through ``argv[0]``, which is what ``/proc``
shows); they inherit ``KVOFFLOAD_FAILPOINTS`` and its journal. The Worker passes the worker's
fault points, creates the region file in ``kvoffload_root`` (and removes it at shutdown or
when a fault unwinds), the EngineCore passes ``validate`` and ``manager``. A fault that fires
makes the start fail, as vLLM's does. ``STANDIN_MODE`` bends it:

    hang             never says it is up (the start timeout or Ctrl-C must end it)
    leave-process    a Worker that outlives the client
    leave-file       the Worker forgets to remove the region
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

WORKER_CODE = """
import os, sys
from pathlib import Path
from kvoffload import faults
path = Path(sys.argv[1])
def done(code):
    sys.stdout.flush()
    os._exit(code)
try:
    faults.point("validate")
    faults.point("region.open")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for name in ("region.space", "region.truncate", "region.mmap", "region.attach", "region.populate"):
            faults.point(name)
        os.ftruncate(fd, 1 << 16)
        faults.point("worker")
    except BaseException:
        os.close(fd)
        path.unlink()
        raise
except Exception as e:
    print(f"Worker: {type(e).__name__}: {e}", flush=True)
    done(1)
print("up", flush=True)
sys.stdin.read()
faults.point("cleanup.worker")
faults.point("cleanup.region")
os.close(fd)
if os.environ.get("STANDIN_MODE") != "leave-file":
    path.unlink()
if os.environ.get("STANDIN_MODE") == "leave-process":
    import time
    time.sleep(3600)
done(0)
"""

CORE_CODE = """
import os, sys
from kvoffload import faults
try:
    faults.point("validate")
    faults.point("manager")
except Exception as e:
    print(f"EngineCore: {type(e).__name__}: {e}", flush=True)
    os._exit(1)
print("up", flush=True)
sys.stdin.read()
os._exit(0)
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv-config", required=True)
    parser.add_argument("--report-fd", type=int, required=True)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--no-roundtrip", action="store_true")
    args = parser.parse_args()
    mode = os.environ.get("STANDIN_MODE", "")

    def send(event: str, **fields: object) -> None:
        os.write(args.report_fd, (json.dumps({"event": event, "t": time.time(), **fields}) + "\n").encode())

    started = time.monotonic()
    send("starting", pid=os.getpid())
    if os.environ.get("STANDIN_PIDFILE"):
        Path(os.environ["STANDIN_PIDFILE"]).write_text(str(os.getpid()))
    if mode == "hang":
        time.sleep(3600)
    extra = json.loads(args.kv_config)["kv_connector_extra_config"]
    engine_id = json.loads(args.kv_config)["engine_id"]
    region = Path(extra["kvoffload_root"]) / f"vllm_offload_{engine_id}.mmap"
    procs: list[subprocess.Popen[str]] = []
    children: tuple[tuple[str, str, list[str]], ...] = (
        ("VLLM::Worker", WORKER_CODE, [str(region)]),
        ("VLLM::EngineCore", CORE_CODE, []),
    )
    for title, code, more in children:
        proc = subprocess.Popen(
            [title, "-c", code, *more],
            executable=sys.executable,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "up":
            for p in procs:
                assert p.stdin is not None
                p.stdin.close()
                p.wait()
            proc.wait()
            message = "Engine core initialization failed"
            send("failed", seconds=time.monotonic() - started, type="RuntimeError", message=message)
            return 1
        procs.append(proc)
    send("up", seconds=time.monotonic() - started, version="0.0-standin")
    if not args.no_roundtrip:
        moved = {"store_bytes": 4096, "load_bytes": 4096, "external_hits": 128, "same_tokens": True}
        send("roundtrip", seconds=0.01, **moved)
    sys.stdin.read()
    for p in procs:
        assert p.stdin is not None
        p.stdin.close()
    for p in procs:
        if mode != "leave-process":
            p.wait()
    send("released", seconds=0.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
