"""Every ``--json`` document validates against its shipped schema, on real output.

The schemas forbid unknown fields, so a field added to a report without its schema (or
renamed in one of them) fails here. Each case builds real files and processes: a live
region held by a child, a SIGKILLed creator's orphan, a region unlinked but still mapped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from tests.support.hostile import shmctl
from tests.support.procs import Child, leave_orphan, region_path
from tests.support.schemas import SCHEMAS, schema, validate


@pytest.fixture
def busy_root(root: Path, engine_id: str) -> Iterator[Path]:
    """A live region (mapped by a child), an orphan with an owner record, and a deleted mapping."""
    leave_orphan(root, f"{engine_id}-dead", mode="region")
    live = region_path(root, f"{engine_id}-live")
    gone = region_path(root, f"{engine_id}-gone")
    with Child("vllm", live), Child("vllm", gone):
        gone.unlink()
        yield root
    live.unlink()


def test_every_shipped_schema_is_a_valid_draft_2020_12_schema_with_its_id() -> None:
    names = sorted(p.name.removesuffix(".schema.json") for p in SCHEMAS.glob("*.schema.json"))
    assert {"scan", "reap", "faults", "audit"} <= set(names)
    for name in names:
        assert schema(name)["$id"] == f"urn:shmctl:schema:{name}"


def test_scan_json_matches_its_schema(busy_root: Path) -> None:
    done = shmctl("scan", "--root", str(busy_root), "--grace", "0", "--json", "--deleted")
    doc = json.loads(done.stdout)
    assert {e["status"] for e in doc["entries"]} == {"live", "orphaned"}
    assert doc["deleted"]
    assert any(e["owner"] for e in doc["entries"])
    validate(doc, "scan")


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "yes"])
def test_reap_json_matches_its_schema(busy_root: Path, engine_id: str, dry_run: bool) -> None:
    flag = "--dry-run" if dry_run else "--yes"
    done = shmctl(
        "reap", "--root", str(busy_root), "--grace", "0", "--json", flag, "--engine", f"{engine_id}-d*"
    )
    doc = json.loads(done.stdout)
    assert len(doc["removed"]) == 1
    validate(doc, "reap")


def test_faults_json_matches_its_schema() -> None:
    validate(json.loads(shmctl("faults", "--json").stdout), "faults")


def test_a_field_the_schema_does_not_know_fails_validation(busy_root: Path) -> None:
    doc = json.loads(shmctl("scan", "--root", str(busy_root), "--grace", "0", "--json").stdout)
    doc["entries"][0]["surprise"] = 1
    with pytest.raises(jsonschema.ValidationError, match="surprise"):
        validate(doc, "scan")
