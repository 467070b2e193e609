"""shmctl audit: a CI step that fails when a command leaves shared memory behind.

The command's stdout and stderr are its own; the report goes to ``--report`` (JSON, checked
against ``shmctl/schemas/audit.schema.json``) and ``--junit`` (JUnit XML), the summary to
stderr. Every run here is a real ``python -m shmctl`` running a real command that makes real
files, in a private directory of /dev/shm (the ``root`` fixture) unless it says otherwise.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvoffload.liveness.audit import ExitReason, audit
from tests.support.hostile import shmctl as run_shmctl
from tests.support.procs import REPO
from tests.support.schemas import schema, validate

SHM = Path("/dev/shm")
#: An audit counts every deleted region newly mapped on the root's filesystem, by any process:
#: on the shared /dev/shm tmpfs, a region another test maps meanwhile would be this one's leak.
pytestmark = pytest.mark.system_wide

MAKE_REGION = """
import os, sys
fd = os.open(os.fsencode(sys.argv[1]), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 1 << 20)
os.pwrite(fd, b"x", 0)
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
"""

# Maps a region, unlinks it, then lingers in the background (a daemon the command left).
LINGER = """
import mmap, os, sys, time
path = sys.argv[1]
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 1 << 20)
mm = mmap.mmap(fd, 1 << 20)
mm[0] = 1
os.unlink(path)
if os.fork():
    os._exit(0)
# Off the audit's pipes, so that whoever reads them sees the end when the audit exits.
null = os.open(os.devnull, os.O_RDWR)
for stdio in (0, 1, 2):
    os.dup2(null, stdio)
time.sleep(float(sys.argv[2]))
"""

# Leaves a daemon holding a kvoffload region (owner record, lock, mapping); the command
# itself exits 0 once the daemon has written its pid.
DAEMON = """
import os, sys, time
from pathlib import Path
path, pid_file = Path(sys.argv[1]), Path(sys.argv[2])
if os.fork() == 0:
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for stdio in (0, 1, 2):
        os.dup2(null, stdio)
    from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion
    engine_id = path.name[len("vllm_offload_"):-len(".mmap")]
    region = SharedOffloadRegion(engine_id, 4, None, 2 * PAGESIZE, PAGESIZE, root=path.parent)
    (pid_file.parent / "tmp.pid").write_text(str(os.getpid()))
    (pid_file.parent / "tmp.pid").rename(pid_file)
    time.sleep(60)
    os._exit(0)
while not pid_file.exists():
    time.sleep(0.01)
"""


def shmctl(*args: str) -> subprocess.CompletedProcess[str]:
    return run_shmctl(*args, env={"SHMCTL_ROOT": None, "NO_COLOR": "1"})


def make_region(path: Path | bytes, exit_code: int = 0) -> list[str]:
    """The command that creates a 1 MiB region file at ``path`` (one page written) and exits."""
    return [sys.executable, "-c", MAKE_REGION, os.fsdecode(path), str(exit_code)]


def region(root: Path, engine_id: str) -> Path:
    return root / f"vllm_offload_{engine_id}.mmap"


def read_report(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text(errors="surrogateescape"))
    validate(doc, "audit")
    return doc


def read_junit(path: Path) -> ET.Element:
    suite = ET.parse(path).getroot()
    assert suite.tag == "testsuite"
    assert suite.get("name") == "shmctl audit"
    cases = suite.findall("testcase")
    assert suite.get("tests") == str(len(cases))
    assert suite.get("failures") == str(sum(c.find("failure") is not None for c in cases))
    assert suite.get("errors") == str(sum(c.find("error") is not None for c in cases))
    return suite


def outcomes(suite: ET.Element) -> list[tuple[str | None, str | None, str | None]]:
    """``(classname, name, failure or error type or None)`` for each testcase, in order."""
    found = []
    for case in suite.findall("testcase"):
        outcome = case.find("failure")
        if outcome is None:
            outcome = case.find("error")
        found.append(
            (case.get("classname"), case.get("name"), None if outcome is None else outcome.get("type"))
        )
    return found


@contextmanager
def killed_after(pid_file: Path) -> Iterator[None]:
    """Whatever process wrote ``pid_file`` is SIGKILLed when the block ends."""
    try:
        yield
    finally:
        if pid_file.exists():
            with suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


# --- the library -----------------------------------------------------------------------


def test_audit_reports_a_region_the_command_left(engine_id: str) -> None:
    path = SHM / f"vllm_offload_{engine_id}.mmap"
    try:
        report = audit(make_region(path), SHM)
        assert not report.clean
        assert [e.path for e in report.leaked] == [path]
        assert report.leaked_resident_bytes >= 4096
        assert report.command_exit_code == 0
        assert (report.exit_status, report.exit_reason) == (1, ExitReason.LEAKED)
    finally:
        path.unlink(missing_ok=True)


def test_audit_ignores_files_that_were_there_before(engine_id: str) -> None:
    path = SHM / f"vllm_offload_{engine_id}.mmap"
    subprocess.run(make_region(path), check=True)
    try:
        report = audit(["true"], SHM)
        assert report.clean
        assert report.preexisting >= 1
        assert (report.exit_status, report.exit_reason) == (0, ExitReason.CLEAN)
    finally:
        path.unlink()


def test_audit_catches_a_deleted_region_still_mapped_by_a_leftover_process(engine_id: str) -> None:
    path = SHM / f"vllm_offload_{engine_id}.mmap"
    report = audit([sys.executable, "-c", LINGER, str(path), "5"], SHM)
    lingering = [d for d in report.leaked_deleted if d.engine_id == engine_id]
    try:
        assert lingering, report
        assert lingering[0].mapped_bytes == 1 << 20
        assert not report.clean
    finally:
        for d in lingering:
            os.kill(d.pid, 9)


@pytest.mark.parametrize(
    ("command", "status", "reason", "code", "killed_by"),
    [
        (["true"], 0, ExitReason.CLEAN, 0, None),
        (["sh", "-c", "exit 5"], 5, ExitReason.COMMAND_FAILED, 5, None),
        (["sh", "-c", "exit 1"], 1, ExitReason.COMMAND_FAILED, 1, None),
        (["sh", "-c", "kill -TERM $$"], 143, ExitReason.COMMAND_KILLED, None, "SIGTERM"),
        (["sh", "-c", "kill -USR1 $$"], 128 + signal.SIGUSR1, ExitReason.COMMAND_KILLED, None, "SIGUSR1"),
    ],
    ids=["exit-0", "exit-5", "exit-1", "SIGTERM", "SIGUSR1"],
)
def test_the_exit_status_is_the_commands_own_when_it_did_not_succeed(
    command: list[str], status: int, reason: ExitReason, code: int | None, killed_by: str | None, root: Path
) -> None:
    report = audit(command, root)
    assert (report.exit_status, report.exit_reason) == (status, reason)
    assert (report.command_exit_code, report.command_signal) == (code, killed_by)


# --- streams and the report ------------------------------------------------------------


def test_the_commands_output_passes_through_untouched_and_the_report_never_joins_it(
    root: Path, tmp_path: Path
) -> None:
    report = tmp_path / "audit.json"
    command = "echo hello; echo err >&2; exit 5"
    done = shmctl("audit", "--root", str(root), "--report", str(report), "--", "sh", "-c", command)
    assert done.stdout == "hello\n"
    assert done.stderr.startswith("err\nshmctl: audit: command-failed: "), done.stderr
    assert done.stderr.count("\n") == 2  # the command's line and the summary's one
    assert done.returncode == 5
    doc = read_report(report)
    assert doc["command"] == ["sh", "-c", command]
    assert (doc["command_exit_code"], doc["command_signal"]) == (5, None)
    assert (doc["exit_status"], doc["exit_reason"], doc["clean"]) == (5, "command-failed", True)


def test_json_is_refused_with_a_pointer_to_report_and_nothing_runs(root: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    done = shmctl("audit", "--root", str(root), "--json", "--", "touch", str(marker))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("shmctl: error: --json: ")
    assert done.stderr.count("\n") == 1
    assert "fix: write it to a file with --report FILE" in done.stderr
    assert not marker.exists()


def _bad_output_path(kind: str, tmp_path: Path) -> tuple[str, str]:
    """A ``--report``/``--junit`` value that cannot be written, and the text naming why."""
    if kind == "stdout":
        return "-", "'-' (stdout) is the command's own output"
    if kind == "missing-directory":
        return str(tmp_path / "no-such-dir" / "out"), f"{tmp_path / 'no-such-dir'} is not a directory"
    if kind == "a-directory":
        return str(tmp_path), f"{tmp_path} is a directory"
    if kind == "pseudo-filesystem":  # /proc answers a new file with ENOENT, even to root
        return "/proc/kvtest-audit-report", "cannot create files in /proc"
    # sysfs takes no new file from anyone, root included: an unwritable directory anywhere.
    return "/sys/kvtest-audit-report", "cannot create files in /sys"


@pytest.mark.parametrize("option", ["--report", "--junit"])
@pytest.mark.parametrize(
    "kind", ["stdout", "missing-directory", "a-directory", "unwritable-directory", "pseudo-filesystem"]
)
def test_an_output_that_cannot_be_written_is_refused_before_the_command_runs(
    option: str, kind: str, root: Path, tmp_path: Path
) -> None:
    value, why = _bad_output_path(kind, tmp_path)
    marker = root / "ran"
    before = sorted(os.listdir(tmp_path))
    done = shmctl("audit", "--root", str(root), option, value, "--", "touch", str(marker))
    # '-' is a usage error; a path the system refuses is exit 3, as an unreadable --root (#32)
    assert (done.returncode, done.stdout) == (2 if kind == "stdout" else 3, ""), done.stderr
    assert done.stderr.startswith(f"shmctl: error: {option}: {why}"), done.stderr
    assert done.stderr.count("\n") == 1
    assert "fix: " in done.stderr
    if kind in ("unwritable-directory", "pseudo-filesystem"):
        assert "a pseudo-filesystem that takes no files" in done.stderr
        assert "free space" not in done.stderr
    assert os.listdir(root) == []
    assert sorted(os.listdir(tmp_path)) == before


def test_report_and_junit_on_one_file_are_refused(root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = shmctl("audit", "--root", str(root), "--report", str(out), "--junit", str(out), "--", "true")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("shmctl: error: --junit: ")
    assert not out.exists()


def test_a_clean_run_is_one_line_a_valid_report_and_a_passing_junit_suite(root: Path, tmp_path: Path) -> None:
    report, junit = tmp_path / "audit.json", tmp_path / "audit.xml"
    done = shmctl("audit", "--root", str(root), "--report", str(report), "--junit", str(junit), "--", "true")
    assert (done.returncode, done.stdout) == (0, "")
    line = (
        rf"shmctl: audit: clean: `true` exited 0, left nothing in {re.escape(str(root))} \([0-9.]+s\); exit 0"
    )
    assert re.fullmatch(line + "\n", done.stderr), done.stderr
    doc = read_report(report)
    assert (doc["schema_version"], doc["exit_status"], doc["exit_reason"]) == (2, 0, "clean")
    assert (doc["leaked"], doc["leaked_deleted"], doc["reap_commands"]) == ([], [], [])
    assert doc["command_start_error"] is None
    suite = read_junit(junit)
    assert outcomes(suite) == [
        ("shmctl.audit.command", "true", None),
        (f"shmctl.audit.{root}", "left nothing", None),
    ]


def test_a_leak_exits_1_with_one_line_per_file_and_a_reap_command_that_removes_it(
    engine_id: str, root: Path, tmp_path: Path
) -> None:
    report, junit = tmp_path / "audit.json", tmp_path / "audit.xml"
    path = region(root, engine_id)
    done = shmctl(
        "audit", "--root", str(root), "--report", str(report), "--junit", str(junit), "--", *make_region(path)
    )
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("shmctl: audit: leaked: ")
    assert "left 1 region file and 0 mapped-but-deleted regions" in lines[0]
    assert lines[1] == (
        f"shmctl: audit:   {path.name}: 1048576 bytes (4096 resident), engine {engine_id}, orphaned, "
        "holders: none"
    )
    reap = f"shmctl reap --root {root} --engine {engine_id} --grace 0 --yes"
    assert lines[2:] == [f"shmctl: audit: remove orphans with: {reap}"]

    doc = read_report(report)
    assert (doc["exit_status"], doc["exit_reason"], doc["clean"]) == (1, "leaked", False)
    assert [(e["path"], e["size_bytes"], e["status"]) for e in doc["leaked"]] == [
        (str(path), 1 << 20, "orphaned")
    ]
    assert doc["leaked_resident_bytes"] == 4096
    assert doc["reap_commands"] == [reap]

    suite = read_junit(junit)
    assert outcomes(suite) == [
        ("shmctl.audit.command", shlex.join(make_region(path)).replace("\n", "\\n"), None),
        (f"shmctl.audit.{root}", path.name, "leak"),
    ]
    failure = suite.findall("testcase")[1].find("failure")
    assert failure is not None
    assert failure.get("message") == "left 1048576 bytes (4096 resident), orphaned"
    assert f"engine: {engine_id}" in (failure.text or "")

    # The reap command the report gives does what it says.
    reaped = run_shmctl(*shlex.split(reap)[1:])
    assert reaped.returncode == 0, reaped.stderr
    assert not path.exists()


def test_a_failing_command_that_leaks_exits_with_its_own_code_and_the_report_records_both(
    engine_id: str, root: Path, tmp_path: Path
) -> None:
    report, junit = tmp_path / "audit.json", tmp_path / "audit.xml"
    path = region(root, engine_id)
    done = shmctl(
        "audit",
        "--root",
        str(root),
        "--report",
        str(report),
        "--junit",
        str(junit),
        "--",
        *make_region(path, 5),
    )
    assert (done.returncode, done.stdout) == (5, ""), done.stderr
    assert done.stderr.startswith("shmctl: audit: command-failed: ")
    assert "; exit 5 (the command's own status outranks the leak's 1)\n" in done.stderr
    doc = read_report(report)
    assert (doc["command_exit_code"], doc["exit_status"], doc["exit_reason"]) == (5, 5, "command-failed")
    assert [e["path"] for e in doc["leaked"]] == [str(path)]
    assert [kind for *_, kind in outcomes(read_junit(junit))] == ["command-failed", "leak"]


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSEGV], ids=lambda s: signal.Signals(s).name)
def test_a_command_killed_by_signal_n_exits_128_plus_n_and_the_report_names_the_signal(
    signum: signal.Signals, root: Path, tmp_path: Path
) -> None:
    report, junit = tmp_path / "audit.json", tmp_path / "audit.xml"
    kill = f"import os; os.kill(os.getpid(), {int(signum)})"
    done = shmctl(
        "audit",
        "--root",
        str(root),
        "--report",
        str(report),
        "--junit",
        str(junit),
        "--",
        sys.executable,
        "-c",
        kill,
    )
    name = signal.Signals(signum).name
    assert (done.returncode, done.stdout) == (128 + signum, ""), done.stderr
    assert done.stderr.startswith("shmctl: audit: command-killed: ")
    assert f"was killed by {name}, left nothing" in done.stderr
    doc = read_report(report)
    assert (doc["command_exit_code"], doc["command_signal"]) == (None, name)
    assert (doc["exit_status"], doc["exit_reason"]) == (128 + signum, "command-killed")
    assert [kind for *_, kind in outcomes(read_junit(junit))] == ["command-killed", None]


def test_a_daemon_the_command_left_holding_a_region_is_a_leak_named_with_its_holder(
    engine_id: str, root: Path, tmp_path: Path
) -> None:
    report = tmp_path / "audit.json"
    path, pid_file = region(root, engine_id), tmp_path / "daemon.pid"
    with killed_after(pid_file):
        command = [sys.executable, "-c", DAEMON, str(path), str(pid_file)]
        done = shmctl("audit", "--root", str(root), "--report", str(report), "--", *command)
        pid = int(pid_file.read_text())
    assert done.returncode == 1, done.stderr
    assert f"{path.name}: " in done.stderr
    assert f", live, holders: pid {pid} (python: fd, map, lock)" in done.stderr
    assert "files still held stay until their holders exit; reap them after" in done.stderr
    doc = read_report(report)
    (entry,) = doc["leaked"]
    assert (entry["status"], entry["owner"]["pid"]) == ("live", pid)
    assert [h["pid"] for h in entry["holders"]] == [pid]


def test_a_deleted_region_a_leftover_process_maps_is_in_the_report(
    engine_id: str, root: Path, tmp_path: Path
) -> None:
    report = tmp_path / "audit.json"
    path = region(root, engine_id)
    done = shmctl(
        "audit",
        "--root",
        str(root),
        "--report",
        str(report),
        "--",
        sys.executable,
        "-c",
        LINGER,
        str(path),
        "20",
    )
    doc = read_report(report)
    mine = [d for d in doc["leaked_deleted"] if d["engine_id"] == engine_id]
    try:
        assert done.returncode == 1, done.stderr
        assert [(d["path"], d["mapped_bytes"]) for d in mine] == [(str(path), 1 << 20)]
        assert f"{path.name} (deleted, still mapped): 1048576 bytes mapped" in done.stderr
    finally:
        for d in mine:
            os.kill(d["pid"], signal.SIGKILL)


def test_a_name_with_a_control_character_and_a_non_utf8_byte_gives_well_formed_junit(
    engine_id: str, root: Path, tmp_path: Path
) -> None:
    report, junit = tmp_path / "audit.json", tmp_path / "audit.xml"
    raw = os.fsencode(root) + b"/vllm_offload_" + engine_id.encode() + b"\x1b\x01\xff.mmap"
    done = shmctl(
        "audit", "--root", str(root), "--report", str(report), "--junit", str(junit), "--", *make_region(raw)
    )
    assert done.returncode == 1, done.stderr
    assert "\x1b" not in done.stderr
    assert "\x01" not in done.stderr
    escaped = f"vllm_offload_{engine_id}\\x1b\\x01\\udcff.mmap"
    assert f"shmctl: audit:   {escaped}: 1048576 bytes" in done.stderr
    # The JSON keeps the exact name: its bytes come back.
    (entry,) = read_report(report)["leaked"]
    assert os.fsencode(entry["path"]) == raw
    suite = read_junit(junit)  # ET.parse: well-formed XML 1.0
    assert [name for _, name, _ in outcomes(suite)][1:] == [escaped]
    failure = suite.findall("testcase")[1].find("failure")
    assert failure is not None
    assert escaped in (failure.text or "")


def test_the_outputs_replace_old_files_whole_and_leave_no_temp_file(root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    report, junit = out / "audit.json", out / "audit.xml"
    report.write_text("stale")
    junit.write_text("stale")
    done = shmctl("audit", "--root", str(root), "--report", str(report), "--junit", str(junit), "--", "true")
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(out)) == ["audit.json", "audit.xml"]
    assert read_report(report)["exit_reason"] == "clean"
    read_junit(junit)


# --- a command that cannot be started ---------------------------------------------------


def _unstartable(kind: str, tmp_path: Path) -> str:
    """A command ``execve`` refuses, of the kind named."""
    if kind == "not-found":
        return "no-such-command-kvtest"
    if kind == "no-such-path":
        return str(tmp_path / "no-such-program")
    path = tmp_path / "program"
    if kind == "not-executable":
        path.write_text("#!/bin/sh\ntrue\n")
        path.chmod(0o644)
    elif kind == "no-interpreter":
        path.write_text(f"#!{tmp_path / 'no-such-interpreter'}\ntrue\n")
        path.chmod(0o755)
    elif kind == "exec-format":
        path.write_text("not a program\n")  # executable, no #! line: ENOEXEC
        path.chmod(0o755)
    else:
        path.mkdir()  # a directory: EACCES
    return str(path)


@pytest.mark.parametrize(
    ("kind", "status", "errno_name", "why", "fix"),
    [
        ("not-found", 127, "ENOENT", "command not found", "check its name, or add its directory to PATH"),
        ("no-such-path", 127, "ENOENT", "no such file", "check the path"),
        ("not-executable", 126, "EACCES", "permission denied", "chmod +x"),
        ("no-interpreter", 126, "ENOENT", "bad interpreter", "fix the #! line"),
        ("exec-format", 126, "ENOEXEC", "exec format error", "add a #! line"),
        ("directory", 126, "EACCES", "is a directory", "name the program to run"),
    ],
)
def test_a_command_that_cannot_start_exits_as_a_shell_would_and_still_writes_both_files(
    kind: str, status: int, errno_name: str, why: str, fix: str, root: Path, tmp_path: Path
) -> None:
    command = _unstartable(kind, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    report, junit = out / "audit.json", out / "audit.xml"
    done = shmctl("audit", "--root", str(root), "--report", str(report), "--junit", str(junit), "--", command)
    assert (done.returncode, done.stdout) == (status, "")
    assert done.stderr.startswith(f"shmctl: error: {command}: {why}"), done.stderr
    assert f"(fix: {fix}" in done.stderr
    assert done.stderr.count("\n") == 1
    doc = read_report(report)
    assert (doc["exit_status"], doc["exit_reason"]) == (status, "command-not-started")
    assert (doc["command_exit_code"], doc["command_signal"], doc["clean"]) == (None, None, True)
    assert doc["command_start_error"]["errno"] == errno_name
    assert doc["command_start_error"]["found"] is (kind not in ("not-found", "no-such-path"))
    suite = read_junit(junit)
    assert outcomes(suite) == [("shmctl.audit.command", command, "command-not-started")]


def test_the_library_reports_a_command_that_cannot_start_instead_of_raising(root: Path) -> None:
    report = audit(["no-such-command-kvtest", "arg"], root)
    assert (report.exit_status, report.exit_reason) == (127, ExitReason.COMMAND_NOT_STARTED)
    assert report.command_start_error is not None
    assert (report.command_start_error.errno, report.command_start_error.found) == ("ENOENT", False)
    assert report.command == ("no-such-command-kvtest", "arg")


# --- where the outputs go: replaced, or written in place -------------------------------


@pytest.fixture
def quiet_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root off /dev/shm's filesystem, where no other session's deleted region is mapped:
    these tests are about the outputs, and a stranger's leak must not change the exit status."""
    return tmp_path_factory.mktemp("root")


def test_a_fifo_is_written_in_place_for_its_reader_and_stays_a_fifo(quiet_root: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    done = shmctl("audit", "--root", str(quiet_root), "--report", str(fifo), "--", "true")
    reader.join(30)
    assert done.returncode == 0, done.stderr
    assert not reader.is_alive()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    doc = json.loads(received[0])
    validate(doc, "audit")
    assert doc["exit_reason"] == "clean"
    assert sorted(os.listdir(tmp_path)) == ["report.fifo"]


@contextmanager
def host_names_kept(*paths: Path) -> Iterator[None]:
    """Should a regression replace a device or link of /dev (the bug these tests pin), it is
    made again as it was when the block ends: the host's other users keep their /dev/null."""
    before = {path: os.lstat(path) for path in paths}
    links = {path: os.readlink(path) for path, st in before.items() if stat.S_ISLNK(st.st_mode)}
    try:
        yield
    finally:
        for path, st in before.items():
            now = os.lstat(path)
            if stat.S_IFMT(now.st_mode) == stat.S_IFMT(st.st_mode):
                continue
            spare = path.with_name(f".{path.name}.kvtest")
            if path in links:
                os.symlink(links[path], spare)
            else:
                os.mknod(spare, stat.S_IMODE(st.st_mode) | stat.S_IFMT(st.st_mode), st.st_rdev)
                os.chmod(spare, stat.S_IMODE(st.st_mode))
            os.replace(spare, path)


@pytest.mark.root
@pytest.mark.parametrize("where", ["dev-null", "private-node"])
def test_a_character_device_is_written_in_place_never_replaced(
    where: str, quiet_root: Path, tmp_path: Path
) -> None:
    if where == "dev-null":
        null = Path(os.devnull)
    else:  # the same device made here: a check that cannot touch the host's
        null = tmp_path / "null"
        os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    before = os.lstat(null)
    with host_names_kept(null):
        done = shmctl("audit", "--root", str(quiet_root), "--report", str(null), "--", "true")
        after = os.lstat(null)
    assert done.returncode == 0, done.stderr
    assert stat.S_ISCHR(after.st_mode)
    assert (after.st_rdev, after.st_ino, after.st_mode) == (before.st_rdev, before.st_ino, before.st_mode)


def test_junit_to_dev_stdout_follows_the_commands_output_on_the_pipe(quiet_root: Path) -> None:
    with host_names_kept(Path("/dev/stdout")):
        done = shmctl("audit", "--root", str(quiet_root), "--junit", "/dev/stdout", "--", "echo", "hello")
    assert stat.S_ISLNK(os.lstat("/dev/stdout").st_mode)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("hello\n<?xml ")
    suite = ET.fromstring(done.stdout.removeprefix("hello\n").encode())
    assert [c.get("name") for c in suite.findall("testcase")] == ["echo hello", "left nothing"]


@pytest.mark.parametrize("name", ["/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"])
def test_an_fd_by_name_is_written_at_its_offset_when_it_is_a_regular_file(
    name: str, quiet_root: Path, tmp_path: Path
) -> None:
    # `shmctl audit --report /dev/stdout -- cmd > log`: the report follows the command's
    # output in the log, neither replacing the log nor overwriting it from its first byte.
    log = tmp_path / "log"
    audit_args = ["audit", "--root", str(quiet_root), "--report", name, "--", "echo", "hi"]
    with log.open("wb") as out, host_names_kept(Path("/dev/stdout")):
        done = subprocess.run(
            [sys.executable, "-m", "shmctl", *audit_args],
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            check=False,
            timeout=60,
        )
        inode = os.fstat(out.fileno()).st_ino
    assert done.returncode == 0, done.stderr
    assert os.stat(log).st_ino == inode
    text = log.read_text()
    assert text.startswith("hi\n{")
    validate(json.loads(text.removeprefix("hi\n")), "audit")


def test_a_symlink_stays_a_link_and_the_file_it_names_is_replaced(quiet_root: Path, tmp_path: Path) -> None:
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_text("stale")
    link.symlink_to(target.name)
    dangling_link, missing = tmp_path / "dangling.json", tmp_path / "missing.json"
    dangling_link.symlink_to(missing.name)
    done = shmctl(
        "audit", "--root", str(quiet_root), "--report", str(link), "--junit", str(dangling_link), "--", "true"
    )
    assert done.returncode == 0, done.stderr
    assert os.readlink(link) == target.name
    assert os.readlink(dangling_link) == missing.name
    assert read_report(target)["exit_reason"] == "clean"
    read_junit(missing)
    assert sorted(os.listdir(tmp_path)) == ["dangling.json", "link.json", "missing.json", "real.json"]


def test_two_names_of_one_file_are_refused(quiet_root: Path, tmp_path: Path) -> None:
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    link.symlink_to(target)
    done = shmctl(
        "audit", "--root", str(quiet_root), "--report", str(target), "--junit", str(link), "--", "true"
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(f"shmctl: error: --junit: {link} is also the --report file")


def _unusable_in_place(kind: str, tmp_path: Path) -> tuple[str, str, str]:
    """A name that is not a file to replace and cannot be written: the name, why, the fix."""
    if kind == "socket":
        path = tmp_path / "sock"
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))
        return str(path), f"{path} is a socket", "name a file, a FIFO or a device"
    if kind == "fd-not-open":
        return "/dev/fd/9", "/dev/fd/9: fd 9 is not open", "open it for writing (9>FILE in the shell)"
    # /proc/self/fd/0, not /dev/stdin: a regression that replaced the name could not touch /dev.
    return "/proc/self/fd/0", "/proc/self/fd/0: fd 0 is open read-only", "open it for writing"


@pytest.mark.parametrize("kind", ["socket", "fd-not-open", "fd-read-only"])
def test_a_name_that_cannot_be_written_in_place_is_refused_before_the_command_runs(
    kind: str, quiet_root: Path, tmp_path: Path
) -> None:
    value, why, fix = _unusable_in_place(kind, tmp_path)
    marker = quiet_root / "ran"
    audit_args = ["audit", "--root", str(quiet_root), "--report", value, "--", "touch", str(marker)]
    done = subprocess.run(  # stdin the read end of a pipe: open read-only
        [sys.executable, "-m", "shmctl", *audit_args],
        input="",
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (3, ""), done.stderr
    assert done.stderr.startswith(f"shmctl: error: --report: {why}"), done.stderr
    assert f"(fix: {fix}" in done.stderr
    assert not marker.exists()
    if kind == "socket":
        assert stat.S_ISSOCK(os.lstat(value).st_mode)


@pytest.mark.root
def test_a_device_that_refuses_the_report_is_named_with_its_own_fix(quiet_root: Path, tmp_path: Path) -> None:
    full = tmp_path / "full"  # /dev/full's device, made here: ENOSPC on every write
    os.mknod(full, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    junit = tmp_path / "audit.xml"
    done = shmctl(
        "audit", "--root", str(quiet_root), "--report", str(full), "--junit", str(junit), "--", "true"
    )
    assert done.returncode == 3
    last = done.stderr.splitlines()[-1]
    assert last == (
        f"shmctl: error: --report {full}: cannot write: {os.strerror(errno.ENOSPC)} "
        f"(fix: the device {full} refused the data: name another file)"
    )
    assert "free space" not in done.stderr
    read_junit(junit)  # the other file is still written
    assert stat.S_ISCHR(os.lstat(full).st_mode)


# --- the schema ------------------------------------------------------------------------


def _objects(node: Any, where: str = "#") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        if node.get("type") == "object":
            yield where, node
        for key, value in node.items():
            yield from _objects(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _objects(value, f"{where}/{i}")


def test_the_schema_closes_every_object_and_describes_every_field() -> None:
    audit_schema = schema("audit")
    assert audit_schema["$id"] == "urn:shmctl:schema:audit"
    objects = list(_objects(audit_schema))
    # The report and its command_start_error; its entries are scan's, by reference.
    assert [where for where, _ in objects] == ["#", "#/properties/command_start_error/oneOf/1"]
    for where, obj in objects:
        assert obj.get("additionalProperties") is False, where
        assert set(obj["required"]) == set(obj["properties"]), where
        for name, field in obj["properties"].items():
            assert field.get("description") or "$ref" in field, f"{where}/{name}"


def test_the_schema_refuses_a_field_the_code_does_not_write(root: Path, tmp_path: Path) -> None:
    report = tmp_path / "audit.json"
    assert shmctl("audit", "--root", str(root), "--report", str(report), "--", "true").returncode == 0
    doc = read_report(report)
    with pytest.raises(jsonschema.ValidationError):
        validate({**doc, "unexpected": 1}, "audit")
    with pytest.raises(jsonschema.ValidationError):
        validate({k: v for k, v in doc.items() if k != "exit_reason"}, "audit")
