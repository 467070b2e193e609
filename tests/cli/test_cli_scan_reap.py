"""The CLI contract of ``shmctl scan`` and ``shmctl reap``: JSON shape, exit codes, streams."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.durations import parse_duration
from kvoffload.errors import ConfigError
from shmctl.app import main
from tests.support.procs import (
    REPO,
    Child,
    leave_orphan,
    region_path,
    uninspectable_pids,
    vouch_args,
    write_file,
)
from tests.support.terminal import on_a_terminal

STATUSES = {"live", "orphaned", "starting", "unknown", "skipped"}
ENTRY_KEYS = {
    "name",
    "path",
    "engine_id",
    "segment",
    "status",
    "reason",
    "size_bytes",
    "resident_bytes",
    "uid",
    "age_s",
    "holders",
    "owner",
}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_scan_json_is_one_document_with_entries_and_summary_and_exit_1_for_orphans(
    root: Path, engine_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    orphan = leave_orphan(root, engine_id, mode="region")
    with Child("map-only", write_file(region_path(root, engine_id + "-live"))) as child:
        code, out, err = run(capsys, "scan", "--root", str(root), "--grace", "0", "--json")
    assert (code, err) == (1, "")
    doc = json.loads(out)
    assert {"root", "entries", "summary"} <= doc.keys()
    assert doc["root"] == str(root)
    by_name = {e["name"]: e for e in doc["entries"]}
    for e in doc["entries"]:
        assert e.keys() >= ENTRY_KEYS
        assert e["status"] in STATUSES
    dead, live = by_name[orphan.name], by_name[region_path(root, engine_id + "-live").name]
    assert (dead["status"], dead["segment"], dead["engine_id"]) == ("orphaned", 0, engine_id)
    assert dead["owner"]["alive"] is False
    assert isinstance(dead["owner"]["pid"], int)
    assert live["status"] == "live"
    assert live["holders"] == [{"pid": child.pid, "name": live["holders"][0]["name"], "via": ["map"]}]
    assert live["owner"] is None
    summary = doc["summary"]
    assert {s: summary[s] for s in STATUSES} == {
        "live": 1,
        "orphaned": 1,
        "starting": 0,
        "unknown": 0,
        "skipped": 0,
    }
    assert summary["orphaned_resident_bytes"] == dead["resident_bytes"] > 0


def test_scan_exits_0_when_nothing_is_orphaned(
    root: Path, engine_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    write_file(region_path(root, engine_id))
    code, out, _ = run(capsys, "scan", "--root", str(root), "--json")  # default grace: starting
    assert code == 0
    assert json.loads(out)["summary"]["starting"] == 1


def test_scan_off_a_terminal_prints_aligned_columns_and_a_summary(
    root: Path, engine_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    leave_orphan(root, engine_id)
    code, out, err = run(capsys, "scan", "--root", str(root), "--grace", "0")
    assert (code, err) == (1, "")
    lines = out.splitlines()
    columns = ["STATUS", "ENGINE", "FILES", "SIZE", "RESIDENT", "CHANGED", "HOLDERS", "REASON"]
    assert lines[0].split() == columns
    assert lines[1].split()[:3] == ["orphaned", engine_id, "1"]
    assert lines[1].index(engine_id) == lines[0].index("ENGINE")
    assert lines[-1].startswith(f"1 region file(s) in {root}: 1 orphaned; orphans pin ")
    assert "\x1b" not in out
    assert "\t" not in out


def test_the_root_comes_from_shmctl_root(
    root: Path,
    engine_id: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    leave_orphan(root, engine_id)
    monkeypatch.setenv("SHMCTL_ROOT", str(root))
    code, out, _ = run(capsys, "scan", "--grace", "0s", "--json")
    assert code == 1
    assert json.loads(out)["root"] == str(root)


def test_unknown_files_come_with_a_warning_on_stderr(
    root: Path, engine_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if not uninspectable_pids():
        pytest.skip("every process on this machine can be inspected")
    leave_orphan(root, engine_id)
    code, out, err = run(capsys, "scan", "--root", str(root), "--grace", "0", "--json", "--no-lease")
    assert code == 0
    assert json.loads(out)["summary"]["unknown"] == 1
    assert err.startswith("shmctl: warning: could not inspect ")
    assert "drop --no-lease" in err


def test_a_bad_duration_is_a_usage_error_naming_the_option(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "scan", "--root", str(root), "--grace", "soon")
    assert (code, out) == (2, "")
    assert err.startswith("shmctl: error: --grace: 'soon' is not a duration")
    assert err.count("\n") == 1


def test_a_missing_root_is_a_runtime_error_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "scan", "--root", str(tmp_path / "nope"))
    assert (code, out) == (3, "")
    assert err == (  # named as it was given (#32)
        f"shmctl: error: --root {tmp_path / 'nope'}: does not exist (fix: pass the directory that holds "
        "the region files as --root, or leave it out for /dev/shm)\n"
    )


def test_scan_deleted_lists_unlinked_regions_still_mapped(
    root: Path, engine_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = region_path(root, engine_id)
    with Child("vllm", path, 2 * 4096) as child:
        path.unlink()
        code, out, _ = run(capsys, "scan", "--root", str(root), "--deleted")
        _, doc, _ = run(capsys, "scan", "--root", str(root), "--json")
    assert code == 0
    header = next(line for line in out.splitlines() if line.split()[:2] == ["PID", "PROCESS"])
    row = next(line for line in out.splitlines() if line.split()[:1] == [str(child.pid)])
    assert header.split() == ["PID", "PROCESS", "MAPPED", "VIA", "PATH"]
    assert row.endswith(f"  {path}")
    deleted = [d for d in json.loads(doc)["deleted"] if d["pid"] == child.pid]
    assert [(d["path"], d["mapped_bytes"], d["engine_id"]) for d in deleted] == [(str(path), 8192, engine_id)]


def test_reap_without_yes_off_a_terminal_refuses_and_removes_nothing(
    root: Path, engine_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    orphan = leave_orphan(root, engine_id)
    code, out, err = run(capsys, "reap", "--root", str(root), "--grace", "0")
    assert (code, out) == (2, "")
    assert "refusing to remove files without confirmation" in err
    assert "--yes" in err
    assert orphan.exists()


def test_reap_dry_run_json_shows_what_would_go(
    root: Path, engine_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    orphan = leave_orphan(root, engine_id)
    code, out, err = run(capsys, "reap", "--root", str(root), "--grace", "0", "--dry-run", "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert {"removed", "kept", "freed_bytes", "dry_run"} <= doc.keys()
    assert doc["dry_run"] is True
    assert [e["name"] for e in doc["removed"]] == [orphan.name]
    assert doc["freed_bytes"] == doc["removed"][0]["resident_bytes"]
    assert orphan.exists()


def test_reap_yes_removes_orphans_keeps_live_and_reports_bytes(
    root: Path, engine_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    orphan = leave_orphan(root, engine_id)
    live = region_path(root, engine_id + "-live")
    with Child("vllm", live):
        code, out, err = run(capsys, "reap", "--root", str(root), "--grace", "0", "--yes", "--json")
        assert live.exists()
    live.unlink()
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["dry_run"] is False
    assert [e["name"] for e in doc["removed"]] == [orphan.name]
    assert doc["kept"] == []
    assert doc["freed_bytes"] > 0
    assert not orphan.exists()


def test_reap_text_output_names_each_region_and_the_total(
    root: Path, engine_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    orphan = leave_orphan(root, engine_id)
    code, out, _ = run(capsys, "reap", "--root", str(root), "--grace", "0", "-y", "--engine", engine_id)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["RESULT", "ENGINE", "FILES", "SIZE", "RESIDENT", "REASON"]
    assert lines[1].split()[:3] == ["removed", engine_id, "1"]
    assert lines[-1].startswith("removed 1 file(s), freed ")
    assert not orphan.exists()


def test_reap_with_nothing_to_do_says_so(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "reap", "--root", str(root), "--yes")
    assert code == 0
    assert out == f"nothing to reap: no region files in {root}\n"


@pytest.mark.root
def test_all_users_as_non_root_is_a_usage_error(root: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to uid 65534")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become nobody and run the CLI in-process; report code and stderr
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            sys.stderr = open(write_end, "w", closefd=False)  # noqa: SIM115
            code = main(["scan", "--root", str(root), "--all-users"])
            sys.stderr.write(f"exit={code}\n")
            sys.stderr.flush()
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        text = f.read()
    os.waitpid(pid, 0)
    assert text.startswith("shmctl: error: --all-users: only root may judge other users' files")
    assert text.endswith("exit=2\n")


def test_reap_on_a_terminal_asks_and_removes_only_after_yes(root: Path, engine_id: str) -> None:
    orphan = leave_orphan(root, engine_id)
    argv = ["reap", "--root", str(root), "--grace", "0"]
    everything = ("stdin", "stdout", "stderr")
    declined = on_a_terminal(*argv, on=everything, answer=b"n\n", columns=200)
    assert declined.code == 0
    assert "Remove 1 orphaned file(s)" in declined.text
    assert "nothing removed" in declined.text
    assert orphan.exists()
    confirmed = on_a_terminal(*argv, on=everything, answer=b"y\n", columns=200)
    assert confirmed.code == 0
    assert "removed 1 file(s)" in confirmed.text
    assert not orphan.exists()


def test_a_table_of_many_regions_is_cut_to_the_limit_on_a_terminal(root: Path, engine_id: str) -> None:
    for i in range(12):
        write_file(region_path(root, f"{engine_id}-{i}"))
    shown = on_a_terminal(
        "scan", "--root", str(root), "--grace", "0", "--limit", "5", on=("stdout", "stderr")
    )
    assert shown.code == 1
    assert "7 more region(s) not shown" in shown.text
    assert "\x1b[" in shown.text  # colour on a terminal
    assert "12 region file(s)" in shown.text


def test_scan_and_reap_never_import_numpy_or_torch(root: Path, engine_id: str) -> None:
    leave_orphan(root, engine_id)
    code = (
        "import sys; from shmctl.app import main; "
        "codes = [main(['scan', *sys.argv[1:]]), main(['reap', '--yes', *sys.argv[1:]])]; "
        "print([int(c) for c in codes], sorted(m for m in ('numpy', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "--root", str(root), "--grace", "0", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.splitlines()[-1] == "[1, 0] []"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30),
        ("5m", 300),
        ("2h", 7200),
        ("1d", 86400),
        ("1h30m", 5400),
        ("90", 90),
        ("1.5h", 5400),
        ("0", 0),
        ("250ms", 0.25),
        (" 2m 30s ", 150),
    ],
)
def test_durations_read_like_an_operator_types_them(text: str, seconds: float) -> None:
    assert parse_duration(text, option="--grace") == seconds


@pytest.mark.parametrize("text", ["", "-5s", "5x", "30m1h", "1h1h", "h", "nan", "1e3"])
def test_a_bad_duration_names_its_option(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^--older-than: ") as info:
        parse_duration(text, option="--older-than")
    assert info.value.fix is not None
    assert "1h30m" in info.value.fix


def test_vouched_processes_are_reported_but_not_named_as_blind_spots(
    root: Path, engine_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if not uninspectable_pids():
        pytest.skip("every process on this machine can be inspected")
    leave_orphan(root, engine_id)
    code, out, err = run(
        capsys, "scan", "--root", str(root), "--grace", "0", "--json", "--no-lease", *vouch_args()
    )
    doc = json.loads(out)
    assert code == 1
    assert doc["assumed_not_holding"] == sorted(uninspectable_pids())
    assert {u["pid"] for u in doc["uninspected"]} >= set(uninspectable_pids())
    assert "could not inspect" not in err


def test_reap_names_who_holds_the_live_region_it_kept(
    root: Path, engine_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A restart that does not fit waits on a live region: reap says whose, not just how many."""
    orphan = leave_orphan(root, engine_id + "-dead")
    with Child("map-only", write_file(region_path(root, engine_id + "-live"))) as child:
        code, out, err = run(capsys, "reap", "--root", str(root), "--grace", "0", "--yes")
        assert (code, err) == (0, "")  # a healthy node's cron reap stays quiet on stderr
        [summary] = [line for line in out.splitlines() if line.startswith("removed 1 file(s)")]
        assert f"; live: {engine_id}-live: held by 1 process(es): {child.pid}:" in summary
        code, out, _ = run(capsys, "reap", "--root", str(root), "--grace", "0", "--yes", "--json")
    assert not orphan.exists()
    [live] = json.loads(out)["live"]
    assert (live["engine_id"], [h["pid"] for h in live["holders"]]) == (f"{engine_id}-live", [child.pid])
