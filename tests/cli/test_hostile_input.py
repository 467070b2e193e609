"""Hostile input from outside the arguments: signals.

A real ``shmctl`` gets a real signal. Ctrl-C prints one line and exits 130 wherever it lands;
``audit`` passes SIGINT, SIGTERM and SIGHUP on to the command it runs, waits for it, still
writes its report and JUnit file, and exits 128 + the signal's number, leaving nothing running.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvoffload.liveness.audit import FORWARDED_SIGNALS, audit
from tests.support.procs import REPO
from tests.support.schemas import validate

#: Records its pid, then waits; a forwarded signal is written down before it exits 7.
TRAPPING_COMMAND = r"""
trap 'echo INT > "$1.got"; exit 7' INT
trap 'echo TERM > "$1.got"; exit 7' TERM
trap 'echo HUP > "$1.got"; exit 7' HUP
echo $$ > "$1.tmp" && mv "$1.tmp" "$1.pid"
while :; do sleep 0.05; done
"""


@contextmanager
def _shmctl(*args: str) -> Iterator[subprocess.Popen[str]]:
    """``python -m shmctl ARGS`` off a terminal, pipes for output; killed if a test fails first."""
    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("SHMCTL_ROOT", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "shmctl", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    with process:
        try:
            yield process
        finally:
            if process.poll() is None:
                process.kill()


def _wait_for(what: str, ready: Callable[[], bool], process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            _, err = process.communicate()
            pytest.fail(f"never {what} (exit {process.returncode}): {err}")
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextmanager
def _trapping_command(tmp_path: Path) -> Iterator[tuple[list[str], Path]]:
    """The command and the path prefix of its files; whatever it left running is killed."""
    base = tmp_path / "command"
    try:
        yield ["sh", "-c", TRAPPING_COMMAND, "sh", str(base)], base
    finally:
        pid_file = base.with_suffix(".pid")
        if pid_file.exists() and _alive(pid := int(pid_file.read_text())):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.system_wide  # an audit of the /dev/shm tmpfs: another test's regions would be leaks
@pytest.mark.parametrize("signum", FORWARDED_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_to_audit_is_passed_on_and_the_report_still_comes(
    signum: signal.Signals, root: Path, tmp_path: Path
) -> None:
    name = signal.Signals(signum).name
    report, junit = tmp_path / "audit.json", tmp_path / "audit.xml"
    with _trapping_command(tmp_path) as (command, base):
        pid_file = base.with_suffix(".pid")
        # --settle 30s: a stopped audit reports at once instead of waiting it out.
        argv = [
            "audit",
            "--root",
            str(root),
            "--report",
            str(report),
            "--junit",
            str(junit),
            "--settle",
            "30s",
        ]
        with _shmctl(*argv, "--", *command) as shmctl:
            _wait_for("started the command", pid_file.exists, shmctl)
            pid = int(pid_file.read_text())
            shmctl.send_signal(signum)
            out, err = shmctl.communicate(timeout=20)
        assert "Traceback" not in err, err
        assert shmctl.returncode == 128 + signum, err
        assert out == ""
        summary, error = err.splitlines()
        assert summary.startswith(f"shmctl: audit: interrupted: {name} stopped the audit and was passed on; ")
        assert summary.endswith(f"; exit {128 + signum}")
        assert error == f"shmctl: error: interrupted by {name}: the command got it too and has exited"
        doc = json.loads(report.read_text())
        validate(doc, "audit")
        assert doc["interrupted_by"] == name
        assert doc["command_exit_code"] == 7
        assert (doc["exit_status"], doc["exit_reason"]) == (128 + signum, "interrupted")
        suite = ET.parse(junit).getroot()
        assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("2", "0", "1")
        assert base.with_suffix(".got").read_text() == f"{name.removeprefix('SIG')}\n"
        assert not _alive(pid)
    assert os.listdir(root) == []


def test_ctrl_c_in_the_middle_of_a_command_is_one_line_and_exit_130(root: Path) -> None:
    # Enough rows to fill the stdout pipe, which nobody reads: scan blocks in write() inside
    # the command, where typer used to turn the KeyboardInterrupt into a silent exit 130.
    for i in range(1500):
        (root / f"vllm_offload_kvtest-{i:05d}-{'x' * 40}.mmap").touch()
    with _shmctl("scan", "--root", str(root), "--grace", "0s", "--limit", "0") as shmctl:
        seen: list[int] = []

        def stuck_on_a_full_stdout() -> bool:
            # Pages are not packed full, so "full" is: past half the pipe and no longer growing.
            assert shmctl.stdout is not None
            fd = shmctl.stdout.fileno()
            seen.append(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0])
            half = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) // 2
            return len(seen) >= 10 and seen[-1] >= half and len(set(seen[-10:])) == 1

        _wait_for("filled its stdout", stuck_on_a_full_stdout, shmctl)
        shmctl.send_signal(signal.SIGINT)
        _, err = shmctl.communicate(timeout=20)
    assert (shmctl.returncode, err) == (130, "shmctl: error: interrupted\n")


def test_audit_puts_the_signal_handlers_back(root: Path) -> None:
    before = {s: signal.getsignal(s) for s in FORWARDED_SIGNALS}
    report = audit(["true"], root)
    assert report.interrupted_by is None
    assert {s: signal.getsignal(s) for s in FORWARDED_SIGNALS} == before


def test_audit_from_another_thread_runs_the_command_without_forwarding(root: Path) -> None:
    reports = []
    worker = threading.Thread(target=lambda: reports.append(audit(["sh", "-c", "exit 4"], root)))
    worker.start()
    worker.join(30)
    assert [r.command_exit_code for r in reports] == [4]
    assert reports[0].interrupted_by is None


def test_a_signal_ignored_before_the_audit_stays_ignored_for_the_command(
    root: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # `nohup shmctl audit -- CMD`: CMD must stay immune to the hangup, not be handed it.
    check = "import signal; print(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN)"
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        audit([sys.executable, "-c", check], root)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert capfd.readouterr().out == "True\n"
