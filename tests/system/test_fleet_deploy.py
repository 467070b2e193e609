"""The fleet deployment keeps the properties its comments claim: the watch DaemonSet
(deploy/kubernetes/daemonset.yaml), the per-pod sidecar (deploy/kubernetes/vllm-with-shmctl.yaml),
the PodMonitor and the alerting rules (deploy/prometheus/).

The Kubernetes manifests pass the Kubernetes schemas in tests/system/test_deploy.py, which validates
every file under deploy/kubernetes/; here they are read as data, for what a schema cannot say
(no capability but the two the evidence needs, the mounts the roots need, probes where the agent
listens). The PodMonitor is a custom resource the bundled schemas do not know, so its shape is
checked against the part of the Operator's CRD it uses. The rules pass ``promtool check rules``
and their unit tests (``promtool test rules``) where promtool is installed (Debian's
``prometheus`` package; .ci/run extracts it); without promtool they are checked against the
structure of a Prometheus rule file, and every test below that needs none runs either way.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml  # type: ignore[import-untyped]

from tests.support.procs import REPO
from tests.system.test_deploy import MANIFESTS

DAEMONSET = REPO / "deploy" / "kubernetes" / "daemonset.yaml"
PER_POD = REPO / "deploy" / "kubernetes" / "vllm-with-shmctl.yaml"
PODMONITOR = REPO / "deploy" / "prometheus" / "shmctl-podmonitor.yaml"
RULES = REPO / "deploy" / "prometheus" / "shmctl-rules.yaml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "shmctl-rules.test.yaml"

#: What ``shmctl watch`` exports (its contract): per root, with the labels root and pod_uid...
WATCH_ROOT_METRICS = frozenset(
    {
        "shmctl_scan_success",
        "shmctl_regions",
        "shmctl_region_files",
        "shmctl_region_resident_bytes",
        "shmctl_orphan_bytes",
        "shmctl_orphan_engine_bytes",
        "shmctl_unlinked_mapped_bytes",
        "shmctl_uninspected_processes",
        "shmctl_root_size_bytes",
        "shmctl_root_free_bytes",
        "shmctl_last_success_timestamp_seconds",
        "shmctl_scan_duration_seconds",
        "shmctl_region_size_max_bytes",
        "shmctl_reaped_files_total",
        "shmctl_reaped_bytes_total",
    }
)
#: ...and for the agent as a whole.
WATCH_AGENT_METRICS = frozenset(
    {
        "shmctl_watch_up",
        "shmctl_watch_pass_duration_seconds",
        "shmctl_watch_passes_total",
        "shmctl_watch_roots",
        "shmctl_build_info",
        "shmctl_lease_break_time_seconds",
        "shmctl_proc_walks_total",
        "shmctl_proc_walk_timestamp_seconds",
    }
)
#: The evidence needs these and nothing else (the manifest's comments say why each).
AGENT_CAPABILITIES = {"LEASE", "DAC_READ_SEARCH"}
HOST_SHM = "/dev/shm"
KUBELET_PODS = "/var/lib/kubelet/pods"
POD_VOLUMES_GLOB = "/var/lib/kubelet/pods/*/volumes/kubernetes.io~empty-dir/*"
#: Prometheus's duration syntax (model.ParseDuration): units largest first, each at most once.
PROMETHEUS_DURATION = re.compile(r"^(0|(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?)$")
VENV_BIN = Path(sys.executable).parent
#: Where .ci/run puts promtool (taken out of Debian's prometheus package, not installed).
CI_TOOLS = REPO / "build" / "tools"


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def one(path: Path, kind: str) -> dict[str, Any]:
    (found,) = [doc for doc in documents(path) if doc["kind"] == kind]
    return found


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [c for c in pod_spec["containers"] if c["name"] == name]
    (only,) = found
    return only


def agent_pod() -> dict[str, Any]:
    template: dict[str, Any] = one(DAEMONSET, "DaemonSet")["spec"]["template"]
    return template


def agent() -> dict[str, Any]:
    return container(agent_pod()["spec"], "shmctl")


def option_values(args: list[str], option: str) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args) if arg == option]


def mounts(spec: dict[str, Any], c: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """mountPath -> (the volumeMount, its volume)."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in c["volumeMounts"]}


def project_version() -> str:
    version: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return version


# The DaemonSet.


def test_the_fleet_manifests_are_among_those_checked_against_the_kubernetes_schemas() -> None:
    assert {DAEMONSET, PER_POD} <= set(MANIFESTS)
    # The PodMonitor stays out: the bundled schemas have no CRDs, and the DaemonSet's file must
    # apply on clusters without the Prometheus Operator.
    assert PODMONITOR not in MANIFESTS
    assert {doc["kind"] for doc in documents(DAEMONSET)} == {"Namespace", "DaemonSet", "Service"}


def test_the_agent_is_unprivileged_with_only_the_capabilities_its_evidence_needs() -> None:
    context = agent()["securityContext"]
    assert context["privileged"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert set(context["capabilities"]["add"]) == AGENT_CAPABILITIES
    assert len(context["capabilities"]["add"]) == len(AGENT_CAPABILITIES)


def test_the_agent_cannot_write_its_image_or_gain_privileges() -> None:
    context = agent()["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    seccomp = context.get("seccompProfile") or agent_pod()["spec"]["securityContext"]["seccompProfile"]
    assert seccomp == {"type": "RuntimeDefault"}


def test_the_agent_shares_no_host_namespace_and_holds_no_api_token() -> None:
    spec = agent_pod()["spec"]
    # The lease makes verdicts independent of which processes the agent can see (README).
    assert spec["hostPID"] is False
    assert spec["hostNetwork"] is False
    assert spec["hostIPC"] is False
    assert spec["automountServiceAccountToken"] is False


def test_the_agent_watches_the_hosts_dev_shm_and_every_pods_empty_dir_and_reaps() -> None:
    c = agent()
    args = c["args"]
    assert c["command"] == ["shmctl"]
    assert args[0] == "watch"
    assert "--reap" in args
    # As root, other uids' files are otherwise `skipped`: the capabilities would go unused.
    assert "--all-users" in args
    assert option_values(args, "--root") == [HOST_SHM, POD_VOLUMES_GLOB]
    assert PROMETHEUS_DURATION.match(option_values(args, "--grace")[0])


def test_each_root_is_the_hosts_own_directory_at_the_hosts_own_path() -> None:
    # Same paths inside and out: the root label and the runbook commands name what is on the node.
    spec = agent_pod()["spec"]
    by_path = mounts(spec, agent())
    for path in (HOST_SHM, KUBELET_PODS):
        mount, volume = by_path[path]
        assert volume["hostPath"] == {"path": path, "type": "Directory"}
        # Reaping unlinks files there.
        assert mount.get("readOnly", False) is False


def test_the_agent_sees_memory_volumes_mounted_after_it_started() -> None:
    mount, _ = mounts(agent_pod()["spec"], agent())[KUBELET_PODS]
    assert mount["mountPropagation"] == "HostToContainer"


def test_the_agent_listens_where_the_kubelet_and_prometheus_connect() -> None:
    c = agent()
    (listen,) = option_values(c["args"], "--listen")
    host, _, port = listen.rpartition(":")
    # The pod IP: loopback would refuse the kubelet's probes and every scrape.
    assert host == "0.0.0.0"
    (metrics,) = [p for p in c["ports"] if p["name"] == "metrics"]
    assert metrics["containerPort"] == int(port)


@pytest.mark.parametrize("probe", ["startupProbe", "livenessProbe", "readinessProbe"])
def test_the_agents_probes_ask_healthz_on_its_metrics_port(probe: str) -> None:
    assert agent()[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}


def test_the_agent_has_requests_and_limits_and_never_uses_more_memory_than_it_requests() -> None:
    resources = agent()["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}
    assert resources["requests"]["memory"] == resources["limits"]["memory"]


def test_the_agent_runs_on_tainted_gpu_nodes() -> None:
    tolerations = agent_pod()["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


@pytest.mark.parametrize("manifest", [DAEMONSET, PER_POD], ids=lambda p: p.name)
def test_the_shmctl_image_is_tagged_with_this_version(manifest: Path) -> None:
    pods = [doc["spec"]["template"]["spec"] for doc in documents(manifest) if doc["kind"] == "DaemonSet"]
    pods += [doc["spec"] for doc in documents(manifest) if doc["kind"] == "Pod"]
    (pod,) = pods
    image = container(pod, "shmctl")["image"]
    assert image.rpartition(":")[2] == project_version()


def test_the_headless_service_selects_the_agents_and_their_metrics_port() -> None:
    service = one(DAEMONSET, "Service")
    labels = agent_pod()["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"
    # An unready agent must stay a target, or its scrape vanishes instead of failing.
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "metrics"


# The PodMonitor.

#: The fields of the Operator's PodMonitor CRD (monitoring.coreos.com/v1) that this file uses;
#: anything else is a typo the Operator would prune without a word.
PODMONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}},
        },
        "spec": {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}
                    },
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": PROMETHEUS_DURATION.pattern},
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "sourceLabels": {"type": "array", "items": {"type": "string"}},
                                        "targetLabel": {"type": "string"},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def test_the_podmonitor_has_the_shape_of_the_operators_crd() -> None:
    (monitor,) = documents(PODMONITOR)
    jsonschema.validate(monitor, PODMONITOR_SCHEMA)


def test_the_podmonitor_schema_rejects_a_misspelt_field() -> None:
    (monitor,) = documents(PODMONITOR)
    monitor["spec"]["podMetricEndpoints"] = monitor["spec"].pop("podMetricsEndpoints")
    with pytest.raises(jsonschema.ValidationError, match="podMetric"):
        jsonschema.validate(monitor, PODMONITOR_SCHEMA)


def test_the_podmonitor_scrapes_the_agents_metrics_port_as_the_job_the_rules_watch() -> None:
    (monitor,) = documents(PODMONITOR)
    labels = agent_pod()["metadata"]["labels"]
    assert monitor["metadata"]["namespace"] == one(DAEMONSET, "DaemonSet")["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    job = labels[monitor["spec"]["jobLabel"]]
    agent_alerts = [rule["expr"] for rule in alert_rules() if "up{" in rule["expr"]]
    assert agent_alerts
    for expr in agent_alerts:
        assert set(re.findall(r'job="([^"]*)"', expr)) == {job}


# The per-pod pattern.


def per_pod() -> dict[str, Any]:
    spec: dict[str, Any] = one(PER_POD, "Pod")["spec"]
    return spec


def test_the_sidecar_watches_and_reaps_the_engines_dev_shm() -> None:
    spec = per_pod()
    sidecar = container(spec, "shmctl")
    engine = container(spec, "vllm")
    assert sidecar["args"][0] == "watch"
    assert "--reap" in sidecar["args"]
    assert option_values(sidecar["args"], "--root") == [HOST_SHM]
    # The very volume the engine's regions are in.
    assert mounts(spec, sidecar)[HOST_SHM][1] == mounts(spec, engine)[HOST_SHM][1]
    assert mounts(spec, engine)[HOST_SHM][1]["emptyDir"]["medium"] == "Memory"


def test_the_sidecar_needs_no_capability_and_runs_as_the_engines_uid() -> None:
    spec = per_pod()
    context = container(spec, "shmctl")["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["privileged"] is False
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    # The engine's files are the sidecar's own: no CAP_LEASE, no DAC capability. The vllm
    # image runs as root when nothing says otherwise.
    engine_uid = container(spec, "vllm").get("securityContext", {}).get("runAsUser", 0)
    assert context["runAsUser"] == engine_uid


def test_the_sidecar_can_never_take_the_engine_out_of_its_service() -> None:
    sidecar = container(per_pod(), "shmctl")
    assert "readinessProbe" not in sidecar
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"


# The alerting rules.

#: A Prometheus rule file (prometheus/model/rulefmt), the fields this project may use.
RULE_FILE_SCHEMA: dict[str, Any] = {
    "$defs": {
        "duration": {"type": "string", "pattern": PROMETHEUS_DURATION.pattern, "minLength": 1},
        "labels": {
            "type": "object",
            "propertyNames": {"pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"},
            "additionalProperties": {"type": "string"},
        },
    },
    "type": "object",
    "required": ["groups"],
    "additionalProperties": False,
    "properties": {
        "groups": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "rules"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": {"$ref": "#/$defs/duration"},
                    "limit": {"type": "integer", "minimum": 0},
                    "rules": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "oneOf": [
                                {
                                    "type": "object",
                                    "required": ["alert", "expr"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9]*$"},
                                        "expr": {"type": "string", "minLength": 1},
                                        "for": {"$ref": "#/$defs/duration"},
                                        "keep_firing_for": {"$ref": "#/$defs/duration"},
                                        "labels": {"$ref": "#/$defs/labels"},
                                        "annotations": {"$ref": "#/$defs/labels"},
                                    },
                                },
                                {
                                    "type": "object",
                                    "required": ["record", "expr"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "record": {"type": "string", "pattern": "^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
                                        "expr": {"type": "string", "minLength": 1},
                                        "labels": {"$ref": "#/$defs/labels"},
                                    },
                                },
                            ]
                        },
                    },
                },
            },
        }
    },
}


def rule_file() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(RULES.read_text())
    return loaded


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in rule_file()["groups"] for rule in group["rules"] if "alert" in rule]


def metric_names(expr: str) -> set[str]:
    """The shmctl series an expression reads (crudely: every shmctl_* word outside quotes)."""
    unquoted = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    return set(re.findall(r"\bshmctl_\w+", unquoted))


def test_the_rules_file_has_the_structure_of_a_prometheus_rule_file() -> None:
    jsonschema.validate(rule_file(), RULE_FILE_SCHEMA)


def test_the_rule_file_schema_rejects_a_misspelt_field() -> None:
    broken = yaml.safe_load(RULES.read_text().replace("    expr:", "    expression:", 1))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, RULE_FILE_SCHEMA)


def test_the_rule_file_schema_rejects_a_duration_prometheus_cannot_parse() -> None:
    broken = yaml.safe_load(RULES.read_text().replace("for: 10m", "for: 10 minutes", 1))
    with pytest.raises(jsonschema.ValidationError, match="10 minutes"):
        jsonschema.validate(broken, RULE_FILE_SCHEMA)


def test_the_alerts_cover_orphans_room_unknown_regions_scans_and_the_agent() -> None:
    names = {rule["alert"] for rule in alert_rules()}
    # Orphans left in place, a volume a restart cannot fit in, an agent down, regions stuck
    # unknown; and the two ways a root stops being scanned.
    assert names == {
        "ShmctlOrphanedBytes",
        "ShmctlVolumeTooFull",
        "ShmctlRegionsUnknown",
        "ShmctlScanFailing",
        "ShmctlScanStale",
        "ShmctlWatchDown",
        "ShmctlWatchAbsent",
    }


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_every_alert_reads_only_series_shmctl_watch_exports(rule: dict[str, Any]) -> None:
    used = metric_names(rule["expr"])
    assert used <= WATCH_ROOT_METRICS | WATCH_AGENT_METRICS


def test_a_real_watch_pass_exports_every_series_the_rules_read(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kvoffload.liveness.watch import WatchConfig, Watcher
    from shmctl.serve.state import WatchMetrics

    # One root it can scan and one it cannot: a failed root has series of its own.
    (tmp_path / "shm").mkdir()
    config = WatchConfig(roots=(str(tmp_path / "shm"), str(tmp_path / "missing")), interval_s=60)
    metrics = WatchMetrics(interval_s=60)
    metrics.record(Watcher(config).run_pass())
    exported = {
        sample.name
        for family in text_string_to_metric_families(metrics.text().decode())
        for sample in family.samples
    }
    read = set().union(*(metric_names(rule["expr"]) for rule in alert_rules()))
    assert read <= exported
    assert exported <= WATCH_ROOT_METRICS | WATCH_AGENT_METRICS | {
        "shmctl_last_run_timestamp_seconds",
        "shmctl_scan_error_info",
    }


def watch_options() -> set[str]:
    import typer

    from shmctl.app import app

    group: Any = typer.main.get_command(app)
    command = group.get_command(None, "watch")
    return {opt for param in command.params for opt in param.opts}


@pytest.mark.parametrize(
    "args",
    [agent()["args"], container(per_pod(), "shmctl")["args"]],
    ids=["daemonset", "sidecar"],
)
def test_the_manifests_pass_only_options_shmctl_watch_has(args: list[str]) -> None:
    assert args[0] == "watch"
    assert {arg for arg in args if arg.startswith("--")} <= watch_options()


def test_the_metric_name_parser_finds_names_and_ignores_label_values() -> None:
    expr = 'shmctl_root_free_bytes{job="shmctl_x"} < on (root) shmctl_region_size_max_bytes'
    assert metric_names(expr) == {"shmctl_root_free_bytes", "shmctl_region_size_max_bytes"}


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_every_alert_waits_and_says_what_to_run(rule: dict[str, Any]) -> None:
    assert PROMETHEUS_DURATION.match(rule["for"])
    assert rule["labels"]["severity"] in {"info", "warning", "critical"}
    assert set(rule["annotations"]) == {"summary", "description", "runbook"}
    assert re.search(r"\b(shmctl (scan|reap)|kubectl)\b", rule["annotations"]["runbook"])


def rule_tests() -> list[dict[str, Any]]:
    loaded: dict[str, Any] = yaml.safe_load(RULE_TESTS.read_text())
    assert loaded["rule_files"] == [RULES.name]
    tests: list[dict[str, Any]] = loaded["tests"]
    return tests


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_every_alert_has_unit_tests_where_it_fires_and_where_it_does_not(rule: dict[str, Any]) -> None:
    cases = [case for test in rule_tests() for case in test["alert_rule_test"]]
    mine = [case for case in cases if case["alertname"] == rule["alert"]]
    assert any(case["exp_alerts"] for case in mine), "no test where it fires"
    assert any(not case["exp_alerts"] for case in mine), "no test where it stays quiet"


def test_every_alert_the_unit_tests_name_is_in_the_rules() -> None:
    names = {rule["alert"] for rule in alert_rules()}
    tested = {case["alertname"] for test in rule_tests() for case in test["alert_rule_test"]}
    assert tested <= names


def promtool() -> str:
    """The system's promtool, or the one .ci/run extracted into build/tools; skip when neither."""
    search = os.pathsep.join([str(VENV_BIN), str(CI_TOOLS), os.environ.get("PATH", "")])
    found = shutil.which("promtool", path=search)
    if found is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; .ci/run extracts it)")
    return found


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], capture_output=True, text=True, cwd=cwd, timeout=120, check=False
    )


def test_promtool_accepts_the_rules() -> None:
    done = run_promtool("check", "rules", str(RULES), cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout


def test_the_rules_pass_their_promtool_unit_tests() -> None:
    done = run_promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_fails_the_unit_tests_of_an_alert_that_fires_later(tmp_path: Path) -> None:
    # The unit tests pin the `for:` durations: they would catch a change that delays an alert.
    (tmp_path / RULES.name).write_text(RULES.read_text().replace("for: 10m", "for: 20m", 1))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    done = run_promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert done.returncode != 0
    assert "ShmctlOrphanedBytes" in done.stdout + done.stderr


def test_promtool_rejects_a_rule_with_a_broken_expression(tmp_path: Path) -> None:
    broken = tmp_path / RULES.name
    broken.write_text(
        RULES.read_text().replace("shmctl_orphan_bytes > 1073741824", "shmctl_orphan_bytes >", 1)
    )
    done = run_promtool("check", "rules", str(broken), cwd=tmp_path)
    assert done.returncode != 0
    assert "parse error" in done.stdout + done.stderr
