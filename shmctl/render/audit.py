"""Rendering of ``AuditReport``: the summary on stderr, the JSON report, the JUnit XML.

The command's stdout and stderr are its own: the machine-readable report never shares a
stream with them unless asked to by name (``--junit /dev/stdout``). It goes to files
(``--report``, ``--junit``), and the human summary goes to stderr after the command's own
output, the same on a terminal and in a pipe (CI logs).

How each output is written depends on what its name is, and is ``shmctl.output_files``'s
business: a regular file is replaced atomically; a device, a FIFO or an fd by name is written
in place, never replaced. Here each document is paired with its option (``check_outputs``,
``write_outputs``).

File names and arguments are whoever made them chose: every one is passed through
``printable`` before it reaches the summary or the XML, which makes it safe for both (XML
1.0 cannot hold control characters, nor the lone surrogates that stand for undecodable
bytes). The JSON keeps the exact name: ``json_text`` writes lone surrogates and controls as
their ``\\uXXXX`` escapes, so ``json.loads`` gives the name back.
"""

from __future__ import annotations

import datetime
import os
import shlex
import socket
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType

from kvoffload.errors import ConfigError, KvOffloadError
from kvoffload.liveness.audit import AuditReport, ExitReason, StartFailure
from kvoffload.liveness.holders import DeletedMapping, Holder
from kvoffload.liveness.report import ScanEntry
from shmctl.output_files import (
    INSTEAD,
    HeldOutput,
    check_output,
    hold_output,
    in_place,
    own_fd,
    replaced_path,
    same_file,
    write_atomically,
    write_in_place,
    write_output,
)
from shmctl.render import json_text, printable, to_jsonable
from shmctl.render.fixes import unwritable_fix

#: own_fd, check_output, write_output, write_in_place, write_atomically: moved to
#: shmctl.output_files; kept here for one release (issue #29).
__all__ = [
    "PREFIX",
    "SUITE",
    "AuditOutputs",
    "check_output",
    "check_outputs",
    "junit_xml",
    "not_started_text",
    "own_fd",
    "print_summary",
    "report_document",
    "report_json",
    "summary_lines",
    "write_atomically",
    "write_in_place",
    "write_output",
    "write_outputs",
]

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


class AuditOutputs:
    """The ``--report`` and ``--junit`` outputs, checked before the command runs; a FIFO's
    write end is held open from then until ``write`` (``shmctl.output_files.hold_output``).
    A context manager: ``close`` (idempotent) lets go of what ``write`` did not use."""

    def __init__(self, report: HeldOutput | None, junit: HeldOutput | None) -> None:
        self._outputs = ((report, "--report", report_json), (junit, "--junit", junit_xml))

    def write(self, report: AuditReport) -> None:
        """Write the report and the JUnit file; a failure to write one still writes the other."""
        failed: KvOffloadError | None = None
        for output, option, render in self._outputs:
            if output is None:
                continue
            path = output.path
            try:
                output.write(render(report))
            except OSError as e:
                where = path if own_fd(path) is not None or in_place(path) else replaced_path(path).parent
                failed = failed or KvOffloadError(
                    f"{option} {path}: cannot write: {e.strerror or e}",
                    fix=unwritable_fix(e, where, instead=INSTEAD),
                )
        if failed is not None:
            raise failed

    def close(self) -> None:
        for output, _, _ in self._outputs:
            if output is not None:
                output.close()

    def __enter__(self) -> AuditOutputs:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def check_outputs(report: Path | None, junit: Path | None) -> AuditOutputs:
    """Refuse outputs that cannot be written before anything runs: two names of one file is a
    usage error (exit 2); a path the system refuses, a FIFO nobody reads included, is an
    ``OutputError`` (exit 3)."""
    if report is not None and junit is not None and same_file(report, junit):
        raise ConfigError("--junit", f"{junit} is also the --report file", fix="give each its own file")
    with ExitStack() as held:
        outputs = AuditOutputs(
            None if report is None else held.enter_context(hold_output(report, "--report")),
            None if junit is None else held.enter_context(hold_output(junit, "--junit")),
        )
        held.pop_all()
    return outputs


def write_outputs(report: AuditReport, *, report_path: Path | None, junit_path: Path | None) -> None:
    """Write the report and the JUnit file to paths not held (``AuditOutputs.write``)."""
    AuditOutputs(
        None if report_path is None else HeldOutput(report_path),
        None if junit_path is None else HeldOutput(junit_path),
    ).write(report)
