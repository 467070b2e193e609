"""``make demo`` (scripts/demo.sh) into a pipe: every step behaves as the script expects, no
escape sequence reaches the pipe, and each command it echoes is what a shell reads back as the
command it ran, on the demo's own root (a pasted line never acts on the host's /dev/shm).

The demo runs the real bring-up, so it needs torch (``pip install '.[torch]'``) and skips
without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def words_as_bash_reads(line: str) -> list[str]:
    """The words of a pasted command line, split by bash itself."""
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", 'printf "%s\\0" ' + line],
        capture_output=True,
        timeout=30,
        check=True,
    )
    return done.stdout.decode().split("\0")[:-1]


@pytest.fixture(scope="module")
def demo() -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("the demo's real bring-up needs torch (pip install '.[torch]')")
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "SHMCTL_ROOT")}
    # TERM as a terminal would have it: only stdout being a pipe takes the bold away.
    env |= {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")]),
        "PYTHONPATH": str(REPO),
        "TERM": "xterm-256color",
    }
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "demo.sh")],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )


def echoed(demo: subprocess.CompletedProcess[str]) -> list[str]:
    return [line[2:] for line in demo.stdout.splitlines() if line.startswith("$ ")]


def test_every_step_of_the_demo_behaves_as_expected(demo: subprocess.CompletedProcess[str]) -> None:
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert demo.stdout.rstrip().endswith("demo: all steps behaved as expected")
    assert len(echoed(demo)) == 7


def test_no_escape_sequence_reaches_a_pipe(demo: subprocess.CompletedProcess[str]) -> None:
    assert "\x1b" not in demo.stdout
    assert "\x1b" not in demo.stderr


def test_each_echoed_command_reads_back_as_one_shmctl_command_on_the_demos_root(
    demo: subprocess.CompletedProcess[str],
) -> None:
    for line in echoed(demo):
        assert "\n" not in line
        words = words_as_bash_reads(line)
        assert words[0] == "shmctl", line
        root = Path(words[words.index("--root") + 1])
        assert root.parent == Path("/dev/shm"), line
        assert root.name.startswith("shmctl-demo."), line
        if "--kv-transfer-config" in words:
            config = json.loads(words[words.index("--kv-transfer-config") + 1])
            assert config["kv_connector"] == "OffloadingConnector", line
