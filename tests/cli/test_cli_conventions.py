"""The CLI behaves like its neighbours: the same table on a terminal and in a pipe, NO_COLOR,
``--bytes``, ``--no-headers``, repeatable filters with globs, ``ls``'s ages in the JSON and for
``--older-than``, quiet closed pipes,
``--version``, and one-line JSON off a terminal.

Every command here runs as a real process; "a terminal" is a real pseudo-terminal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.support.hostile import shmctl as run_shmctl
from tests.support.procs import REPO, Child, leave_orphan, region_path
from tests.support.terminal import on_a_terminal


def shmctl(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``tests.support.hostile.shmctl`` with ``NO_COLOR`` cleared unless ``env`` sets it."""
    return run_shmctl(*argv, env={"NO_COLOR": None, **(env or {})})


@pytest.fixture
def three_regions(root: Path, engine_id: str) -> Iterator[dict[str, Path]]:
    """An orphan two hours old by mtime (its ctime, CHANGED, is now), a live region and a
    long-named orphan, all real."""
    regions = {
        "orphan": leave_orphan(root, f"{engine_id}-a"),
        "live": region_path(root, f"{engine_id}-b"),
        "long": leave_orphan(root, f"{engine_id}-{'x' * 90}"),
    }
    old = time.time() - 7200
    with Child("vllm", regions["live"]):
        for path in regions.values():
            os.utime(path, (old, old))
        yield regions
    regions["live"].unlink()


def test_a_terminal_and_a_pipe_get_the_same_columns_and_rows(
    root: Path, three_regions: dict[str, Path]
) -> None:
    piped = shmctl("scan", "--root", str(root), "--grace", "0")
    shown = on_a_terminal("scan", "--root", str(root), "--grace", "0")
    assert (shown.code, shown.err) == (piped.returncode, piped.stderr) == (1, "")
    assert "\x1b[" in shown.text  # colour on the terminal...
    assert "\x1b" not in piped.stdout  # ...and none in the pipe
    assert _unchanged(shown.plain) == _unchanged(piped.stdout)


def test_no_color_removes_colour_and_nothing_else(root: Path, three_regions: dict[str, Path]) -> None:
    piped = shmctl("scan", "--root", str(root), "--grace", "0")
    shown = on_a_terminal("scan", "--root", str(root), "--grace", "0", env={"NO_COLOR": "1"})
    assert shown.code == 1
    assert _unchanged(shown.text) == _unchanged(piped.stdout)


def _unchanged(table: str) -> str:
    """A scan table with its CHANGED cells blanked: they count seconds since a ctime no test
    can set back, and may tick between two runs a moment apart. Nothing else moves."""
    header, *lines = table.splitlines(keepends=True)
    end = header.index("CHANGED") + len("CHANGED")  # right-aligned: no cell is wider
    start = end - len("CHANGED")
    rows = [line[:start] + " " * (end - start) + line[end:] for line in lines[:-1]]
    return "".join([header, *rows, lines[-1]])


def test_a_long_engine_id_stays_on_its_row_at_80_columns(root: Path, three_regions: dict[str, Path]) -> None:
    shown = on_a_terminal("scan", "--root", str(root), "--grace", "0", columns=80).plain
    long_id = three_regions["long"].name.removeprefix("vllm_offload_").removesuffix(".mmap")
    (row,) = [line for line in shown.splitlines() if long_id in line]
    assert row.split()[:2] == ["orphaned", long_id]
    assert len(shown.splitlines()) == 1 + 3 + 1  # header, three regions, summary


def test_the_json_age_counts_from_mtime_as_ls_shows_it(root: Path, three_regions: dict[str, Path]) -> None:
    doc = json.loads(shmctl("scan", "--root", str(root), "--grace", "0", "--json").stdout)
    ages = {e["name"]: e["age_s"] for e in doc["entries"]}
    assert 7200 <= ages[three_regions["orphan"].name] < 7200 + 60


def test_bytes_prints_exact_integers_that_match_the_json(root: Path, three_regions: dict[str, Path]) -> None:
    doc = json.loads(shmctl("scan", "--root", str(root), "--grace", "0", "--json").stdout)
    out = shmctl("scan", "--root", str(root), "--grace", "0", "--bytes").stdout
    header, *rows = out.splitlines()[:-1]
    columns = header.split()
    table = {r.split()[1]: r.split() for r in rows}
    for entry in doc["entries"]:
        cells = table[entry["engine_id"]]
        assert int(cells[columns.index("SIZE")]) == entry["size_bytes"]
        assert int(cells[columns.index("RESIDENT")]) == entry["resident_bytes"]


def test_no_headers_prints_region_rows_only(root: Path, three_regions: dict[str, Path]) -> None:
    out = shmctl("scan", "--root", str(root), "--grace", "0", "--no-headers").stdout
    lines = out.splitlines()
    assert len(lines) == 3
    assert sorted(line.split()[0] for line in lines) == ["live", "orphaned", "orphaned"]


def test_every_engine_value_counts_and_globs_match(root: Path, engine_id: str) -> None:
    paths = [leave_orphan(root, f"{engine_id}-{x}") for x in ("a1", "b1", "c1")]
    listed = shmctl(
        "reap",
        "--root",
        str(root),
        "--grace",
        "0",
        "-n",
        "--engine",
        f"{engine_id}-a1",
        "--engine",
        f"{engine_id}-c*",
    )
    assert listed.returncode == 0
    rows = [line.split()[1] for line in listed.stdout.splitlines()[1:-1]]
    assert sorted(rows) == [f"{engine_id}-a1", f"{engine_id}-c1"]
    done = shmctl("reap", "--root", str(root), "--grace", "0", "--yes", "--engine", f"{engine_id}-*")
    assert done.returncode == 0
    assert not any(p.exists() for p in paths)


def test_a_filter_that_matches_nothing_says_so_on_stderr(root: Path, engine_id: str) -> None:
    path = leave_orphan(root, engine_id)
    done = shmctl("reap", "--root", str(root), "--grace", "0", "-n", "--engine", "kvtest-nobody-*")
    assert done.returncode == 0
    assert done.stderr == f"shmctl: warning: --engine 'kvtest-nobody-*' matches no region in {root}\n"
    assert path.exists()
    path.unlink()


def test_a_dry_run_whose_filter_leaves_orphans_out_says_why_not_to_reap(root: Path, engine_id: str) -> None:
    path = leave_orphan(root, engine_id)  # a fresh mtime: younger than an hour
    done = shmctl("reap", "--root", str(root), "--grace", "0", "-n", "--older-than", "1h")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("nothing to reap; 1 orphaned file(s) (")
    assert done.stdout.endswith(" resident) do not match --older-than 1h and stay\n")
    assert "removes them" not in done.stdout
    path.unlink()


@pytest.mark.parametrize(
    "argv",
    [("faults",), ("faults", "--json"), ("scan", "--grace", "1h"), ("scan", "--grace", "1h", "--json")],
    ids=" ".join,
)
def test_a_closed_pipe_exits_quietly_with_0(root: Path, engine_id: str, argv: tuple[str, ...]) -> None:
    if argv[0] == "scan":  # enough rows that the output cannot fit in the pipe
        for i in range(3000):
            (root / f"vllm_offload_{engine_id}-{i}.mmap").touch()
        argv = (*argv, "--root", str(root))
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmctl", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "NO_COLOR"},
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    assert proc.stdout.read(1)  # `| head -c 1`
    proc.stdout.close()
    err = proc.stderr.read()
    proc.stderr.close()
    assert (proc.wait(60), err) == (0, b"")
    for child in root.iterdir():
        child.unlink()


CLOSED_FD_CASES = [
    (("scan",), 1, 1),
    (("scan", "--json"), 1, 1),
    (("reap", "--yes"), 1, 0),
    (("reap",), 0, 2),  # a closed stdin is no terminal to confirm on: the usual refusal
]


@pytest.mark.parametrize(("argv", "closed", "status"), CLOSED_FD_CASES, ids=str)
def test_a_closed_standard_fd_is_dev_null_not_a_traceback(
    root: Path, engine_id: str, argv: tuple[str, ...], closed: int, status: int
) -> None:
    """``shmctl scan >&-``, ``reap <&-``: the command's own exit status, at most its one-line
    error, and nothing it opens (a region file) ever lands on the closed fd."""
    leave_orphan(root, engine_id)
    proc = subprocess.run(
        [sys.executable, "-m", "shmctl", *argv, "--root", str(root), "--grace", "0s"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=REPO,
        preexec_fn=lambda: os.close(closed),
        timeout=60,
        check=False,
    )
    err = proc.stderr.decode()
    assert "Traceback" not in err
    assert proc.returncode == status, err
    assert err.count("\n") == (1 if status == 2 else 0)
    # reap --yes removed the orphan through a park directory: nothing else is left behind.
    assert sorted(os.listdir(root)) == (
        [] if argv == ("reap", "--yes") else [region_path(root, engine_id).name]
    )


def test_version_names_the_installed_distribution() -> None:
    done = shmctl("--version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"shmctl {version('shmctl')}\n", "")


def test_json_is_one_line_in_a_pipe_and_indented_on_a_terminal(
    root: Path, three_regions: dict[str, Path]
) -> None:
    piped = shmctl("scan", "--root", str(root), "--grace", "0", "--json").stdout
    shown = on_a_terminal("scan", "--root", str(root), "--grace", "0", "--json").text
    assert piped.count("\n") == 1
    assert shown.count("\n") > 10
    assert _steady(json.loads(piped)) == _steady(json.loads(shown))


def _steady(doc: dict[str, object]) -> dict[str, object]:
    """The document without what moves between two scans a moment apart: the clock, and the
    unlinked regions of the whole tmpfs that other tests (other pytest workers) map meanwhile."""
    entries, deleted = doc["entries"], doc["deleted"]
    assert isinstance(entries, list)
    assert isinstance(deleted, list)
    ours = f"{doc['root']}/"
    return doc | {
        "scanned_at": 0,
        "entries": [e | {"age_s": 0, "changed_age_s": 0} for e in entries],
        "deleted": [d for d in deleted if d["path"].startswith(ours)],
    }


def _commands() -> list[str]:
    from typer.main import get_command

    from shmctl.app import app

    group = get_command(app)
    assert hasattr(group, "commands")
    return sorted(group.commands)


@pytest.mark.parametrize("command", _commands())
def test_help_shows_words_for_metavars_never_click_type_names(command: str) -> None:
    done = shmctl(command, "--help", env={"COLUMNS": "200"})
    assert done.returncode == 0
    for click_name in ("<int", "<float", "INTEGER", "FLOAT", "TEXT", "BOOLEAN", "{--"):
        assert click_name not in done.stdout, f"{command} --help shows {click_name}"


def test_model_help_lists_every_preset() -> None:
    from kvoffload.presets import PRESETS

    text = " ".join(shmctl("init", "--help", env={"COLUMNS": "400"}).stdout.split())
    assert all(name in text for name in PRESETS)


def test_a_dry_run_with_a_fault_says_it_injects_nothing(root: Path) -> None:
    extra = {"cpu_bytes_to_use": 8 << 20}
    config = json.dumps(
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    )
    done = shmctl(
        "init", "--root", str(root), "-n", "--kv-bytes-per-block", "65536",
        "--kv-transfer-config", config, "--fail-at", "region.populate",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == (
        "shmctl: note: a dry run injects nothing: --fail-at region.populate was checked and is shown "
        "in the plan, not fired; drop --dry-run to inject it\n"
    )
    assert os.listdir(root) == []


def test_a_real_init_shows_progress_on_a_terminal_from_the_first_moment(root: Path) -> None:
    pytest.importorskip("torch")
    extra = {"cpu_bytes_to_use": 8 << 20}
    config = json.dumps(
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    )
    argv = ["init", "--root", str(root), "--kv-bytes-per-block", "65536", "--kv-transfer-config", config]
    run = on_a_terminal(*argv, on=("stderr",), columns=120)
    assert run.code == 0
    assert "starting 1 worker(s) and the scheduler" in run.plain
    assert "starting" not in run.out  # progress never reaches the report on stdout
    assert os.listdir(root) == []


#: What the start of every command must not pay for: the torch and numpy of the data path,
#: pydantic (typer 0.29 imported it to coerce options), the Prometheus client and rich.
HEAVY = ("torch", "numpy", "pydantic", "prometheus_client", "rich", "jsonschema")


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (("--help",), {}, "Usage: shmctl"),
        (("scan", "--root", "EMPTY"), {}, "no region files"),
        (("scan", "--root", "EMPTY", "--json"), {}, '"schema_version"'),
        ((), {"COMP_WORDS": "shmctl sc", "COMP_CWORD": "1", "_SHMCTL_COMPLETE": "complete_bash"}, "scan"),
    ],
    ids=["help", "scan", "scan-json", "completion"],
)
def test_start_up_imports_nothing_heavy(
    tmp_path: Path, argv: tuple[str, ...], env: dict[str, str], expected: str
) -> None:
    argv = tuple(str(tmp_path) if a == "EMPTY" else a for a in argv)
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "shmctl", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "NO_COLOR"} | env,
    )
    assert expected in done.stdout  # the command did its work...
    imported = {
        line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")
    }
    assert "shmctl.launch" in imported  # ...and -X importtime saw its imports
    assert sorted(m for m in imported if m.split(".")[0] in HEAVY) == []


@pytest.mark.parametrize("reader_open", [True, False], ids=["reader-open", "reader-gone"])
def test_only_a_stdout_whose_reader_left_counts_as_a_closed_pipe(
    reader_open: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Any other BrokenPipeError (a participant's pipe, say) must stay an error, not a quiet 0.
    from shmctl.app import _stdout_reader_gone

    read_end, write_end = os.pipe()
    if not reader_open:
        os.close(read_end)
    with os.fdopen(write_end, "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        gone = _stdout_reader_gone()
        monkeypatch.undo()
    if reader_open:
        os.close(read_end)
    assert gone is not reader_open


def test_a_pipe_gets_every_row_and_a_terminal_the_first_fifty(root: Path, engine_id: str) -> None:
    for i in range(60):
        (root / f"vllm_offload_{engine_id}-{i:02d}.mmap").touch()
    argv = ("scan", "--root", str(root), "--grace", "1h", "--no-headers")
    assert len(shmctl(*argv).stdout.splitlines()) == 60
    shown = on_a_terminal(*argv)
    assert len(shown.plain.splitlines()) == 50
    assert "10 more region(s) not shown" in shown.err
    for path in root.iterdir():
        path.unlink()


def test_faults_no_headers_prints_one_row_per_point() -> None:
    from kvoffload.faults import REGISTRY

    rows = shmctl("faults", "--no-headers").stdout.splitlines()
    assert [row.split()[0].removesuffix(".N") for row in rows] == [p.name for p in REGISTRY]
