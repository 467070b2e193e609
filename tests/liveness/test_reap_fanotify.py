"""An opener held between its lookup and break_lease never gets a reaped file (fanotify + strace).

An opener that is past its path lookup and its write-count increment but has not reached
break_lease yet (here: parked in FAN_OPEN_PERM, as under fapolicyd or an on-access virus
scanner; on a loaded host: preempted there) is invisible to F_GETLEASE. The reaper is paused
by strace at renameat2 entry, i.e. holding its lease after its first F_GETLEASE check, so
that the opener arrives at exactly that moment; everything else is the unmodified library.
"""

from __future__ import annotations

import os
import platform
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.procs import REPO, region_path, write_file

RENAMEAT2 = {"x86_64": 316, "aarch64": 276}.get(platform.machine())

LISTENER = r"""
import ctypes, os, select, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
fan = libc.fanotify_init(0x04 | 1, os.O_RDONLY)  # FAN_CLASS_CONTENT | FAN_CLOEXEC
assert fan >= 0 and libc.fanotify_mark(fan, 1, 0x00010000, -100, sys.argv[1].encode()) == 0  # FAN_OPEN_PERM
def allow_all():
    data, at = os.read(fan, 4096), 0
    while at < len(data):
        n, _, _, _, _, efd, _ = struct.unpack_from("IBBHQiI", data, at)
        at += n
        os.close(efd)  # before answering: the opener must not find our event fd still open
        os.write(fan, struct.pack("iI", efd, 1))  # FAN_ALLOW
print("ready", flush=True)
reading = True
while True:
    ready = select.select([fan, 0] if reading else [0], [], [])[0]
    if fan in ready:
        allow_all()
    if 0 in ready:
        command = sys.stdin.readline().strip()
        if command == "hold":  # stop reading: a queued event keeps its opener parked, no event fd
            reading = False
            print("holding", flush=True)
            select.select([fan], [], [])
            print("queued", flush=True)
        elif command == "release":
            allow_all()
            print("released", flush=True)
        else:
            break
"""

OPENER = r"""
import json, os, sys
path = sys.argv[1]
sys.stdin.readline()
fd = os.open(path, os.O_RDWR)
st = os.fstat(fd)
try:
    named = os.stat(path).st_ino == st.st_ino
except FileNotFoundError:
    named = False
print(json.dumps({"nlink": st.st_nlink, "named": named}), flush=True)
"""

REAPER = r"""
import json, os, sys
from kvoffload.liveness.reap import ReapFilter, reap
print(os.getpid(), flush=True)
sys.stdin.readline()
report = reap(sys.argv[1], grace_s=0, filters=ReapFilter.exactly(sys.argv[2]))
outcome = {"removed": [e.name for e in report.removed], "kept": [e.reason for e in report.kept]}
print(json.dumps(outcome), flush=True)
"""


def spawn(*argv: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.Popen(
        list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env
    )


def say(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def hear(proc: subprocess.Popen[str], timeout: float = 10) -> str:
    assert proc.stdout is not None
    assert select.select([proc.stdout], [], [], timeout)[0], "no answer"
    return proc.stdout.readline().strip()


def test_reap_never_unlinks_a_file_whose_opener_is_between_its_lookup_and_break_lease(
    root: Path, engine_id: str
) -> None:
    if os.geteuid() != 0 or shutil.which("strace") is None or RENAMEAT2 is None:
        pytest.skip("needs root (fanotify), strace and x86_64/aarch64")
    path = write_file(region_path(root, engine_id))
    listener = spawn(sys.executable, "-c", LISTENER, str(path))
    opener = spawn(sys.executable, "-c", OPENER, str(path))
    reaper = spawn(
        "strace",
        "-f",
        "-qq",
        "-o",
        "/dev/null",
        "-e",
        "trace=renameat2",
        "-e",
        "inject=renameat2:delay_enter=1000000",  # the reaper pauses at renameat2, lease held
        sys.executable,
        "-c",
        REAPER,
        str(root),
        engine_id,
    )
    try:
        assert hear(listener) == "ready"
        pid = int(hear(reaper))
        say(reaper, "go")
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{pid}/syscall").read_text().startswith(f"{RENAMEAT2} "):
            assert time.monotonic() < deadline, "the reaper never reached renameat2"
            time.sleep(0.001)
        say(listener, "hold")
        assert hear(listener) == "holding"
        say(opener, "go")  # it resolves the region name: the rename has not happened yet
        assert hear(listener) == "queued"  # parked in FAN_OPEN_PERM, i_writecount already taken
        outcome = hear(reaper)  # rename, F_GETLEASE (no break yet), unlink, release
        say(listener, "release")
        seen = hear(opener)
    finally:
        for proc in (listener, opener, reaper):
            proc.kill()
            proc.wait(10)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
    print(outcome, seen)
    assert seen == '{"nlink": 1, "named": true}', f"the opener holds an unlinked file; reap said {outcome}"
