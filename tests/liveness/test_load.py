"""Load: 1,000 create/attach/detach iterations in several processes while ``shmctl reap --yes``
runs in a loop. Not one live file may be removed; the reaper reports no error.

Each worker process alternates kvoffload regions (a creator plus a joiner attached to it)
and vLLM-style lockless files (created, mapped, checked, then closed cleanly or left behind
like a crash: the reaper's real work). Every file a worker holds is checked at the end of
its hold: its name must still refer to the inode the worker maps, and nobody but the reaper
could have removed it. The reaper is the CLI itself (``shmctl.app.main``) in a loop, in its
own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.liveness.reap import reap
from tests.support.procs import REPO, shm_dir, uninspectable_pids

WORKERS = 4
ITERATIONS = 1000
#: Two reapers, as when a systemd timer and an operator run at once: each must re-prove what the
#: other planned.
REAPERS = 2
#: A safety net, not a measurement: a worker that has not finished by then reports how far it got.
DEADLINE_S = 90.0

_WORKER = r"""
import json, mmap, os, random, sys, time
from pathlib import Path
from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion
root, worker, quota, deadline = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
random.seed(worker)
violations, orphans, done = [], 0, 0
stop = time.monotonic() + deadline
HOLD_S = (0.0, 0.002, 0.01)  # some holds outlast a reap round, some fall inside one

def still_mine(path, ino, what):
    try:
        if os.stat(path).st_ino != ino:
            violations.append(f"{path.name}: replaced while attached ({what})")
    except FileNotFoundError:
        violations.append(f"{path.name}: removed while attached ({what})")

for k in range(quota):
    if time.monotonic() > stop:
        break
    engine_id = f"kvtest-load-{worker}-{k}"
    path = root / f"vllm_offload_{engine_id}.mmap"
    if k % 2 == 0:
        # kvoffload: create, attach a second participant, write through one and read through
        # the other, detach both.
        creator = SharedOffloadRegion(engine_id, 2, None, PAGESIZE, PAGESIZE, root=root)
        joiner = SharedOffloadRegion(engine_id, 2, None, PAGESIZE, PAGESIZE, root=root, populate=False)
        ino = creator.identity[1]
        view = joiner.create_kv_memoryview()
        view[1, 7] = (k % 127) + 1  # int8 rows, as vLLM hands tiers
        mine = creator.create_kv_memoryview()
        if mine[1, 7] != (k % 127) + 1 or joiner.identity != creator.identity:
            violations.append(f"{path.name}: joiner and creator map different memory")
        time.sleep(random.choice(HOLD_S))
        still_mine(path, ino, "kvoffload region")
        joiner.cleanup()
        creator.cleanup()
    else:
        # vLLM 0.33: no lock, no owner record; the kernel's fd and maps are the only evidence.
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, 2 * PAGESIZE)
        mm = mmap.mmap(fd, 2 * PAGESIZE, flags=mmap.MAP_SHARED)
        mm[0] = 1
        ino = os.fstat(fd).st_ino
        time.sleep(random.choice(HOLD_S))
        still_mine(path, ino, "vLLM-style file")
        if k % 4 == 1:
            orphans += 1  # a crash: the file stays behind for the reaper
        else:
            os.unlink(path)  # a clean exit removes the name while it still holds the file
        mm.close()
        os.close(fd)
    done += 1
print(json.dumps({"worker": worker, "iterations": done, "violations": violations, "orphans": orphans}))
"""

_REAPER = r"""
import contextlib, io, json, os, sys
from shmctl.app import main
root, stop = sys.argv[1], sys.argv[2]
rounds, removed, kept, codes, errors = 0, 0, [], {}, []
while not os.path.exists(stop):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = int(main(["reap", "--root", root, "--grace", "0", "--yes", "--json"]))
    rounds += 1
    codes[code] = codes.get(code, 0) + 1
    errors += [line for line in err.getvalue().splitlines() if not line.startswith("shmctl: warning: ")]
    if code == 0:
        report = json.loads(out.getvalue())
        removed += len(report["removed"])
        kept += [[e["name"], e["status"], e["reason"]] for e in report["kept"]]
print(json.dumps({"rounds": rounds, "removed": removed, "kept": kept, "codes": codes, "errors": errors}))
"""


def _spawn(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


@pytest.mark.slow
def test_a_thousand_attach_cycles_under_reaper_loops_lose_no_live_file(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    with shm_dir() as root:
        reapers = [_spawn(_REAPER, str(root), str(stop)) for _ in range(REAPERS)]
        workers = [
            _spawn(_WORKER, str(root), str(w), str(ITERATIONS // WORKERS), str(DEADLINE_S))
            for w in range(WORKERS)
        ]
        try:
            results = [_finish(w, DEADLINE_S + 30) for w in workers]
        finally:
            stop.touch()
            reaper_results = [_finish(r, 60) for r in reapers]
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.communicate()
        reports = []
        for code, out, err in results:
            assert code == 0, err
            reports.append(json.loads(out))
        reaped = []
        for code, out, err in reaper_results:
            assert code == 0, err
            reaped.append(json.loads(out))
        # What the loops left: only crash orphans, which one more reap removes.
        leftover = reap(root, grace_s=0, assume_not_holding=uninspectable_pids())
        assert os.listdir(root) == []

    assert [v for r in reports for v in r["violations"]] == []
    assert sum(r["iterations"] for r in reports) == ITERATIONS, "a worker ran past the safety deadline"
    for r in reaped:
        assert r["rounds"] > 0
        assert r["codes"] == {"0": r["rounds"]}
        assert r["errors"] == []
        assert all(reason for _, _, reason in r["kept"])  # every skip says why
    removed = sum(r["removed"] for r in reaped) + len(leftover.removed)
    assert removed >= sum(r["orphans"] for r in reports)
