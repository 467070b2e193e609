"""Every `shmctl` command README.md and docs/*.md show runs as written, with the exit status
the text states.

The commands are read from the documents themselves: every ``$`` line of a ``console`` block
that runs shmctl (after ``sudo``, or as ``python -m shmctl``), with the block's variable
assignments before it (``$ C='…'``), and the examples of README's command table (its ``$C``
defined in the note under it). Each runs in real bash, in a mount and network namespace of its
own: ``/dev/shm`` there is a fresh 1 GiB tmpfs (room for the 64 MiB regions the examples bring
up and a crash's orphans; less than the 200 GiB the dry-run example shows not fitting), and
``SHMCTL_ROOT`` names it; ``/var/lib`` is a tmpfs too, with the directories a node has. So a
documented ``--root /dev/shm`` or ``--listen :9477`` touches nothing of the host's, and every
engine id is new in a root of its own.

The expected status is the document's: a ``# exit N`` comment on the line, or the number a
following ``$ echo $?`` prints. Where the text states none, a verdict (0 or 1) is expected, never
a usage (2) or runtime (3) error. A command documented as running until Ctrl-C (``--hold``,
``watch`` without ``--once``) gets a SIGINT once it has said something, and exits 0.

What the examples take for granted is given to them: ``engine.json`` (an engine's config), a
``tests/`` that leaves a region behind (the audit story), a ``run-tests.sh`` without its
executable bit, node_exporter's textfile directories, the kubelet's pods directory. What the
test cannot give is in ``SKIPPED``, each with its reason; keep that list short.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.procs import REPO

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
_RUNS_SHMCTL = re.compile(r"^(?:sudo\s+)?(?:\S*python3?\s+-m\s+)?shmctl\s")
_STATED_EXIT = re.compile(r"#.*\bexit (\d+)\b(?!\s+if\b)")
#: The private shm root of each example: a limit, not an allocation.
ROOT_SIZE = "1g"

#: Documented commands the test cannot run, by the start of the command, with the reason.
SKIPPED = {
    "build/vllm-engine/venv/bin/python -m shmctl init --engine vllm": (
        "needs vLLM and a model: `make vllm-engine` builds both and runs this scenario"
    ),
}


@dataclass(frozen=True, slots=True)
class Example:
    document: str
    line: int
    command: str
    #: The block's ``NAME=value`` lines before the command, run first in the same shell.
    setup: tuple[str, ...]
    expected: int | None
    until_ctrl_c: bool

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}:{self.command[:50]}"


def _logical_lines(block: str, first_line: int) -> list[tuple[int, str]]:
    """The block's lines, a ``\\`` continuation or an unclosed quote joined to the next line."""
    raw = block.splitlines()
    joined: list[tuple[int, str]] = []
    i = 0
    while i < len(raw):
        start, line = first_line + i, raw[i]
        i += 1
        while i < len(raw) and (line.endswith("\\") or _open_quote(line)):
            line = (line[:-1] + " " + raw[i].strip()) if line.endswith("\\") else line + "\n" + raw[i]
            i += 1
        joined.append((start, line))
    return joined


def _open_quote(line: str) -> bool:
    if not line.startswith("$ "):
        return False
    try:
        shlex.split(line, comments=True)
    except ValueError:
        return True
    return False


def _until_ctrl_c(command: str) -> bool:
    words = command.split()
    return "--hold" in words or ("watch" in words and "--once" not in words)


def examples_of(document: Path) -> list[Example]:
    """Every shmctl command of the document's console blocks, with its stated exit status."""
    text = document.read_text()
    found: list[Example] = []
    for block in _FENCE.finditer(text):
        if block.group(1) != "console":
            continue
        setup: list[str] = []
        lines = _logical_lines(block.group(2), text[: block.start(2)].count("\n") + 1)
        for index, (number, line) in enumerate(lines):
            if not line.startswith("$ "):
                continue
            command = line[2:].strip()
            if _ASSIGNMENT.match(command):
                setup.append(command)
            elif command.startswith("echo $?") and found and found[-1].line < number:
                printed = lines[index + 1][1].split() if index + 1 < len(lines) else []
                if printed and printed[0].isdigit():
                    found[-1] = _with_expected(found[-1], int(printed[0]))
            elif _RUNS_SHMCTL.match(command):
                stated = _STATED_EXIT.search(command)
                found.append(
                    Example(
                        document.name,
                        number,
                        command,
                        tuple(setup),
                        int(stated.group(1)) if stated else None,
                        _until_ctrl_c(command),
                    )
                )
    return found


def _with_expected(example: Example, code: int) -> Example:
    return Example(example.document, example.line, example.command, example.setup, code, example.until_ctrl_c)


def readme_table_examples() -> list[Example]:
    """The example column of README's command table, ``$C`` as the note under it defines it."""
    text = (REPO / "README.md").read_text()
    table = text.split("## Commands", 1)[1].split("\n\n", 2)[1]
    setup = tuple(re.findall(r"`(C='[^`]*')`", text))
    found = []
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[2].startswith("`shmctl "):
            command = cells[2].strip("`")
            number = text[: text.index(row)].count("\n") + 1
            found.append(Example("README.md", number, command, setup, None, _until_ctrl_c(command)))
    return found


EXAMPLES = [e for document in DOCUMENTS for e in examples_of(document)] + readme_table_examples()


def test_the_documents_show_examples_of_every_command() -> None:
    """The extraction finds what the documents show (a parser that finds nothing tests nothing)."""
    commands = {e.command.removeprefix("sudo ").split()[1] for e in EXAMPLES if "-m shmctl" not in e.command}
    assert {"scan", "reap", "init", "audit", "metrics", "watch", "faults", "doctor"} <= commands
    assert any(e.expected == 3 for e in EXAMPLES)
    assert all(e.setup for e in EXAMPLES if '"$C"' in e.command)


def test_every_skipped_command_is_still_documented() -> None:
    """A skip whose command left the docs is dead weight in the list: remove it."""
    for start in SKIPPED:
        assert any(e.command.startswith(start) for e in EXAMPLES), start


# ----------------------------------------------------------------- what the examples assume

_LEAKY_TEST = """\
import mmap, os

def test_that_leaves_a_region_behind():
    # What a test suite that kills its engine leaves: the audit story of docs/commands.md.
    fd = os.open("/dev/shm/vllm_offload_t1.mmap", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 1 << 20)
    with mmap.mmap(fd, 1 << 20) as m:
        m[0] = 1
    os.close(fd)
"""

_ENGINE_JSON = (
    '{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": '
    '{"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 67108864, '
    '"secondary_tiers": [{"type": "example"}]}}'
)


def _workdir(tmp_path: Path) -> Path:
    """The directory an example runs in, with the files the documents take for granted."""
    work = tmp_path / "work"
    (work / "tests").mkdir(parents=True)
    (work / "tests" / "test_leaks.py").write_text(_LEAKY_TEST)
    (work / "engine.json").write_text(_ENGINE_JSON)
    (work / "run-tests.sh").write_text("#!/bin/sh\nexec pytest -q\n")  # not executable: the story
    (work / "run-tests.sh").chmod(0o644)
    return work


def _bin(tmp_path: Path) -> Path:
    """A ``shmctl`` on PATH that is this checkout's, run by this interpreter."""
    where = tmp_path / "bin"
    where.mkdir()
    shim = where / "shmctl"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m shmctl "$@"\n')
    shim.chmod(0o755)
    return where


def _script(example: Example, work: Path) -> str:
    """The example in bash, in its own namespaces, after the world it assumes is set up."""
    return textwrap.dedent(
        f"""\
        set -e
        mount -t tmpfs -o size={ROOT_SIZE},mode=1777 tmpfs /dev/shm
        mount -t tmpfs tmpfs /var/lib
        mkdir -p /var/lib/prometheus/node-exporter /var/lib/node_exporter /var/lib/kubelet/pods
        ip link set lo up
        cd {shlex.quote(str(work))}
        set +e -o pipefail
        sudo() {{ "$@"; }}
        """
    ) + "\n".join([*example.setup, example.command, ""])


needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None,
    reason="needs root, unshare and ip (a private /dev/shm and network per example)",
)


@pytest.mark.slow
@pytest.mark.root
@needs_namespaces
@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_every_documented_command_runs_as_written(example: Example, tmp_path: Path) -> None:
    for start, reason in SKIPPED.items():
        if example.command.startswith(start):
            pytest.skip(reason)
    env = {
        **os.environ,
        "PATH": f"{_bin(tmp_path)}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
        "SHMCTL_ROOT": "/dev/shm",
        "NO_COLOR": "1",
    }
    argv = ["unshare", "--mount", "--net", "--propagation", "private", "bash", "-c"]
    argv.append(_script(example, _workdir(tmp_path)))
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    ) as proc:
        assert proc.stdout is not None
        try:
            if example.until_ctrl_c:
                first = proc.stdout.readline()  # it is up once it says something, or it failed
                if not first.startswith("shmctl: error:"):
                    os.killpg(proc.pid, signal.SIGINT)
                output = first + proc.stdout.read()
            else:
                output = proc.stdout.read()
            code = proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    where = f"{example.document}:{example.line}: {example.command}\n{output[-3000:]}"
    assert "Traceback" not in output, where
    if example.until_ctrl_c:
        assert code == 0, where
    elif example.expected is not None:
        assert code == example.expected, where
    else:
        assert code in (0, 1), where
