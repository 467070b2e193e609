"""``shmctl init --json`` in its three forms validates against its shipped schema, on real output.

``--dry-run`` prints the plan (``init-plan``), a bring-up its report (``init``), ``--matrix``
the matrix report (``init-matrix``). Every document here comes from the real CLI in a
subprocess, with real participant processes and real files in a private root on /dev/shm:
a bring-up that succeeds, injected faults that fire in the scheduler, in the workers and in
a release step, a crash whose orphans exist until the reap command it prints removes them,
and a matrix with crash cells (recovered by the matrix's own scan and reap) and one that
stops early. The schemas forbid unknown fields and require every field, so a field added,
renamed or dropped in a report dataclass without its schema fails here.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvoffload.bringup.plan import SCHEMA_VERSION as PLAN_SCHEMA_VERSION
from kvoffload.bringup.plan import (
    Capacity,
    Geometry,
    InitPlan,
    PlannedFile,
    PlanStage,
    SlotLayout,
    TierPlan,
    WorkerSlot,
)
from kvoffload.bringup.report import SCHEMA_VERSION as REPORT_SCHEMA_VERSION
from kvoffload.bringup.report import (
    CleanupStep,
    CrashInfo,
    ErrorInfo,
    InitReport,
    InjectedFaultInfo,
    KeptFile,
    LogLine,
    MatrixCell,
    MatrixReport,
    MatrixStop,
    StageResult,
)
from kvoffload.bringup.residue import HeldHandle, Residue, ResidueFile
from kvoffload.settings import PAGESIZE, OffloadingSizing
from kvoffload.shm import names
from kvoffload.shm.mounts import HugePages
from tests.support.procs import REPO, TEST_TAG, Child, shm_dir
from tests.support.schemas import schema, validate

#: A real bring-up's and a real matrix's documents are made once per worker: the tests that read
#: them run on one (make pytest runs on several).
SHARES_A_BRING_UP = pytest.mark.xdist_group("init-documents")

MIB = 1 << 20
BYTES_PER_BLOCK = str(4 * PAGESIZE)
CPU, TIERING = "CPUOffloadingSpec", "TieringOffloadingSpec"
INIT_SCHEMAS = ("init-plan", "init", "init-matrix")

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="a bring-up's workers need torch"
)


def kv_config(engine_id: str, spec: str = TIERING, **extra: Any) -> str:
    extra_config: dict[str, Any] = {"spec_name": spec, "cpu_bytes_to_use": 4 * MIB, **extra}
    if spec == TIERING and "secondary_tiers" not in extra:
        extra_config["secondary_tiers"] = [{"type": "example"}]
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "engine_id": engine_id,
            "kv_connector_extra_config": extra_config,
        }
    )


def init(root: Path, config: str, *argv: str) -> tuple[int, Any]:
    """``shmctl init ... --json`` in a subprocess: its exit status and its stdout, parsed."""
    done = subprocess.run(
        [sys.executable, "-m", "shmctl", "init", "--kv-transfer-config", config,
         "--kv-bytes-per-block", BYTES_PER_BLOCK, "--root", str(root), *argv, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=REPO,
    )  # fmt: skip
    assert done.stdout.count("\n") == 1, done.stderr  # one document, one line (not a terminal)
    return done.returncode, json.loads(done.stdout)


def new_engine_id() -> str:
    return f"{TEST_TAG}{uuid.uuid4().hex[:12]}"


# ----------------------------------------------------------------- documents shared by tests


@pytest.fixture(scope="module")
def plan_doc() -> dict[str, Any]:
    """A real dry-run plan: tiering, two workers, two secondary tiers."""
    with shm_dir() as where:
        config = kv_config(new_engine_id(), secondary_tiers=[{"type": "example"}, {"type": "example"}])
        code, doc = init(where, config, "--world-size", "2", "--dry-run")
        left = os.listdir(where)
    assert (code, left) == (0, [])
    return dict(doc)


@pytest.fixture(scope="module")
def report_doc() -> dict[str, Any]:
    """A real bring-up that succeeds: tiering, two workers and the scheduler, a round trip."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("a bring-up's workers need torch")
    with shm_dir() as where:
        code, doc = init(where, kv_config(new_engine_id()), "--world-size", "2")
        left = os.listdir(where)
    assert (code, left) == (0, [])
    return dict(doc)


@pytest.fixture(scope="module")
def matrix_doc() -> dict[str, Any]:
    """A real matrix: vLLM's tiering lifetime, so the crash cells leave orphans to scan and reap."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("a bring-up's workers need torch")
    with shm_dir() as where:
        argv = ["--lifetime", "vllm", "--matrix", "--fail-at", "validate", "--fail-at", "worker"]
        code, doc = init(where, kv_config(new_engine_id()), *argv, "--include-crash")
        left = os.listdir(where)
    assert (code, left) == (0, [])
    return dict(doc)


# ----------------------------------------------------------------- the schemas themselves


def test_the_init_schemas_are_valid_draft_2020_12_with_their_ids_and_the_librarys_versions() -> None:
    versions = {
        "init-plan": PLAN_SCHEMA_VERSION,
        "init": REPORT_SCHEMA_VERSION,
        "init-matrix": REPORT_SCHEMA_VERSION,
    }
    for name in INIT_SCHEMAS:
        loaded = schema(name)
        assert loaded["$id"] == f"urn:shmctl:schema:{name}"
        assert loaded["properties"]["schema_version"] == {"const": versions[name]}


#: Every dataclass of the three documents and the schema object it is serialised as.
SHAPES = [
    ("init-plan", None, InitPlan),
    ("init-plan", "geometry", Geometry),
    ("init-plan", "sizing", OffloadingSizing),
    ("init-plan", "file", PlannedFile),
    ("init-plan", "slot", WorkerSlot),
    ("init-plan", "layout", SlotLayout),
    ("init-plan", "tier", TierPlan),
    ("init-plan", "stage", PlanStage),
    ("init-plan", "capacity", Capacity),
    ("init-plan", "huge_pages", HugePages),
    ("init", None, InitReport),
    ("init", "error", ErrorInfo),
    ("init", "stage_result", StageResult),
    ("init", "cleanup_step", CleanupStep),
    ("init", "held_handle", HeldHandle),
    ("init", "log_line", LogLine),
    ("init", "residue_file", ResidueFile),
    ("init", "residue", Residue),
    ("init", "fault", InjectedFaultInfo),
    ("init", "crash", CrashInfo),
    ("init-matrix", None, MatrixReport),
    ("init-matrix", "cell", MatrixCell),
    ("init-matrix", "stop", MatrixStop),
    ("init-matrix", "kept_file", KeptFile),
]


@pytest.mark.parametrize(
    ("name", "definition", "cls"), SHAPES, ids=[f"{n}:{d or 'document'}" for n, d, _ in SHAPES]
)
def test_every_dataclass_field_is_a_required_property_of_its_schema_object(
    name: str, definition: str | None, cls: type[Any]
) -> None:
    """Also for the shapes a short run rarely fills (a matrix stopped for capacity, held handles)."""
    where = schema(name) if definition is None else schema(name)["$defs"][definition]
    fields = [f.name for f in dataclasses.fields(cls)]
    assert where["additionalProperties"] is False
    assert list(where["properties"]) == fields
    assert where["required"] == fields


# ----------------------------------------------------------------- init --dry-run


@pytest.mark.parametrize(
    ("spec", "extra", "argv", "code"),
    [
        (
            TIERING,
            {"secondary_tiers": [{"type": "example"}, {"type": "example", "note": "second"}]},
            ("--world-size", "2", "--fail-at", "secondary.1", "--fail-mode", "raise", "--rank", "scheduler"),
            0,
        ),
        (CPU, {}, ("--world-size", "2", "--fail-at", "region.populate", "--fail-mode", "oserror:ENOSPC"), 0),
        (CPU, {"cpu_bytes_to_use": 1 << 50}, ("--fail-at", "worker"), 1),
    ],
    ids=["tiering-2-secondaries", "cpu-only", "cpu-does-not-fit"],
)
def test_the_dry_run_plan_matches_its_schema(
    root: Path, engine_id: str, spec: str, extra: dict[str, Any], argv: tuple[str, ...], code: int
) -> None:
    got, doc = init(root, kv_config(engine_id, spec, **extra), "--dry-run", *argv)
    assert got == code
    validate(doc, "init-plan")
    stages = [s["name"] for s in doc["stages"]]
    if spec == TIERING:
        assert [(t["role"], t["index"]) for t in doc["tiers"]] == [
            ("primary", 0),
            ("secondary", 0),
            ("secondary", 1),
        ]
        assert {"secondary.1", "cleanup.secondary.1"} <= set(stages)
    else:
        assert doc["tiers"] == []
        assert "scheduler.region" not in stages
    assert doc["capacity"]["fits"] is (code == 0)
    assert (doc["capacity"]["fix"] is None) is (code == 0)
    assert os.listdir(root) == []


# ----------------------------------------------------------------- init (a bring-up)


@needs_torch
@SHARES_A_BRING_UP
def test_a_bring_up_that_succeeds_matches_its_schema(report_doc: dict[str, Any]) -> None:
    assert (report_doc["verdict"], report_doc["fault"], report_doc["error"]) == ("ok", None, None)
    assert {s["participant"] for s in report_doc["stages"]} == {"worker 0", "worker 1", "scheduler"}
    assert "roundtrip" in {s["name"] for s in report_doc["stages"]}
    validate(report_doc, "init")


@needs_torch
@pytest.mark.parametrize(
    ("spec", "argv", "point", "fired_in"),
    [
        (TIERING, ("--fail-mode", "raise", "--rank", "scheduler"), "secondary", ["scheduler"]),
        (CPU, ("--fail-mode", "oserror:ENOSPC"), "region.populate", ["worker 0", "worker 1"]),
        (TIERING, ("--fail-mode", "raise"), "cleanup.secondary.0", ["scheduler"]),
    ],
    ids=["secondary-raise", "populate-oserror", "release-step-raise"],
)  # fmt: skip
def test_a_bring_up_with_an_injected_fault_matches_its_schema(
    root: Path, engine_id: str, spec: str, argv: tuple[str, ...], point: str, fired_in: list[str]
) -> None:
    code, doc = init(root, kv_config(engine_id, spec), "--world-size", "2", "--fail-at", point, *argv)
    assert (code, doc["verdict"]) == (0, "contract-held")
    if point == "region.populate":
        # Both workers pass the attach barrier and then populate, unless one fails there so fast
        # that the parent aborts the barrier before the other has woken from it: threading's
        # Barrier then raises BrokenBarrierError in a party it had already released. That peer
        # fails instead of reaching the point, and the report must say exactly that.
        assert doc["fault"]["fired"]
        assert doc["fault"]["fired_in"]
        missed = set(fired_in) - set(doc["fault"]["fired_in"])
        why = {(e["participant"], e["type"]) for e in doc["errors"] if not e["injected"]}
        assert why == {(name, "BrokenBarrierError") for name in missed}, doc["errors"]
    else:
        assert (doc["fault"]["fired"], doc["fault"]["fired_in"]) == (True, fired_in)
    assert (doc["error"]["injected"], doc["error"]["point"]) == (True, point)
    if point == "region.populate":
        assert doc["error"]["errno"] == 28
    if point.startswith("cleanup."):
        assert not all(step["ok"] for step in doc["cleanup"])
        assert doc["logs"]
    validate(doc, "init")
    assert os.listdir(root) == []


@needs_torch
def test_a_crash_report_matches_its_schema_and_its_orphans_exist_until_reaped(
    root: Path, engine_id: str
) -> None:
    """vLLM's tiering lifetime keeps the path while the engine lives, so the crash leaves it."""
    argv = ("--lifetime", "vllm", "--fail-at", "secondary", "--fail-mode", "crash")
    code, doc = init(root, kv_config(engine_id), *argv)
    orphans = [Path(p) for p in doc["crash"]["orphans"]]
    try:
        assert (code, doc["verdict"]) == (1, "orphaned")
        assert orphans == [root / names.format_name(engine_id)]
        assert all(p.is_file() for p in orphans)
        assert (doc["crash"]["participant"], doc["crash"]["injected"]) == ("scheduler", True)
        validate(doc, "init")
        reap = shlex.split(doc["crash"]["reap_command"])
        assert reap[0] == "shmctl"
        done = subprocess.run(
            [sys.executable, "-m", "shmctl", *reap[1:]],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert os.listdir(root) == []
    finally:
        for path in orphans:
            path.unlink(missing_ok=True)


# ----------------------------------------------------------------- init --matrix


@needs_torch
@pytest.mark.slow
@SHARES_A_BRING_UP
def test_a_matrix_with_crash_cells_matches_its_schema(matrix_doc: dict[str, Any]) -> None:
    assert matrix_doc["modes"] == ["raise", "oserror:EFAULT", "cleanup-raise", "crash"]
    assert len(matrix_doc["cells"]) == 8
    assert (matrix_doc["failed"], matrix_doc["leaked"], matrix_doc["stopped"]) == (0, 0, None)
    crashed = [c for c in matrix_doc["cells"] if c["orphans"]]
    assert crashed
    assert all(c["scan_status"] == ["orphaned"] and c["reaped"] == c["orphans"] for c in crashed)
    validate(matrix_doc, "init-matrix")


@needs_torch
@pytest.mark.slow
def test_a_matrix_stopped_by_a_file_the_reap_keeps_matches_its_schema(root: Path, engine_id: str) -> None:
    """A live process holds a file named for the first cell's engine: the reap keeps it."""
    held = root / names.format_name(f"{engine_id}-c000")
    argv = ("--matrix", "--fail-at", "validate", "--fail-at", "worker", "--fail-mode", "crash")
    try:
        with Child("vllm", held):
            code, doc = init(root, kv_config(engine_id, CPU), *argv)
    finally:
        held.unlink(missing_ok=True)
    assert code == 1
    assert (doc["stopped"]["reason"], doc["stopped"]["not_run"]) == ("kept", 1)
    assert [k["status"] for k in doc["stopped"]["kept"]] == ["live"]
    validate(doc, "init-matrix")
    assert os.listdir(root) == []


# ----------------------------------------------------------------- what the schemas refuse


def _at(doc: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


#: (schema, document fixture, where, field): a real document with ``field`` added at ``where``
#: (an unknown field), or removed there (a required one).
UNKNOWN: list[tuple[str, str, tuple[str | int, ...], str]] = [
    ("init-plan", "plan_doc", ("capacity",), "surprise"),
    ("init-plan", "plan_doc", ("stages", 0), "surprise"),
    ("init", "report_doc", ("stages", 0), "surprise"),
    ("init", "report_doc", (), "surprise"),
    ("init-matrix", "matrix_doc", ("cells", 0, "residue"), "surprise"),
    ("init-matrix", "matrix_doc", (), "surprise"),
]
MISSING: list[tuple[str, str, tuple[str | int, ...], str]] = [
    ("init-plan", "plan_doc", (), "schema_version"),
    ("init-plan", "plan_doc", ("layout", "slots", 0), "populate_bytes"),
    ("init", "report_doc", (), "verdict"),
    ("init", "report_doc", ("cleanup", 0), "at_s"),
    ("init-matrix", "matrix_doc", ("cells", 0), "kept"),
    ("init-matrix", "matrix_doc", (), "schema_version"),
]


def _params(cases: list[tuple[str, str, tuple[str | int, ...], str]]) -> list[Any]:
    """One case each, named for the field; the matrix's cases run a matrix, so they are slow."""
    return [
        pytest.param(
            name,
            fixture,
            where,
            field,
            id=f"{name}:{'.'.join(map(str, where)) or 'document'}.{field}",
            marks={
                "plan_doc": [],
                "report_doc": [SHARES_A_BRING_UP],
                "matrix_doc": [pytest.mark.slow, SHARES_A_BRING_UP],
            }[fixture],
        )
        for name, fixture, where, field in cases
    ]


@pytest.mark.parametrize(("name", "fixture", "where", "field"), _params(UNKNOWN))
def test_a_field_the_schema_does_not_know_fails_validation(
    request: pytest.FixtureRequest, name: str, fixture: str, where: tuple[str | int, ...], field: str
) -> None:
    doc = copy.deepcopy(request.getfixturevalue(fixture))
    validate(doc, name)
    _at(doc, where)[field] = 1
    with pytest.raises(jsonschema.ValidationError, match=field):
        validate(doc, name)


@pytest.mark.parametrize(("name", "fixture", "where", "field"), _params(MISSING))
def test_a_required_field_removed_fails_validation(
    request: pytest.FixtureRequest, name: str, fixture: str, where: tuple[str | int, ...], field: str
) -> None:
    doc = copy.deepcopy(request.getfixturevalue(fixture))
    validate(doc, name)
    del _at(doc, where)[field]
    with pytest.raises(jsonschema.ValidationError, match=f"'{field}' is a required property"):
        validate(doc, name)
