"""``make bench``'s harness and its scan, reap and agent scripts, at toy sizes.

The harness merges every script's rows into one JSON document and one table, reports a script
that fails or leaves a directory behind, and on Ctrl-C stops the running script, which
removes what it made and ends its holder processes. No test reads a figure: timings belong to
the bench, not to the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import REPO

BENCH = REPO / "bench"
SHM = Path("/dev/shm")
#: One harness at a time (bench/run.py): its sweep removes a bench directory that appeared
#: meanwhile and that nobody holds yet, another harness's or script's included.
pytestmark = pytest.mark.xdist_group("bench")
HEADER = ["figure", "median", "min-max", "baseline", "ratio", "goal", "met"]
ROW_KEYS = {"figure", "unit", "median", "min", "max", "baseline", "ratio", "goal", "met"}
TINY = [
    "--args",
    "scan=--files 40 --growth-from 10 --holders 4 --repeat 1 --startup-repeat 1",
    "--args",
    "reap=--files 40 --repeat 1",
]
AGENT_TINY = ["--args", "agent=--pods 5 --processes +50 --repeat 2 --profile-lines 5"]
#: In the command line of bench_agent's host process and of every process it forks.
AGENT_HOST_MARK = "bench_agent host"

FAKE_ROWS = """
import json, sys
with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
    json.dump([{"figure": "fake figure", "unit": "ms", "median": 2.0, "min": 1.0, "max": 3.0,
                "baseline": "", "ratio": 1.0, "goal": "", "met": True}], f)
"""
FAKE_FAILS = """
import sys
print("fake: error: it broke", file=sys.stderr)
sys.exit(3)
"""
FAKE_LEAKS = (
    """
import os
os.mkdir(f"/dev/shm/shmctl-bench-{os.environ['SHMCTL_BENCH_TAG']}leak")
"""
    + FAKE_ROWS
)


@pytest.fixture
def tag() -> str:
    """The tag the harness and the scripts put in every name they make in /dev/shm."""
    return f"t{uuid.uuid4().hex[:8]}-"


def tagged(tag: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM) if tag in name)


def touching(path: str) -> list[int]:
    """Processes with anything under ``path`` open or mapped."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            targets = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            with open(f"/proc/{pid}/maps") as f:
                targets += f.read().splitlines()
        except OSError:
            continue
        if any(path in t for t in targets):
            found.append(int(pid))
    return found


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def harness(
    tmp_path: Path, tag: str, args: Sequence[str]
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "run.py"),
            "--json",
            str(tmp_path / "results.json"),
            "--markdown",
            str(tmp_path / "results.md"),
            *args,
        ],
        env={**os.environ, "SHMCTL_BENCH_TAG": tag},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    return done, json.loads((tmp_path / "results.json").read_text())


@pytest.mark.slow
def test_scan_and_reap_rows_merge_into_one_json_document_and_one_table(tmp_path: Path, tag: str) -> None:
    done, doc = harness(tmp_path, tag, ["--quick", "--only", "scan,reap", *TINY])

    assert done.returncode == 0, done.stderr
    assert [(s["script"], s["status"]) for s in doc["scripts"]] == [
        ("bench_scan.py", "ok"),
        ("bench_reap.py", "ok"),
    ]
    assert {"date", "machine", "machine_line", "quick", "interrupted", "rows"} <= set(doc)
    assert {"cpu", "cores", "memory", "kernel", "shm", "python"} <= set(doc["machine"])
    assert {r["script"] for r in doc["rows"]} == {"bench_scan.py", "bench_reap.py"}
    for row in doc["rows"]:
        assert set(row) == ROW_KEYS | {"script"}
        assert row["min"] <= row["median"] <= row["max"]
        assert isinstance(row["met"], bool)
    figures = [r["figure"] for r in doc["rows"]]
    assert any(f.startswith("shmctl scan --json growth") for f in figures)
    assert any(f.startswith("shmctl reap --yes vs rm -f") for f in figures)
    assert any(f.startswith("Tab completion") for f in figures)
    table = done.stdout[done.stdout.rindex(doc["machine_line"]) :]
    assert table.splitlines()[1].split() == HEADER
    assert all(f in table for f in figures)
    markdown = (tmp_path / "results.md").read_text().splitlines()
    assert doc["machine_line"] in markdown[0]
    assert markdown[2] == "| figure | median | min-max | baseline | ratio | goal | met |"
    assert markdown[4 + len(figures)] == ""  # the table ends; where the time went follows
    # Each script's profile: in the JSON, and under the script's name in the Markdown.
    profiles = {s["script"]: s["profile"] for s in doc["scripts"]}
    assert any(line.startswith("imports of ") for line in profiles["bench_scan.py"])
    assert any("by own time" in line for line in profiles["bench_scan.py"])
    assert any("by own time" in line for line in profiles["bench_reap.py"])
    section = markdown[markdown.index("#### Where the time went") :]
    assert "`bench_scan.py`:" in section
    assert "`bench_reap.py`:" in section
    assert profiles["bench_reap.py"][0] in section
    assert tagged(tag) == []


def agent_processes() -> list[int]:
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if AGENT_HOST_MARK.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def mounted_with(tag: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if tag in line.split()[4]]


@pytest.mark.slow
def test_the_agent_bench_times_a_checked_pass_profiles_it_and_leaves_nothing(
    tmp_path: Path, tag: str
) -> None:
    done, doc = harness(tmp_path, tag, ["--quick", "--only", "agent", *AGENT_TINY])

    assert done.returncode == 0, done.stderr
    assert [(s["script"], s["status"]) for s in doc["scripts"]] == [("bench_agent.py", "ok")]
    figures = [r["figure"] for r in doc["rows"]]
    assert any(
        f.startswith("agent steady-state pass, 5 pod volumes") and f.endswith("(CPU)") for f in figures
    )
    [graded] = [r for r in doc["rows"] if r["goal"]]
    assert graded["goal"] == "<= 1.0x budget (0.1 s)"
    assert graded["baseline"] == "budget 0.1 s"
    [agent] = doc["scripts"]
    assert agent["profile"][0].startswith("cProfile of one steady pass")
    assert any("filename:lineno(function)" in line for line in agent["profile"])
    assert tagged(tag) == []
    assert mounted_with(tag) == []
    assert agent_processes() == []


@pytest.mark.slow
def test_the_joiner_bench_races_both_protocols_and_leaves_nothing(tmp_path: Path, tag: str) -> None:
    done, doc = harness(tmp_path, tag, ["--only", "joiner", "--args", "joiner=--races 20"])

    assert done.returncode == 0, done.stderr
    assert [(s["script"], s["status"]) for s in doc["scripts"]] == [("bench_joiner.py", "ok")]
    figures = [r["figure"] for r in doc["rows"]]
    protocols = ["park"] + (["in place"] if os.geteuid() == 0 else [])
    for protocol in protocols:
        assert any(f.startswith("joiner ENOENT per 1,000 races") and f"{protocol} (" in f for f in figures)
        assert any(
            f.startswith("joiner left holding a removed file") and f"{protocol} (" in f for f in figures
        )
    assert tagged(tag) == []
    assert mounted_with(tag) == []


def test_a_failing_script_is_a_failed_line_and_the_others_still_run(tmp_path: Path, tag: str) -> None:
    fails = script(tmp_path, "bench_fails.py", FAKE_FAILS)
    rows = script(tmp_path, "bench_rows.py", FAKE_ROWS)

    done, doc = harness(tmp_path, tag, [fails, rows])

    assert done.returncode == 1
    assert [(s["script"], s["status"], s["exit"]) for s in doc["scripts"]] == [
        ("bench_fails.py", "failed", 3),
        ("bench_rows.py", "ok", 0),
    ]
    assert [r["figure"] for r in doc["rows"]] == ["fake figure"]
    assert "FAILED (exit 3: fake: error: it broke)" in done.stdout
    assert "fake: error: it broke" in done.stderr


def test_a_script_that_leaves_a_directory_behind_fails_and_the_directory_goes(
    tmp_path: Path, tag: str
) -> None:
    leaks = script(tmp_path, "bench_leaks.py", FAKE_LEAKS)

    done, doc = harness(tmp_path, tag, [leaks])

    assert done.returncode == 1
    [outcome] = doc["scripts"]
    assert outcome["status"] == "failed"
    assert outcome["leftovers"] == [f"/dev/shm/shmctl-bench-{tag}leak"]
    assert f"removed /dev/shm/shmctl-bench-{tag}leak" in done.stderr
    assert tagged(tag) == []


def read_until(stream: Any, marker: str) -> list[str]:
    lines = []
    for line in stream:
        lines.append(line)
        if line.startswith(marker):
            return lines
    raise AssertionError(f"the bench ended before printing {marker!r}: {''.join(lines)}")


def files_dir(lines: Sequence[str]) -> str:
    [line] = [line for line in lines if line.startswith("files in ")]
    return line.removeprefix("files in ").strip()


@pytest.mark.slow
def test_ctrl_c_stops_the_harness_and_the_scan_bench_removes_its_files_and_ends_its_holders(
    tmp_path: Path, tag: str
) -> None:
    after = script(tmp_path, "bench_after.py", FAKE_ROWS)
    argv = [
        sys.executable,
        str(BENCH / "run.py"),
        "--json",
        str(tmp_path / "results.json"),
        str(BENCH / "bench_scan.py"),
        after,
        "--args",
        "scan=--files 200 --holders 8 --repeat 100 --startup-repeat 1",
    ]
    env = {**os.environ, "SHMCTL_BENCH_TAG": tag}
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as run:
        assert run.stdout is not None
        lines = read_until(run.stdout, "measuring:")
        work = files_dir(lines)
        assert tagged(tag) == [Path(work).name]
        assert touching(work)  # the holders are up

        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=60)

    assert run.returncode == 130, err
    assert tagged(tag) == []
    assert touching(work) == []
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["interrupted"] is True
    assert [(s["script"], s["status"]) for s in doc["scripts"]] == [("bench_scan.py", "interrupted")]
    assert doc["not_run"] == ["bench_after.py"]


@pytest.mark.slow
def test_sigterm_ends_the_reap_bench_with_its_directory_removed(tag: str) -> None:
    argv = [sys.executable, str(BENCH / "bench_reap.py"), "--files", "2000", "--repeat", "100"]
    env = {**os.environ, "SHMCTL_BENCH_TAG": tag}
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as bench:
        assert bench.stdout is not None
        work = files_dir(read_until(bench.stdout, "measuring:"))
        assert tagged(tag) == [Path(work).name]

        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)

    assert bench.returncode == 130
    assert "interrupted" in err
    assert tagged(tag) == []
