"""The CLI contract of ``shmctl init``: exit codes, stdout (JSON or plain text) and stderr.

Exit status: 0 the contract held / it fits / every matrix cell passed; 1 residue, orphans,
does not fit, a leaking matrix cell; 2 usage and configuration errors, before anything is
allocated; 3 an init failure that was not injected.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.bringup.plan import MAX_WORLD_SIZE
from kvoffload.bringup.residue import measure_residue
from kvoffload.liveness.reap import reap_command
from kvoffload.settings import PAGESIZE
from kvoffload.shm import mounts, names
from shmctl.app import main
from tests.support.mounts import mounted_tmpfs
from tests.support.procs import REPO, leave_orphan, write_file
from tests.support.terminal import on_a_terminal
from tests.support.traced import TRACED_ENV, needs_strace

pytest.importorskip("torch")

MIB = 1 << 20
BYTES_PER_BLOCK = str(4 * PAGESIZE)


def kv_config(engine_id: str, spec: str = "TieringOffloadingSpec", **extra: Any) -> str:
    extra_config: dict[str, Any] = {"spec_name": spec, "cpu_bytes_to_use": 4 * MIB, **extra}
    if spec == "TieringOffloadingSpec" and "secondary_tiers" not in extra:
        extra_config["secondary_tiers"] = [{"type": "example"}]
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "engine_id": engine_id,
            "kv_connector_extra_config": extra_config,
        }
    )


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def init(capsys: pytest.CaptureFixture[str], root: Path, config: str, *argv: str) -> tuple[int, str, str]:
    return run(
        capsys,
        "init",
        "--kv-transfer-config",
        config,
        "--kv-bytes-per-block",
        BYTES_PER_BLOCK,
        "--root",
        str(root),
        *argv,
    )


# ----------------------------------------------------------------- dry run


def test_dry_run_json_is_the_plan_and_exit_0_when_it_fits(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    code, out, err = init(capsys, root, kv_config(engine_id), "--world-size", "2", "--dry-run", "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["spec"] == "TieringOffloadingSpec"
    assert {"num_chunks", "kv_bytes_per_chunk", "cpu_page_size_per_worker", "row_padding"} <= doc[
        "sizing"
    ].keys()
    assert [f["path"] for f in doc["files"]] == [str(root / names.format_name(engine_id))]
    assert [t["role"] for t in doc["tiers"]] == ["primary", "secondary"]
    assert doc["stages"][0]["name"] == "validate"
    assert doc["capacity"]["fits"] is True
    assert doc["capacity"]["needed_bytes"] == 4 * MIB
    assert os.listdir(root) == []


def test_dry_run_exits_1_with_the_exact_fix_when_it_does_not_fit(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    huge = kv_config(engine_id, "CPUOffloadingSpec", cpu_bytes_to_use=1 << 50)
    code, out, err = init(capsys, root, huge, "--dry-run")
    assert (code, err) == (1, "")
    assert "DOES NOT FIT" in out
    assert "fix: " in out
    # A region bigger than the mount: a bigger mount first, never a reap (it cannot help).
    assert "fix: docker run --shm-size=" in out
    assert "shmctl reap" not in out
    assert "(docs/doctor.md#space)" in out
    assert os.listdir(root) == []


def test_dry_run_plain_text_has_every_section_and_no_box_drawing(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    code, out, _ = init(capsys, root, kv_config(engine_id), "--dry-run")
    assert code == 0
    for section in ("# sizing", "# files (1)", "# worker slots", "# tiers", "# stages"):
        assert section in out
    assert "capacity: " in out
    assert not set("┏━┃│") & set(out)


def test_dry_run_reports_how_the_root_is_mounted_as_the_library_sees_it(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    code, out, _ = init(capsys, root, kv_config(engine_id), "--dry-run", "--json")
    assert code == 0
    huge = json.loads(out)["huge_pages"]
    info = mounts.root_mount(root)
    assert info is not None
    assert (huge["mount_point"], huge["fs_type"], huge["huge"], huge["effective"]) == (
        str(info.mount_point),
        info.fs_type,
        info.huge,
        info.huge_pages,
    )
    # A 4 MiB region: huge pages do not pay off for it, so no advice (#32).
    assert huge["fix"] is None


@pytest.fixture
def tmpfs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A tmpfs mounted with the options of ``request.param`` (needs root)."""
    with mounted_tmpfs(tmp_path / "tmpfs", request.param) as point:
        yield point


@pytest.mark.root
@pytest.mark.parametrize("tmpfs", ["size=4g"], indirect=True)
def test_a_root_without_huge_pages_gets_the_remount_fix_with_the_measured_factor(
    capsys: pytest.CaptureFixture[str], tmpfs: Path, engine_id: str
) -> None:
    if mounts.read_shmem_enabled() == "force":
        pytest.skip("shmem_enabled=force gives every tmpfs huge pages on this host")
    # A region huge pages pay off for (1 GiB and up, #32); a dry run allocates none of it.
    config = kv_config(engine_id, cpu_bytes_to_use=2 << 30)
    code, out, err = init(capsys, tmpfs, config, "--dry-run")
    assert (code, err) == (0, "")
    assert f"huge pages: {tmpfs} (tmpfs): huge=never, " in out
    assert ": off: 4 KiB pages" in out
    [fix] = [line for line in out.splitlines() if line.startswith("fix: ") and "huge" in line]
    assert f"mount -o remount,huge=within_size {shlex.quote(str(tmpfs))}" in fix
    assert f"about {mounts.HUGE_PAGE_SPEEDUP:g}x faster" in fix
    assert os.listdir(tmpfs) == []


@pytest.mark.root
@pytest.mark.parametrize("tmpfs", ["size=64m,huge=within_size"], indirect=True)
def test_a_root_with_huge_pages_says_so_and_has_no_fix(
    capsys: pytest.CaptureFixture[str], tmpfs: Path, engine_id: str
) -> None:
    if mounts.read_shmem_enabled() == "deny":
        pytest.skip("shmem_enabled=deny turns huge pages off on this host")
    code, out, _ = init(capsys, tmpfs, kv_config(engine_id), "--dry-run", "--json")
    assert code == 0
    huge = json.loads(out)["huge_pages"]
    assert (huge["mount_point"], huge["huge"], huge["effective"], huge["fix"]) == (
        str(tmpfs),
        "within_size",
        "within_size",
        None,
    )
    code, out, _ = init(capsys, tmpfs, kv_config(engine_id), "--dry-run")
    assert "huge=within_size, " in out
    assert ": on (within_size)" in out


@pytest.mark.slow
def test_a_real_init_of_over_a_gib_shows_the_bytes_populated_on_a_terminal(root: Path) -> None:
    extra = {"cpu_bytes_to_use": 1100 << 20}
    config = json.dumps({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra})
    argv = ["init", "--root", str(root), "--kv-bytes-per-block", "65536", "--kv-transfer-config", config]
    run = on_a_terminal(*argv, "--no-roundtrip", on=("stderr",), columns=160)
    assert run.code == 0
    bars = [line for line in re.split(r"[\r\n]", run.plain) if "worker 0 create_worker: populate" in line]
    assert bars
    assert any(re.search(r"\b\d+\.\d/1\.1 GiB\b", line) for line in bars)
    assert "1.1/1.1 GiB" in run.plain
    assert "0/? bytes" not in run.plain  # the spinner line has no byte count
    assert "create_worker: populate" not in run.out  # progress never reaches the report on stdout
    assert os.listdir(root) == []


def test_unknown_keys_warn_on_stderr_and_run_anyway(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    config = kv_config(engine_id, "CPUOffloadingSpec", my_tier_option=1)
    code, out, err = init(capsys, root, config, "--dry-run")
    assert code == 0
    assert "shmctl: warning: unknown key 'my_tier_option'" in err
    assert "capacity: " in out


def test_model_preset_gives_the_bytes_per_block(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    config = json.dumps({"engine_id": engine_id, "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}})
    code, out, err = run(
        capsys, "init", "--kv-transfer-config", config, "--model", "llama-3-70b", "--world-size", "4",
        "--root", str(root), "--dry-run", "--json",
    )  # fmt: skip
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["geometry"]["worker_kv_bytes_per_block"] == 80 * 2 * 2 * 128 * 2 * 16


def test_config_file_in_toml_is_read_like_the_json(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str, tmp_path: Path
) -> None:
    toml = tmp_path / "engine.toml"
    toml.write_text(
        f'kv_connector = "OffloadingConnector"\nengine_id = "{engine_id}"\n'
        "[kv_connector_extra_config]\ncpu_bytes_to_use = 4194304\nblocks_per_chunk = 2\n"
    )
    args = ("--kv-bytes-per-block", BYTES_PER_BLOCK, "--root", str(root), "--dry-run", "--json")
    code, out, _ = run(capsys, "init", "--config", str(toml), *args)
    inline = json.dumps(
        {
            "engine_id": engine_id,
            "kv_connector_extra_config": {"cpu_bytes_to_use": 4194304, "blocks_per_chunk": 2},
        }
    )
    code_inline, out_inline, _ = run(capsys, "init", "--kv-transfer-config", inline, *args)
    assert code == code_inline == 0
    from_file, from_json = json.loads(out), json.loads(out_inline)
    assert from_file["sizing"] == from_json["sizing"]
    assert from_file["sizing"]["kv_bytes_per_chunk"] == 2 * 4 * PAGESIZE


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use"),
        ({"block_size": 32, "blocks_per_chunk": 2}, "block_size"),
        ({"spec_name": "NoSuchSpec"}, "spec_name"),
        ({"secondary_tiers": [{"type": "tape"}]}, "secondary_tiers[0].type"),
        ({"eviction_policy": "fifo"}, "eviction_policy"),
        ({"store_threshold": 2}, "store_threshold"),
    ],
)
def test_config_errors_exit_2_naming_the_key_before_anything_is_allocated(
    extra: dict[str, Any], key: str, capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    code, out, err = init(capsys, root, kv_config(engine_id, **extra))
    assert (code, out) == (2, "")
    assert err.startswith("shmctl: error: ")
    assert key in err
    assert err.count("\n") == 1
    assert os.listdir(root) == []


def test_malformed_json_exits_2_with_its_position(capsys: pytest.CaptureFixture[str], root: Path) -> None:
    code, out, err = init(capsys, root, '{"kv_connector_extra_config": {')
    assert (code, out) == (2, "")
    assert "malformed JSON at line 1" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--fail-at", "region.opne"), "unknown point 'region.opne'"),
        (("--fail-at", "primary", "--rank", "0"), "runs only in the scheduler"),
        (("--fail-mode", "crash"), "need --fail-at"),
        (
            ("--fail-at", "worker", "--fail-mode", "raise", "--fail-mode", "crash"),
            "several only with --matrix",
        ),
        (("--fail-at", "worker", "--fail-mode", "explode"), "unknown mode 'explode'"),
        (("--include-crash",), "only with --matrix"),
        (("--matrix", "--dry-run"), "cannot be combined"),
        (("--lifetime", "forever"), "--lifetime"),
    ],
)
def test_usage_errors_exit_2_with_one_line(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    code, out, err = init(capsys, root, kv_config(engine_id), *argv)
    assert (code, out) == (2, "")
    assert message in err
    assert os.listdir(root) == []


@pytest.mark.parametrize(
    ("world_size", "mode"),
    [
        (MAX_WORLD_SIZE + 1, ("--dry-run",)),
        (10_000_000, ("--dry-run",)),
        (10_000_000, ()),
        (10_000_000, ("--matrix",)),
    ],
    ids=["just-over", "dry-run", "bring-up", "matrix"],
)
def test_a_world_size_beyond_one_engine_is_a_usage_error_before_any_work(
    world_size: int, mode: tuple[str, ...], capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    """Ten million workers once planned for 38 s into a MemoryError. The budget is big enough
    for a chunk of MAX_WORLD_SIZE + 1 workers, so only the bound can refuse that one."""
    config = kv_config(engine_id, "CPUOffloadingSpec", cpu_bytes_to_use=64 * MIB)
    code, out, err = init(capsys, root, config, "--world-size", str(world_size), *mode)
    assert (code, out) == (2, "")
    assert err.startswith(
        f"shmctl: error: --world-size: {world_size} is more than the {MAX_WORLD_SIZE} workers one engine "
        f"can have (fix: give one engine's tensor x pipeline parallel size, at most {MAX_WORLD_SIZE}; "
    )
    assert err.count("\n") == 1
    assert os.listdir(root) == []


def test_the_largest_world_size_still_plans(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    config = kv_config(engine_id, "CPUOffloadingSpec", cpu_bytes_to_use=MAX_WORLD_SIZE * 4 * PAGESIZE)
    code, out, err = init(capsys, root, config, "--world-size", str(MAX_WORLD_SIZE), "--dry-run", "--json")
    assert (code, err) == (0, "")
    assert len(json.loads(out)["layout"]["slots"]) == MAX_WORLD_SIZE


# ----------------------------------------------------------------- bring-up


def test_injected_failure_json_has_stages_fault_error_cleanup_and_residue_and_exit_0(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    code, out, err = init(
        capsys, root, kv_config(engine_id), "--world-size", "2", "--fail-at", "secondary", "--json"
    )
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["verdict"] == "contract-held"
    assert doc["fault"]["stages"] == ["secondary"]
    assert doc["fault"]["fired_in"] == ["scheduler"]
    error = doc["error"]
    assert (error["type"], error["injected"], error["point"]) == ("InjectedFault", True, "secondary")
    assert error["message"] == "injected fault at secondary"
    assert sorted(s["participant"] for s in doc["stages"] if s["name"] == "create_worker") == [
        "worker 0",
        "worker 1",
    ]
    steps = [c["what"] for c in doc["cleanup"]]
    assert "shut down primary tier" in steps
    assert doc["residue"] == {"paths": [], "bytes": 0, "size_bytes": 0, "files": []}


def test_plain_report_tells_the_story_in_sections(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    code, out, err = init(
        capsys, root, kv_config(engine_id, "CPUOffloadingSpec"), "--fail-at", "region.populate"
    )
    assert (code, err) == (0, "")
    assert "# stages" in out
    assert "failed at region.populate" in out
    assert "error: InjectedFault: injected fault at region.populate" in out
    assert "# cleanup (in the order it ran)" in out
    assert f"residue: none ({root} holds no file of engine {engine_id})" in out
    assert "verdict: contract-held" in out


def test_a_skipped_release_exits_1_and_lists_the_residue(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVOFFLOAD_INIT_SKIP_RELEASE", "worker")
    code, out, err = init(capsys, root, kv_config(engine_id), "--fail-at", "scheduler.region")
    left = root / names.format_name(engine_id)
    assert (code, err) == (1, "")
    assert "# residue: 1 file(s), 4.0 MiB resident" in out
    assert str(left) in out
    assert "verdict: leaked" in out
    left.unlink()


def test_init_failing_for_a_reason_not_injected_exits_3(
    capsys: pytest.CaptureFixture[str],
    root: Path,
    engine_id: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An out-of-tree secondary tier whose backend is unreachable: a real failure, reported as one."""
    (tmp_path / "kvtest_broken_tier.py").write_text(
        "from kvoffload.tiering.example.manager import ExampleSecondaryTierManager\n"
        "class BrokenTier(ExampleSecondaryTierManager):\n"
        "    def __init__(self, offloading_spec, primary_kv_view, tier_type, **options):\n"
        "        raise RuntimeError('tier backend unreachable')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    tiers = [{"type": "BrokenTier", "module_path": "kvtest_broken_tier"}]
    code, out, _err = init(capsys, root, kv_config(engine_id, secondary_tiers=tiers), "--json")
    assert code == 3
    doc = json.loads(out)
    assert doc["verdict"] == "failed"
    error = doc["error"]
    assert (error["type"], error["message"], error["injected"]) == (
        "RuntimeError",
        "tier backend unreachable",
        False,
    )
    assert (error["participant"], error["stage"]) == ("scheduler", "get_manager")
    assert doc["residue"]["paths"] == []


def test_crash_names_its_orphans_and_the_reap_command_that_removes_them(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    """vLLM's tiering lifetime keeps the path while the engine lives, so the crash leaves it."""
    config = kv_config(engine_id)
    code, out, err = init(
        capsys, root, config, "--lifetime", "vllm", "--fail-at", "secondary", "--fail-mode", "crash"
    )
    assert (code, err) == (1, "")
    assert "these files are orphans now; remove them with:" in out
    command = f"shmctl reap --root {root} --engine {engine_id} --grace 0 --yes"
    assert command in out
    code, out, err = run(capsys, "scan", "--root", str(root), "--grace", "0", "--json")
    assert (code, err) == (1, "")
    assert [(e["engine_id"], e["status"]) for e in json.loads(out)["entries"]] == [(engine_id, "orphaned")]
    code, out, err = run(capsys, *command.split()[1:])
    assert (code, err) == (0, "")
    assert os.listdir(root) == []


def argv_in_bash(command: str) -> list[bytes]:
    """The arguments bash passes to ``shmctl`` when it reads ``command``."""
    shell = 'shmctl() { printf "%s\\0" "$@"; }; ' + command
    done = subprocess.run(["bash", "-c", shell], capture_output=True, check=True)
    return done.stdout.split(b"\0")[:-1]


def reap_argv(root: Path, engine_id: str) -> list[bytes]:
    # --engine takes a glob: the id's own glob characters arrive escaped ('*' as '[*]'),
    # so the pattern matches this id and no other.
    engine = glob.escape(engine_id).encode("utf-8", "surrogateescape")
    return [b"reap", b"--root", os.fsencode(root), b"--engine", engine, b"--grace", b"0", b"--yes"]


#: Engine ids are anything but '/' and NUL: quotes, spaces, a command substitution, controls,
#: an invisible character and a byte that is not UTF-8.
ODD_IDS = [" it's $(touch pwned) *", "\tnew\nline\x1b[31m", "\u200bzero-width", "bad\udcffbyte"]


@pytest.mark.parametrize("odd", ODD_IDS, ids=["quotes", "controls", "invisible", "not-utf-8"])
def test_the_reap_command_gives_bash_the_root_and_engine_id_exactly_in_visible_characters(
    odd: str, root: Path, engine_id: str, tmp_path: Path
) -> None:
    where = root / "shm root's dir"
    command = reap_command(where, engine_id + odd)
    assert command.isprintable()
    assert argv_in_bash(command) == reap_argv(where, engine_id + odd)
    assert not (tmp_path / "pwned").exists()


def identity(path: Path) -> tuple[int, int, int, int]:
    """What a reap that touched ``path`` (unlinked, truncated, chmod-ed, wrote to it) changes."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@pytest.mark.parametrize("output", ["json", "plain", "terminal"])
def test_the_reap_command_a_crash_prints_removes_its_files_as_printed_and_nothing_else(
    output: str, root: Path, engine_id: str, tmp_path: Path
) -> None:
    """Copied from the report into a shell, the command removes exactly what the crash left.

    vLLM's lifetime keeps the path while the engine lives, so the crash leaves the region; its
    root and engine id need quoting. A bystander orphan of another engine and a file that is
    no region must come through untouched.
    """
    where = root / "shm root's dir"
    where.mkdir()
    crashed = f"{engine_id} it's $(touch pwned)\tnew\nline"
    bystanders = [leave_orphan(where, f"{engine_id}-bystander"), write_file(where / "notes.txt")]
    before = [identity(p) for p in bystanders]
    argv = [sys.executable, "-m", "shmctl", "init", "--kv-transfer-config", kv_config(crashed)]
    argv += ["--kv-bytes-per-block", BYTES_PER_BLOCK, "--root", str(where), "--lifetime", "vllm"]
    argv += ["--fail-at", "secondary", "--fail-mode", "crash"]
    if output == "terminal":
        shown = on_a_terminal(*argv[3:], columns=60)  # argv[:3]: python -m shmctl
        code, out = shown.code, shown.plain
    else:
        done = subprocess.run(
            argv + (["--json"] if output == "json" else []),
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
        )
        code, out = done.returncode, done.stdout
    assert code == 1, out
    left = measure_residue(where, crashed).paths
    assert left == (where / names.format_name(crashed),)
    if output == "json":
        printed = json.loads(out)["crash"]["reap_command"]
    else:
        lines = [line.strip() for line in out.splitlines()]
        printed = lines[lines.index("these files are orphans now; remove them with:") + 1]
    assert argv_in_bash(printed) == reap_argv(where, crashed)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    done = subprocess.run(
        ["bash", "-c", printed],
        cwd=tmp_path,
        check=False,
        env={**os.environ, "PATH": path},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert measure_residue(where, crashed).paths == (), done.stdout
    assert [identity(p) for p in bystanders] == before
    assert sorted(os.listdir(where)) == sorted(p.name for p in bystanders)
    assert not (tmp_path / "pwned").exists()


def test_hold_keeps_the_engine_up_until_ctrl_c_then_tears_it_down(root: Path, engine_id: str) -> None:
    """Ctrl-C reaches the whole process group; only the orchestrator acts on it."""
    argv = [sys.executable, "-m", "shmctl", "init", "--kv-transfer-config", kv_config(engine_id)]
    argv += [
        "--kv-bytes-per-block",
        BYTES_PER_BLOCK,
        "--root",
        str(root),
        "--lifetime",
        "vllm",
        "--hold",
        "--json",
    ]
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stderr is not None
        announced = [proc.stderr.readline() for _ in range(4)]
        assert announced[0].startswith(f"engine {engine_id} is up: worker 0 pid ")
        assert str(root / names.format_name(engine_id)) in announced[1]
        assert os.listdir(root) == [names.format_name(engine_id)]
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    doc = json.loads(out)
    assert doc["verdict"] == "ok"
    assert doc["held_s"] > 0
    assert os.listdir(root) == []


def _processes_created(trace: str) -> list[str]:
    """The fork/vfork/clone calls of an ``strace -f`` log that made a process (not a thread)."""
    calls = re.compile(r"^\d+\s+(fork|vfork|clone3?)\(")
    return [line for line in trace.splitlines() if calls.match(line) and "CLONE_THREAD" not in line]


@needs_strace
@pytest.mark.parametrize(
    "argv",
    [(), ("--fail-at", "secondary"), ("--hold",), ("--json",)],
    ids=["bring-up", "fail-at", "hold", "json"],
)
def test_a_real_init_the_root_cannot_hold_is_one_line_exit_3_before_any_process_or_file(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str], tmp_path: Path, engine_id: str
) -> None:
    """The dry run's capacity rule, applied before a worker exists: what is needed, what is
    free, where, and the dry run's own fix; no process started, nothing created in the root."""
    with mounted_tmpfs(tmp_path / "shm", "size=8m") as shm:
        config = kv_config(engine_id, cpu_bytes_to_use=16 * MIB)
        code, out, _ = init(capsys, shm, config, "--dry-run", "--json")
        capacity = json.loads(out)["capacity"]
        assert (code, capacity["fits"]) == (1, False)
        trace = tmp_path / "strace.log"
        strace = ["strace", "-f", "-qq", "-o", str(trace), "-e", "trace=fork,vfork,clone,clone3"]
        shmctl = [sys.executable, "-m", "shmctl", "init", "--kv-transfer-config", config]
        done = subprocess.run(
            [*strace, *shmctl, "--kv-bytes-per-block", BYTES_PER_BLOCK, "--root", str(shm), *argv],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=TRACED_ENV,
            timeout=120,
            check=False,
        )
        assert (done.returncode, done.stdout) == (3, "")
        assert done.stderr == (
            f"shmctl: error: {shm}: 8.0 MiB free of 8.0 MiB (tmpfs), the region needs 16.0 MiB: "
            f"it does not fit; nothing was started (fix: {capacity['fix']})\n"
        )
        assert _processes_created(trace.read_text()) == []
        assert os.listdir(shm) == []
        assert os.statvfs(shm).f_bfree == os.statvfs(shm).f_blocks


# ----------------------------------------------------------------- matrix


def test_matrix_json_has_one_object_per_cell_and_exit_0(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    config = kv_config(engine_id, "CPUOffloadingSpec")
    code, out, err = init(
        capsys, root, config, "--matrix", "--fail-at", "region.mmap", "--fail-at", "worker", "--json"
    )
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert [(c["stage"], c["mode"]) for c in doc["cells"]] == [
        (stage, mode)
        for stage in ("region.mmap", "worker")
        for mode in ("raise", "oserror:EFAULT", "cleanup-raise")
    ]
    assert all(c["passed"] and c["residue"]["bytes"] == 0 for c in doc["cells"])
    assert (doc["passed"], doc["failed"], doc["leaked"]) == (6, 0, 0)


def test_matrix_exits_1_when_a_cell_leaks(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVOFFLOAD_INIT_SKIP_RELEASE", "worker")
    config = kv_config(engine_id)
    code, out, err = init(
        capsys, root, config, "--matrix", "--fail-at", "scheduler.region", "--fail-mode", "raise"
    )
    assert (code, err) == (1, "")
    (row,) = [line.split() for line in out.splitlines() if line.startswith("scheduler.region ")]
    assert row[:5] == ["scheduler.region", "raise", "leaked", "FAIL", "4194304"]
    assert "0 passed, 1 failed, 1 leaked" in out
    for leftover in os.listdir(root):
        (root / leftover).unlink()


# ----------------------------------------------------------------- start-up cost


def test_importing_the_init_command_loads_neither_torch_nor_numpy_nor_multiprocessing() -> None:
    probe = (
        "import sys, shmctl.app, shmctl.commands.init, shmctl.render.init;"
        "print(sorted(m for m in ('torch', 'numpy', 'multiprocessing') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True)
    assert done.stdout.strip() == "[]"


def test_an_engine_id_with_control_characters_cannot_forge_report_lines(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    code, out, _ = init(capsys, root, kv_config(f"{engine_id}\nforged\tline"), "--dry-run")
    assert code == 0
    assert not any(line.startswith("forged") for line in out.splitlines())
    assert f"{engine_id}\\nforged\\tline" in out
