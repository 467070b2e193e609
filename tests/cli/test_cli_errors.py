"""Every CLI error path: one line on stderr naming the problem and the fix, no traceback, the
documented exit code, nothing on stdout and nothing created.

The walker reads the commands and their options from the Typer app itself, so a command or an
option added tomorrow is walked the day it is added. Each case runs ``python -m shmctl`` in a
subprocess: what an operator's shell sees.
"""

from __future__ import annotations

import inspect
import os
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer.main

from shmctl.app import app
from tests.support.hostile import shmctl

USAGE, RUNTIME = 2, 3
ROOT = "{root}"  # replaced by the test's own root
#: Arguments that make each command valid and harmless (nothing allocated, nothing removed),
#: so that a case fails because of its one bad argument and nothing else.
CONTEXT: dict[str, list[str]] = {
    "scan": ["--root", ROOT],
    "reap": ["--root", ROOT, "--dry-run"],
    "metrics": ["--root", ROOT],
    "faults": [],
    "init": [
        "--root",
        ROOT,
        "--dry-run",
        "--kv-transfer-config",
        '{"kv_connector_extra_config": {"cpu_bytes_to_use": 1048576}}',
        "--kv-bytes-per-block",
        "4096",
    ],
}
# A default tmpfs root: every check of the test host may warn, none fails.
CONTEXT["doctor"] = ["--root", ROOT]
#: Arguments that must come after the options.
TRAILING: dict[str, list[str]] = {"audit": ["--", "true"]}
CONTEXT["audit"] = ["--root", ROOT]


@dataclass(frozen=True)
class Case:
    command: str
    argv: tuple[str, ...]
    code: int
    names: str | None = None  # text the error line must contain
    bad: tuple[str, ...] = ()  # what is wrong, for the test id

    @property
    def id(self) -> str:
        return f"{self.command} {' '.join(self.bad or self.argv)}"


def _option_types() -> dict[str, dict[str, Any]]:
    """Per command, per option declaration, the Python type its parameter is annotated with."""
    found: dict[str, dict[str, Any]] = {}
    group: Any = typer.main.get_command(app)
    for name, command in group.commands.items():
        # typer wraps the function it was given (functools.update_wrapper): the annotations
        # are the wrapped one's.
        hints = typing.get_type_hints(inspect.unwrap(command.callback))
        found[name] = {decl: hints.get(p.name) for p in command.params for decl in p.opts}
    return found


def _is_int(annotation: Any) -> bool:
    if annotation is int:
        return True
    return any(_is_int(arg) for arg in typing.get_args(annotation))


def _is_path(annotation: Any) -> bool:
    return annotation is Path or any(_is_path(arg) for arg in typing.get_args(annotation))


def cases() -> Iterator[Case]:
    group = typer.main.get_command(app)
    types = _option_types()
    yield Case("shmctl", ("--no-such-option",), USAGE, "--no-such-option")
    yield Case("shmctl", ("no-such-command",), USAGE, "no-such-command")
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        context = CONTEXT.get(name, [])
        trailing = TRAILING.get(name, [])

        def case(
            *bad: str,
            code: int = USAGE,
            names: str | None = None,
            last: bool = False,
            name: str = name,
            context: list[str] = context,
            trailing: list[str] = trailing,
        ) -> Case:
            tail = [] if last else trailing
            return Case(name, (name, *context, *bad, *tail), code, names, bad)

        yield case("--no-such-option", names="--no-such-option")
        if not any(p.param_type_name == "argument" for p in command.params):
            yield case("unexpected-argument", names="unexpected-argument")
        flags_done = False
        for param in command.params:
            if param.param_type_name == "argument":
                if param.required:
                    yield Case(name, (name, *context), USAGE, "Missing argument", ("<no argument>",))
                continue
            decl = param.opts[0]
            if param.is_flag:
                if not flags_done:  # click treats every flag alike: one per command
                    yield case(f"{decl}=1", names=decl)
                    flags_done = True
                continue
            yield case(decl, names=decl, last=True)  # its value is missing
            annotation = types[name].get(decl)
            if _is_int(annotation):
                yield case(decl, "twelve", names=decl)
                minimum = getattr(param, "min", None)
                if minimum is not None:
                    yield case(decl, str(minimum - 1), names=decl)
            if param.metavar == "DURATION":
                yield case(decl, "soon", names=decl)
                # Past any sane wait: time.sleep and deadline arithmetic would overflow.
                yield case(decl, "99999999999d", names=decl)
            if _is_path(annotation) and decl == "--root":
                yield case(decl, "/nonexistent/kvtest-root", code=RUNTIME, names="/nonexistent/kvtest-root")


ALL_CASES = list(cases())

#: Runtime and semantic errors the walker cannot derive from types.
EXTRA_CASES = [
    Case("scan", ("scan", "--root", sys.executable), RUNTIME, "is not a directory"),
    Case("reap", ("reap", "--root", "/nonexistent/kvtest-root", "--yes"), RUNTIME, "does not exist"),
    Case("reap", ("reap", "--root", ROOT, "--dry-run", "--grace", "-5s"), USAGE, "--grace"),
    Case("reap", ("reap", "--root", ROOT), USAGE, "--yes"),  # stdin is not a terminal
    Case(
        "metrics", ("metrics", "--root", ROOT, "--textfile", "/nonexistent/kvtest-dir"), RUNTIME, "textfile"
    ),
    # As a shell: 127, one line naming the command and the fix (the report, when asked, says why).
    Case("audit", ("audit", "--root", ROOT, "--", "/nonexistent/kvtest-command"), 127, "no such file"),
    Case("audit", ("audit", "--root", ROOT, "--settle", "-1s", "--", "true"), USAGE, "--settle"),
    Case("init", (*["init", *CONTEXT["init"]], "--fail-at", "no-such-point"), USAGE, "no-such-point"),
    Case("doctor", ("doctor", "--root", sys.executable), RUNTIME, "is not a directory"),
    Case("doctor", ("doctor", "--root", ROOT, "--need", "1.5g"), USAGE, "--need"),
    Case("doctor", ("doctor", "--root", ROOT, "--plan", sys.executable), USAGE, "--kv-bytes-per-block"),
]


def _untagged_shm() -> set[str]:
    """Region-like names in /dev/shm that no test made (tests tag theirs with kvtest-)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("vllm_offload_") and "kvtest-" not in n}


def run_case(case: Case, root: Path) -> None:
    argv = [str(root) if a == ROOT else a for a in case.argv]
    before = _untagged_shm()
    done = shmctl(*argv, env={"SHMCTL_ROOT": None, "KVOFFLOAD_FAILPOINTS": None, "NO_COLOR": "1"})
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == case.code, done.stderr
    if case.command == "metrics" and case.code == 3 and "--textfile" not in argv:
        # A root that cannot be read is still a scrape: shmctl_scan_success 0 on stdout.
        assert "\nshmctl_scan_success{" in done.stdout
        assert "} 0.0\n" in done.stdout
    else:
        assert done.stdout == "", done.stdout
    assert done.stderr.startswith("shmctl: error: ")
    assert done.stderr.count("\n") == 1
    assert done.stderr.endswith("\n")
    if case.names is not None:
        assert case.names in done.stderr
    assert "fix: " in done.stderr
    assert os.listdir(root) == []
    assert _untagged_shm() <= before


def test_the_walker_reaches_every_command_of_the_app() -> None:
    walked = {c.command for c in ALL_CASES}
    assert walked >= set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    assert {"scan", "reap", "init", "faults", "audit", "metrics"} <= walked


@pytest.mark.parametrize(
    "command",
    # audit runs `true` and audits the /dev/shm tmpfs: another test's regions would be leaks.
    [pytest.param(c, marks=pytest.mark.system_wide) if c == "audit" else c for c in sorted(CONTEXT)],
)
def test_the_context_each_case_starts_from_is_itself_valid(command: str, root: Path) -> None:
    argv = [str(root) if a == ROOT else a for a in (command, *CONTEXT[command], *TRAILING.get(command, []))]
    done = shmctl(*argv, env={"SHMCTL_ROOT": None, "KVOFFLOAD_FAILPOINTS": None, "NO_COLOR": "1"})
    assert done.returncode == 0, done.stderr
    assert os.listdir(root) == []


@pytest.mark.slow
@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_a_bad_argument_is_one_line_naming_it_and_the_fix_with_the_documented_exit_code(
    case: Case, root: Path
) -> None:
    run_case(case, root)


@pytest.mark.parametrize("case", EXTRA_CASES, ids=[c.id for c in EXTRA_CASES])
def test_runtime_and_semantic_errors_are_one_line_with_the_documented_exit_code(
    case: Case, root: Path
) -> None:
    run_case(case, root)


def test_a_malformed_failpoint_variable_does_not_break_commands_that_inject_nothing(root: Path) -> None:
    done = shmctl("scan", "--root", str(root), env={"KVOFFLOAD_FAILPOINTS": "no-such-point=explode"})
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"no region files in {root}\n"


INIT_WITH_FILE = ["init", "--root", ROOT, "--dry-run", "--kv-bytes-per-block", "4096", "--config"]
BIG_INT = "1" + "0" * 4000  # int() takes it; the sizing's float division overflowed on it


def _hostile_config(tmp_path: Path, kind: str) -> Path:
    """A --config argument that used to hang, eat memory or end in a traceback."""
    if kind == "dev-zero":
        return Path("/dev/zero")
    path = tmp_path / ("engine.toml" if kind.endswith("-toml") else "engine.json")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "over-1-MiB":
        path.write_text("{}" + " " * (1 << 20))
    elif kind == "deep":
        path.write_text("[" * 100_000)
    elif kind == "deep-toml":
        path.write_text("a = " + "[" * 100_000)
    elif kind == "5000-digits":
        path.write_text('{"kv_connector_extra_config": {"cpu_bytes_to_use": 1' + "0" * 5000 + "}}")
    elif kind == "5000-digits-toml":
        path.write_text("[kv_connector_extra_config]\ncpu_bytes_to_use = 1" + "0" * 5000 + "\n")
    elif kind == "4000-digits":
        path.write_text('{"kv_connector_extra_config": {"cpu_bytes_to_use": ' + BIG_INT + "}}")
    return path


@pytest.mark.parametrize(
    ("kind", "names"),
    [
        ("dev-zero", "--config: {path} is a character device, not a regular file"),
        ("fifo", "--config: {path} is a FIFO, not a regular file"),
        ("over-1-MiB", "--config: {path} is larger than the 1 MiB"),
        ("deep", "--config: {path}: JSON nested too deeply"),
        ("deep-toml", "--config: {path}: TOML nested too deeply"),
        ("5000-digits", "--config: {path}: JSON holds an integer longer than 4300 digits"),
        ("5000-digits-toml", "--config: {path}: TOML holds an integer longer than 4300 digits"),
        ("4000-digits", "kv_connector_extra_config.cpu_bytes_to_use: must be at most"),
    ],
)
def test_a_hostile_config_file_is_one_line_naming_it_and_nothing_is_allocated(
    kind: str, names: str, root: Path, tmp_path: Path
) -> None:
    path = _hostile_config(tmp_path, kind)
    run_case(Case("init", (*INIT_WITH_FILE, str(path)), USAGE, names.format(path=path)), root)


def test_an_integer_of_4000_digits_in_kv_transfer_config_is_one_line_naming_the_key(root: Path) -> None:
    document = '{"kv_connector_extra_config": {"cpu_bytes_to_use": ' + BIG_INT + "}}"
    argv = ("init", "--root", ROOT, "--dry-run", "--kv-bytes-per-block", "4096")
    run_case(Case("init", (*argv, "--kv-transfer-config", document), USAGE, "cpu_bytes_to_use"), root)
