"""One-line JSON comes from orjson where it can, and says exactly what the standard library says.

``shmctl.render.dumps`` writes every ``--json`` document and every agent event. orjson is six
times faster on a 10,000-file scan; these tests hold it to the standard library's output on
real reports (held, orphaned, skipped and segment files, a real holder process), and check
the fallback: a name whose bytes are not UTF-8, an integer past 64 bits, and no orjson at all.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from kvoffload.liveness.reap import reap
from kvoffload.liveness.scan import scan
from shmctl import render
from tests.support.procs import TEST_TAG, Child, leave_orphan, region_path, write_file


def engine_id() -> str:
    return f"{TEST_TAG}{uuid.uuid4().hex[:12]}"


def test_orjson_is_installed_with_shmctl() -> None:
    # A dependency in pyproject and in the image's hashed requirements: the fast path is
    # the one operators run, so the suite must run it too.
    assert render._orjson() is not None


def _same_value(document: object) -> str:
    fast = render.dumps(document)
    assert json.loads(fast) == json.loads(render.standard_dumps(document))
    return fast


def test_a_real_scan_and_reap_report_are_the_same_json_either_way(root: Path) -> None:
    held = region_path(root, engine_id())
    write_file(root / "not-a-region")
    orphan = leave_orphan(root, engine_id())
    segment = region_path(root, engine_id(), 1)
    write_file(segment)
    os.symlink(orphan, region_path(root, engine_id()))
    with Child("vllm", held):
        report = scan(root, grace_s=0)
        statuses = {e.status.value for e in report.entries}
        assert {"live", "orphaned", "skipped"} <= statuses  # every kind of entry is compared
        text = _same_value(report)
        assert any(e["holders"] for e in json.loads(text)["entries"])
        _same_value(reap(root, dry_run=True, grace_s=0))


def test_a_name_that_is_not_utf_8_falls_back_and_comes_back_byte_for_byte(root: Path) -> None:
    raw = b"vllm_offload_" + engine_id().encode() + b"-\xff\xfe.mmap"
    path = os.fsencode(root) + b"/" + raw
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    report = scan(root, grace_s=0)
    text = render.json_text(report)
    assert text == render.json_text(json.loads(render.standard_dumps(report)))
    (entry,) = json.loads(text)["entries"]
    assert os.fsencode(entry["name"]) == raw


def test_an_integer_past_64_bits_is_written_exactly() -> None:
    big = 2**70 + 1
    assert json.loads(render.dumps({"n": big}))["n"] == big


def test_without_orjson_every_document_is_the_standard_librarys(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    leave_orphan(root, engine_id())
    report = scan(root, grace_s=0)
    with_orjson = render.dumps(report)
    monkeypatch.setattr(render, "_orjson", lambda: None)
    assert render.dumps(report) == render.standard_dumps(report)
    assert json.loads(render.dumps(report)) == json.loads(with_orjson)
