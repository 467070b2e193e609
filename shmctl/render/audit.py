"""Rendering of ``AuditReport``: the summary on stderr, the JSON report, the JUnit XML.

The command's stdout and stderr are its own: the machine-readable report never shares a
stream with them unless asked to by name (``--junit /dev/stdout``). It goes to files
(``--report``, ``--junit``), and the human summary goes to stderr after the command's own
output, the same on a terminal and in a pipe (CI logs).

How an output is written depends on what its name is (``write_output``); nothing that is
not a regular file is ever replaced:

* a regular file, or a name that does not exist yet: written whole or not at all, a temp
  file in the same directory renamed over the name (mode 0644);
* a symbolic link to one: the same, for the file the link names; the link stays a link;
* one of this process's open files by name (``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``,
  ``/proc/self/fd/N``): written through that fd, at its offset, as a shell's ``>&N`` writes
  (reopening the name would start a regular file over from its first byte, and a socket,
  journald's stdout, cannot be opened at all);
* a character device, a FIFO (or a link to one): opened and written in place, as a shell's
  ``>`` would; a FIFO waits for its reader. A socket, a block device and a directory are
  refused before the command runs.

File names and arguments are whoever made them chose: every one is passed through
``printable`` before it reaches the summary or the XML, which makes it safe for both (XML
1.0 cannot hold control characters, nor the lone surrogates that stand for undecodable
bytes). The JSON keeps the exact name: ``json_text`` writes lone surrogates and controls as
their ``\\uXXXX`` escapes, so ``json.loads`` gives the name back.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import re
import select
import shlex
import socket
import stat
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path

from kvoffload.errors import ConfigError, KvOffloadError
from kvoffload.liveness.audit import AuditReport, ExitReason, StartFailure
from kvoffload.liveness.holders import DeletedMapping, Holder
from kvoffload.liveness.report import ScanEntry
from shmctl.render import json_text, printable, to_jsonable
from shmctl.render.fixes import unwritable_fix

PREFIX = "shmctl: audit: "
SUITE = "shmctl audit"


# --- the summary on stderr -------------------------------------------------------------


def summary_lines(report: AuditReport) -> list[str]:
    """The human summary: one line when clean, else a headline, one line per leak, the fix."""
    failure = report.command_start_error
    if failure is not None and report.exit_reason is ExitReason.COMMAND_NOT_STARTED:
        # As a shell says it: one error line naming the command, the cause and the fix.
        text = not_started_text(report.command[0], failure)
        return [f"shmctl: error: {printable(text, escape_backslash=False)}"]
    lines = [f"{PREFIX}{report.exit_reason}: {_headline(report)}"]
    lines += [f"{PREFIX}  {_leak_line(e)}" for e in report.leaked]
    lines += [f"{PREFIX}  {_deleted_line(d)}" for d in report.leaked_deleted]
    lines += [
        f"{PREFIX}remove orphans with: {printable(c, escape_backslash=False)}" for c in report.reap_commands
    ]
    if any(e.holders for e in report.leaked):
        lines.append(f"{PREFIX}files still held stay until their holders exit; reap them after")
    if report.leaked_deleted:
        lines.append(f"{PREFIX}a deleted region is freed when the processes mapping it exit")
    return lines


def print_summary(report: AuditReport) -> None:
    # Each name is escaped where it is put in a line; the line is escaped again as it is
    # written (the escapes stay as they are), so no later field can slip a control through.
    lines = summary_lines(report)
    sys.stderr.write("".join(f"{printable(line, escape_backslash=False)}\n" for line in lines))
    sys.stderr.flush()


def not_started_text(name: str, failure: StartFailure) -> str:
    """``NAME: why it could not start; nothing ran (fix: ...)``, for the program ``name``."""
    why, fix = _start_failure(failure, name)
    return f"{name}: {why}; nothing ran (fix: {fix})"


def _start_failure(failure: StartFailure, name: str) -> tuple[str, str]:
    """Why ``execve`` refused the command, and the fix, per errno (a shell's words where it has them)."""
    searched = os.sep not in name
    quoted = shlex.quote(name)
    if failure.errno == "ENOENT" and not failure.found:
        if searched:
            return "command not found", "check its name, or add its directory to PATH"
        return "no such file", "check the path"
    if failure.errno == "ENOENT":
        return (
            "bad interpreter: the program its #! line names does not exist",
            "fix the #! line, or install that interpreter",
        )
    if failure.errno == "EACCES":
        if os.path.isdir(name):
            return "is a directory", "name the program to run"
        return (
            "permission denied (not executable, or on a noexec mount)",
            f"chmod +x {quoted}, or run it through its interpreter: -- sh {quoted}",
        )
    if failure.errno == "ENOEXEC":
        return (
            "exec format error: not a program this kernel runs, and no #! line",
            f"add a #! line, or run it through its interpreter: -- sh {quoted}",
        )
    if failure.errno == "ENOTDIR":
        return "not a directory: a component of its path is a file", "check the path"
    if failure.errno == "E2BIG":
        return "argument list too long", "pass fewer or shorter arguments (xargs splits them)"
    if failure.errno in ("EAGAIN", "ENOMEM"):
        return (
            f"could not start a process: {failure.message}",
            "free memory or processes (ulimit -u), then run again",
        )
    return f"cannot be executed: {failure.message}", "check the command and its file"


def _command(report: AuditReport) -> str:
    return printable(shlex.join(report.command), escape_backslash=False)


def _how_it_ended(report: AuditReport) -> str:
    if report.command_start_error is not None:
        return f"could not be started ({report.command_start_error.message})"
    if report.command_signal is not None:
        return f"was killed by {report.command_signal}"
    return f"exited {report.command_exit_code}"


def _headline(report: AuditReport) -> str:
    if report.clean:
        left, extra = "left nothing", ""
    else:
        left = (
            f"left {_count(len(report.leaked), 'region file')} and "
            f"{_count(len(report.leaked_deleted), 'mapped-but-deleted region')}"
        )
        extra = f"{report.leaked_resident_bytes} bytes resident, "
    sentence = (
        f"`{_command(report)}` {_how_it_ended(report)}, {left} in {printable(str(report.root))} "
        f"({extra}{report.duration_s:.1f}s); exit {report.exit_status}"
    )
    if report.exit_reason is ExitReason.INTERRUPTED:
        return f"{report.interrupted_by} stopped the audit and was passed on; {sentence}"
    if not report.clean and report.exit_reason is not ExitReason.LEAKED:
        return f"{sentence} (the command's own status outranks the leak's 1)"
    return sentence


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _holders(holders: Iterable[Holder]) -> str:
    named = [f"pid {h.pid} ({printable(h.name)}: {', '.join(h.via)})" for h in holders]
    return "; ".join(named) or "none"


def _leak_line(e: ScanEntry) -> str:
    return (
        f"{printable(e.name)}: {e.size_bytes} bytes ({e.resident_bytes} resident), "
        f"engine {printable(e.engine_id)}, {e.status}, holders: {_holders(e.holders)}"
    )


def _deleted_line(d: DeletedMapping) -> str:
    holder = Holder(pid=d.pid, name=d.name, via=d.via)
    return (
        f"{printable(os.path.basename(d.path))} (deleted, still mapped): {d.mapped_bytes} bytes mapped, "
        f"engine {printable(d.engine_id)}, holders: {_holders([holder])}"
    )


# --- the JSON report -------------------------------------------------------------------


def report_document(report: AuditReport) -> dict[str, object]:
    """The ``--report`` document: the report dataclass, serialised, and ``clean``."""
    data = to_jsonable(report)
    assert isinstance(data, dict)
    return {**data, "clean": report.clean}


def report_json(report: AuditReport) -> bytes:
    # json_text: the escaping of every JSON output (a name's undecodable bytes as "\udcXX",
    # controls as "\uXXXX"), so a report shown with `cat` cannot drive a terminal either.
    return (json_text(report_document(report), pretty=True) + "\n").encode("utf-8")


# --- the JUnit XML ---------------------------------------------------------------------


def junit_xml(report: AuditReport) -> bytes:
    """One ``<testsuite>``: a testcase for the command's exit status, then one per leak.

    The command is its own testcase so that CI shows a failed command as a failure even when
    it left nothing (and both, when it failed and leaked); a run that left nothing has one
    passing testcase for the root, so the audit is seen to have run. A stopped audit is an
    ``<error>``, not a ``<failure>``: the command never got to finish.
    """
    root = printable(str(report.root))
    cases = [_command_case(report)]
    cases += [_leak_case(report, e) for e in report.leaked]
    cases += [_deleted_case(d, root) for d in report.leaked_deleted]
    if report.clean and report.command_start_error is None:
        cases.append(_case(f"shmctl.audit.{root}", "left nothing", 0.0))
    failures = sum(1 for c in cases if c.find("failure") is not None)
    errors = sum(1 for c in cases if c.find("error") is not None)
    started = datetime.datetime.fromtimestamp(report.started_at, datetime.UTC)
    suite = ET.Element(
        "testsuite",
        {
            "name": SUITE,
            "tests": str(len(cases)),
            "failures": str(failures),
            "errors": str(errors),
            "skipped": "0",
            "time": f"{report.duration_s:.3f}",
            "timestamp": started.strftime("%Y-%m-%dT%H:%M:%S"),
            "hostname": printable(socket.gethostname()),
        },
    )
    properties = ET.SubElement(suite, "properties")
    start_error = report.command_start_error
    for name, value in (
        ("schema_version", report.schema_version),
        ("root", root),
        ("command", _command(report)),
        ("command_exit_code", report.command_exit_code),
        ("command_signal", report.command_signal),
        ("command_start_error", start_error.errno if start_error is not None else None),
        ("interrupted_by", report.interrupted_by),
        ("exit_status", report.exit_status),
        ("exit_reason", report.exit_reason),
    ):
        if value is not None:
            ET.SubElement(properties, "property", {"name": name, "value": str(value)})
    suite.extend(cases)
    ET.indent(suite)
    document: bytes = ET.tostring(suite, encoding="utf-8", xml_declaration=True)
    return document + b"\n"


def _case(classname: str, name: str, time_s: float) -> ET.Element:
    return ET.Element("testcase", {"classname": classname, "name": name, "time": f"{time_s:.3f}"})


def _fail(case: ET.Element, tag: str, kind: str, message: str, details: Iterable[str]) -> ET.Element:
    outcome = ET.SubElement(case, tag, {"message": message, "type": kind})
    outcome.text = "\n".join(details)
    return case


def _command_case(report: AuditReport) -> ET.Element:
    case = _case("shmctl.audit.command", _command(report), report.duration_s)
    ended = f"`{_command(report)}` {_how_it_ended(report)}"
    details = [ended, f"exit status {report.exit_status} ({report.exit_reason})"]
    if report.exit_reason is ExitReason.INTERRUPTED:
        return _fail(case, "error", "interrupted", f"{report.interrupted_by} stopped the audit", details)
    if report.command_start_error is not None:
        why = printable(not_started_text(report.command[0], report.command_start_error))
        return _fail(case, "error", "command-not-started", why, [why, details[-1]])
    if report.command_signal is not None:
        return _fail(case, "failure", "command-killed", ended, details)
    if report.command_exit_code != 0:
        return _fail(case, "failure", "command-failed", ended, details)
    return case


def _leak_case(report: AuditReport, e: ScanEntry) -> ET.Element:
    case = _case(f"shmctl.audit.{printable(str(report.root))}", printable(e.name), 0.0)
    message = f"left {e.size_bytes} bytes ({e.resident_bytes} resident), {e.status}"
    details = [
        f"path: {printable(str(e.path))}",
        f"engine: {printable(e.engine_id)}",
        f"segment: {e.segment}",
        f"size: {e.size_bytes} bytes",
        f"resident: {e.resident_bytes} bytes",
        f"status: {e.status}: {printable(e.reason)}",
        f"holders: {_holders(e.holders)}",
        *(f"remove orphans with: {printable(c, escape_backslash=False)}" for c in report.reap_commands),
    ]
    return _fail(case, "failure", "leak", message, details)


def _deleted_case(d: DeletedMapping, root: str) -> ET.Element:
    name = f"{printable(os.path.basename(d.path))} (deleted, mapped by pid {d.pid})"
    case = _case(f"shmctl.audit.{root}", name, 0.0)
    message = f"deleted but still mapped: {d.mapped_bytes} bytes mapped by pid {d.pid}"
    details = [
        f"path: {printable(d.path)} (deleted)",
        f"engine: {printable(d.engine_id)}",
        f"mapped: {d.mapped_bytes} bytes",
        f"holders: {_holders([Holder(pid=d.pid, name=d.name, via=d.via)])}",
        "freed when the processes mapping it exit",
    ]
    return _fail(case, "failure", "leak", message, details)


# --- the output files ------------------------------------------------------------------

_STD_STREAMS = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}
_FD_NAME = re.compile(r"^/(?:dev/fd|proc/self/fd|proc/thread-self/fd|proc/(\d+)/fd)/(\d+)$")
_INSTEAD = "name another file"


def own_fd(path: Path) -> int | None:
    """The fd number when ``path`` names one of this process's open files (``/dev/stdout``)."""
    name = os.path.normpath(os.path.abspath(path))
    if name in _STD_STREAMS:
        return _STD_STREAMS[name]
    match = _FD_NAME.match(name)
    if match is None or (match[1] is not None and int(match[1]) != os.getpid()):
        return None
    return int(match[2])


def check_output(path: Path | None, option: str) -> None:
    """Refuse, before the command runs, a ``--report``/``--junit`` path that cannot be written.

    A name that will be replaced (a regular file, a new name, a link to either): a temp file
    is created and removed in the directory of the file it names: that directory exists and
    takes new files (permissions, read-only mounts, a full inode table), which is what the
    final rename needs. A device or FIFO: this user may write it. An fd by name: it is open
    for writing. ``-`` is refused: stdout belongs to the command (``/dev/stdout`` says so on
    purpose).
    """
    if path is None:
        return
    if str(path) == "-":
        raise ConfigError(
            option, "'-' (stdout) is the command's own output", fix=f"name a file, e.g. {option} audit.out"
        )
    fd = own_fd(path)
    if fd is not None:
        _check_own_fd(path, fd, option)
        return
    try:
        mode: int | None = os.stat(path).st_mode
    except FileNotFoundError:  # a new name, or a link to one
        mode = None
    except OSError as e:
        raise ConfigError(
            option, f"cannot use {path}: {e.strerror or e}", fix=unwritable_fix(e, path, instead=_INSTEAD)
        ) from None
    if mode is not None and stat.S_ISDIR(mode):
        raise ConfigError(
            option, f"{path} is a directory", fix=f"name a file in it, e.g. {path / 'audit.out'}"
        )
    if mode is not None and not stat.S_ISREG(mode):
        _check_in_place(path, mode, option)
        return
    directory = _replaced(path).parent
    if not directory.is_dir():
        raise ConfigError(
            option, f"{directory} is not a directory", fix="create it first, or name another file"
        )
    try:
        probe_fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise ConfigError(
            option,
            f"cannot create files in {directory}: {e.strerror or e}",
            fix=unwritable_fix(e, directory, instead=_INSTEAD),
        ) from None
    os.close(probe_fd)
    os.unlink(probe)


def _check_own_fd(path: Path, fd: int, option: str) -> None:
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        raise ConfigError(
            option,
            f"{path}: fd {fd} is not open",
            fix=f"open it for writing ({fd}>FILE in the shell), or {_INSTEAD}",
        ) from None
    if flags & os.O_ACCMODE == os.O_RDONLY:
        raise ConfigError(
            option, f"{path}: fd {fd} is open read-only", fix=f"open it for writing, or {_INSTEAD}"
        )


def _check_in_place(path: Path, mode: int, option: str) -> None:
    if stat.S_ISSOCK(mode):
        raise ConfigError(
            option,
            f"{path} is a socket, which cannot be opened as a file",
            fix="name a file, a FIFO or a device",
        )
    if stat.S_ISBLK(mode):
        raise ConfigError(
            option, f"{path} is a block device: the report would overwrite what it stores", fix=_INSTEAD
        )
    if not os.access(path, os.W_OK):
        raise ConfigError(
            option, f"{path}: permission denied", fix=f"give this user write access to it, or {_INSTEAD}"
        )


def check_outputs(report: Path | None, junit: Path | None) -> None:
    if report is not None and junit is not None and _same_file(report, junit):
        raise ConfigError("--junit", f"{junit} is also the --report file", fix="give each its own file")
    check_output(report, "--report")
    check_output(junit, "--junit")


def _same_file(a: Path, b: Path) -> bool:
    """One name twice, or two names of one file that would be replaced (the second rename wins)."""
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    return own_fd(a) is None and own_fd(b) is None and os.path.realpath(a) == os.path.realpath(b)


def write_outputs(report: AuditReport, *, report_path: Path | None, junit_path: Path | None) -> None:
    """Write the report and the JUnit file; a failure to write one still writes the other."""
    failed: KvOffloadError | None = None
    for path, option, render in ((report_path, "--report", report_json), (junit_path, "--junit", junit_xml)):
        if path is None:
            continue
        try:
            write_output(path, render(report))
        except OSError as e:
            where = path if own_fd(path) is not None or _in_place(path) else _replaced(path).parent
            failed = failed or KvOffloadError(
                f"{option} {path}: cannot write: {e.strerror or e}",
                fix=unwritable_fix(e, where, instead=_INSTEAD),
            )
    if failed is not None:
        raise failed


def write_output(path: Path, data: bytes) -> None:
    """``data`` to ``path``, in the way its kind of file asks (the module docstring): replaced
    whole when it is (or links to) a regular file or is new, else written where it stands."""
    fd = own_fd(path)
    if fd is not None:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()  # anything of ours buffered for that fd goes first
        _write_all(fd, data)
    elif not write_in_place(path, data):
        write_atomically(_replaced(path), data)


def _replaced(path: Path) -> Path:
    """The name the rename replaces: ``path``, or the file a symbolic link at ``path`` names."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _in_place(path: Path) -> bool:
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def write_in_place(path: Path, data: bytes) -> bool:
    """Write ``data`` into the device or FIFO at ``path`` (following links); False, writing
    nothing, when ``path`` is missing or a regular file (the caller replaces it instead).

    The type is checked again on the open fd: a regular file that took the name meanwhile is
    closed untouched, never written over from its first byte.
    """
    if not _in_place(path):
        return False
    fd = os.open(path, os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC)  # a FIFO waits for its reader
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        _write_all(fd, data)
    finally:
        os.close(fd)
    return True


def _write_all(fd: int, data: bytes) -> None:
    """Every byte of ``data`` to ``fd``: a pipe takes a large write in parts, and a pipe its
    reader made non-blocking answers EAGAIN while full."""
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            select.select([], [fd], [])
            continue
        view = view[written:]


def write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, never part of it (temp file + rename)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
