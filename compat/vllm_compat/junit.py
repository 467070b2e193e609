"""Per-test outcomes from the JUnit XML report of one pytest run (``--junitxml``, xunit2)."""

from __future__ import annotations

import ast
import re
import xml.etree.ElementTree as ET

from .outcomes import Outcome
from .scope import TESTS


def parse_junit(body: bytes, test_file: str) -> list[Outcome]:
    """Per-test outcomes; a file that failed to import is one ``error`` named ``<collection>``.

    A file skipped as a whole (``pytest.importorskip`` at module level) is one ``skipped``
    ``<collection>``. A collection error's message is the exception it ended with.
    """
    module = TESTS.replace("/", ".") + "." + test_file.removesuffix(".py").replace("/", ".")
    outcomes = []
    for case in ET.fromstring(body).iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        if not name:  # the test an interrupt (SIGINT at the time limit) stopped: not an outcome
            continue
        if classname == module:
            test = f"{test_file}::{name}"
        elif classname.startswith(module + "."):
            test = f"{test_file}::{classname[len(module) + 1 :].replace('.', '::')}::{name}"
        else:  # pytest's record of a module that failed to import, or was skipped whole
            test = f"{test_file}::<collection>"
        result, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                result = {"failure": "failed"}.get(child.tag, child.tag)
                if child.tag == "error":  # at collection, setup or teardown: the exception says why
                    message = raised(child.text or "") or (child.get("message") or "")
                elif test.endswith("::<collection>"):
                    message = skipped_whole(child.text or "") or (child.get("message") or "")
                else:
                    first = (child.get("message") or child.text or "").strip().splitlines()
                    message = first[0] if first else ""
                break
        outcomes.append(Outcome(test, result, message[:300]))
    return outcomes


def raised(report: str) -> str:
    """The exception a pytest traceback ends with: its last ``E   Name: what`` line."""
    lines = [line[1:].strip() for line in report.splitlines() if line.startswith("E ")]
    named = [line for line in lines if re.match(r"[\w.]+(Error|Exception|Exit|Interrupt)\b", line)]
    return (named or lines or [""])[-1]


def skipped_whole(report: str) -> str:
    """The reason of a module-level skip; pytest writes ``(path, line, 'Skipped: why')``."""
    try:
        where = ast.literal_eval(report.strip())
    except (ValueError, SyntaxError):
        return ""
    if isinstance(where, tuple) and where and isinstance(where[-1], str):
        return where[-1].removeprefix("Skipped: ")
    return ""
