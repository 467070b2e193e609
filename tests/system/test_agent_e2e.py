"""End to end: three node agents with the DaemonSet's security context, real engines, a real
Prometheus with the shipped alert rules (docs/e2e.md).

Each agent is ``shmctl watch`` with the DaemonSet's own arguments (its roots, interval, grace and
address replaced) in a bubblewrap sandbox built from the manifest's security context: uid 0 with
only LEASE and DAC_READ_SEARCH, no_new_privs, PID 1 of its own PID namespace with its own
``/proc``, its own IPC namespace, a read-only root and its node's one pod volume (a real tmpfs,
mounted where the kubelet mounts it) writable. Engines run in sandboxes of their own under a pod's
uid (1000), so the agent judges files it can open and lease only through its two capabilities.
Prometheus (Debian's binary; .ci/run extracts it) scrapes the three agents on loopback every
second and evaluates the shipped rules every second, each ``for:`` shortened to one second.
Everything is asked through Prometheus's HTTP API, every wait bounded.

The first test checks one agent's sandbox against the manifest and needs no Prometheus; the
others share one fleet (module scope) and run in file order: the last asks about the whole run.
Skipped, saying why, without root, bubblewrap or the prometheus binary.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.e2e import (
    JOB,
    Agent,
    AgentSpec,
    Engine,
    Prometheus,
    daemonset_agent,
    require_prometheus,
    require_sandbox,
    shortened_rules,
    wait_for,
)
from tests.support.kubelet import KubeletNode

#: The fleet is started once per worker: its tests share one.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("agent-e2e")]

#: The agents' pass interval: an orphan stays one interval after the pass that first finds it,
#: long enough for several scrapes and rule evaluations to see it before the next pass reaps it.
INTERVAL = "5s"
GRACE = "1s"
#: Every rule's ``for:`` (10m and 5m in the shipped file).
FOR = "1s"
#: Bound of every wait: far beyond what each step takes (seconds), never reached when it works.
PATIENCE = 60
NODES = ("node-a", "node-b", "node-c")
MiB = 1 << 20


@dataclass
class Fleet:
    spec: AgentSpec
    prometheus: Prometheus
    #: node name → its agent; node name → its pod volume.
    agents: dict[str, Agent]
    volumes: dict[str, Path]
    #: engine name → engine (names say which node and whether the test kills it).
    engines: dict[str, Engine]
    alerts: dict[str, dict[str, Any]]
    started: float = field(default_factory=time.time)
    killed: list[Engine] = field(default_factory=list)
    killed_agents: set[str] = field(default_factory=set)

    def alive(self) -> None:
        """Fail at once, with its output, when Prometheus or an agent not killed on purpose died."""
        self.prometheus.check_alive()
        for node, agent in self.agents.items():
            if node not in self.killed_agents:
                agent.check_alive()

    def explain(self) -> str:
        """The scrape targets as Prometheus sees them and each agent's last lines of stderr."""
        lines = [f"target {t}" for t in self.prometheus.targets()]
        for node, agent in self.agents.items():
            lines.append(f"{node} stderr: {agent.stderr_tail(5)!r}")
        return "\n".join(lines)

    def since_start(self) -> str:
        """A range selector covering the whole run."""
        return f"[{int(time.time() - self.started) + 10}s]"


def orphan_threshold(rule: dict[str, Any]) -> int:
    found = re.fullmatch(r"\s*shmctl_orphan_bytes\s*>\s*([0-9.e+]+)\s*", rule["expr"])
    assert found, f"ShmctlOrphanedBytes is no longer `shmctl_orphan_bytes > N`: update this test ({rule})"
    return int(float(found.group(1)))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    bwrap = require_sandbox()
    prometheus = require_prometheus()
    spec = daemonset_agent()
    work = tmp_path_factory.mktemp("e2e")
    alerts = shortened_rules(work / "shmctl-rules.yaml", FOR)
    for name in ("ShmctlOrphanedBytes", "ShmctlWatchDown"):
        assert name in alerts, f"{name} is not in deploy/prometheus/shmctl-rules.yaml: update this test"
    # Just over the shipped threshold: what pins the memory is real pages of a real tmpfs.
    big = orphan_threshold(alerts["ShmctlOrphanedBytes"]) + 64 * MiB
    assert big <= 4 << 30, "the test will not pin more than 4 GiB for ShmctlOrphanedBytes"
    with ExitStack() as stack:
        # Closed last: the sandboxes (closed first) hold binds of these mounts.
        kubelets = {n: stack.enter_context(KubeletNode(work / n)) for n in NODES}
        # The size is a limit, not an allocation: node-a's must hold the big region and stay
        # well above it free, or ShmctlVolumeTooFull would be right to fire.
        volumes = {n: k.add_pod(size="4g" if n == "node-a" else "64m") for n, k in kubelets.items()}

        def engine(node: str, name: str, mode: str, size: int = MiB) -> tuple[str, Engine]:
            engine_id = f"e2e-{node}-{name}-{uuid.uuid4().hex[:8]}"
            return f"{node}/{name}", stack.enter_context(Engine(bwrap, volumes[node], engine_id, mode, size))

        engines = dict(
            [
                engine("node-a", "doomed-vllm", "vllm", big),
                engine("node-a", "doomed-region", "region"),
                engine("node-a", "live-region", "region"),
                engine("node-b", "live-vllm", "vllm"),
                engine("node-c", "live-region", "region"),
                engine("node-c", "live-vllm", "vllm"),
            ]
        )
        agents = {
            n: stack.enter_context(
                Agent(
                    bwrap,
                    spec,
                    volume=volumes[n],
                    root=kubelets[n].glob,
                    interval=INTERVAL,
                    grace=GRACE,
                    log_dir=work,
                    name=f"agent-{n}",
                )
            )
            for n in NODES
        }
        server = stack.enter_context(
            Prometheus(
                prometheus,
                work,
                targets={a.address: n for n, a in agents.items()},
                rules=work / "shmctl-rules.yaml",
            )
        )
        for agent in agents.values():
            agent.wait_healthy(PATIENCE)
        server.wait_ready(PATIENCE)
        yield Fleet(spec, server, agents, volumes, engines, alerts)


def by_instance(result: list[dict[str, Any]]) -> dict[str, float]:
    return {r["metric"]["instance"]: float(r["value"][1]) for r in result}


def engines_on(fleet: Fleet, node: str) -> list[Engine]:
    return [e for name, e in fleet.engines.items() if name.startswith(f"{node}/")]


def test_the_agent_runs_with_exactly_the_daemonsets_security_context(tmp_path: Path) -> None:
    # One agent built as the fleet's are; needs no Prometheus.
    bwrap = require_sandbox()
    spec = daemonset_agent()
    mask = spec.capability_mask
    assert mask == (1 << 2) | (1 << 28), "the manifest's capabilities changed: DAC_READ_SEARCH and LEASE"
    with KubeletNode(tmp_path / "node") as kubelet:
        volume = kubelet.add_pod()
        with Agent(
            bwrap,
            spec,
            volume=volume,
            root=kubelet.glob,
            interval=INTERVAL,
            grace=GRACE,
            log_dir=tmp_path,
            name="agent",
        ) as agent:
            agent.wait_healthy(PATIENCE)
            pid = agent.inner_pid()
            status = dict(
                line.split(":\t", 1)
                for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if ":\t" in line
            )
            mountinfo = Path(f"/proc/{pid}/mountinfo").read_text()
            namespaces = {ns: os.readlink(f"/proc/{pid}/ns/{ns}") for ns in ("pid", "ipc", "net")}
            assert "shmctl_watch_up 1.0" in agent.get("/metrics")[1].splitlines()
    assert status["Uid"].split() == ["0"] * 4
    for kind in ("CapEff", "CapPrm", "CapBnd"):
        assert int(status[kind], 16) == mask, f"{kind} {status[kind]}"
    assert status["NoNewPrivs"] == "1"
    # PID 1 of a namespace of its own (hostPID: false), with its own IPC namespace; the
    # network is the host's here, so Prometheus reaches it on loopback.
    assert status["NSpid"].split()[-1] == "1", status["NSpid"]
    for ns, own in (("pid", True), ("ipc", True), ("net", False)):
        assert (namespaces[ns] != os.readlink(f"/proc/self/ns/{ns}")) == own, f"{ns} namespace"
    # Read-only root; of the filesystems that store anything, only its pod volume is writable
    # (plus a container's own /dev and /proc). The last mount at a point is the one it sees.
    top: dict[str, tuple[str, str]] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        point, options = fields[4], fields[5].split(",")
        fstype = fields[fields.index("-") + 1]
        top[point] = ("rw" if "rw" in options else "ro", fstype)
    assert top["/"][0] == "ro", top["/"]
    assert top[str(volume)] == ("rw", "tmpfs")
    writable = {
        p
        for p, (mode, fstype) in top.items()
        if mode == "rw" and fstype not in {"proc", "devpts", "devtmpfs"}
    }
    assert writable - {"/dev"} == {str(volume)}, writable


def test_prometheus_scrapes_every_agent_as_a_running_watch_that_sees_its_engines_live(fleet: Fleet) -> None:
    prom = fleet.prometheus
    everyone = {a.address for a in fleet.agents.values()}

    def all_up() -> set[str] | None:
        running = prom.query(f'up{{job="{JOB}"}} == 1 and on (instance) shmctl_watch_up == 1')
        seen = {r["metric"]["instance"] for r in running}
        return seen if seen == everyone else None

    wait_for(
        all_up,
        PATIENCE,
        "a scrape of all three agents with shmctl_watch_up 1",
        alive=fleet.alive,
        explain=fleet.explain,
    )
    # Each engine runs as another uid with a 0600 file: judged `live` only if the agent could
    # open it (DAC_READ_SEARCH) and was refused its write lease because the engine holds it
    # (LEASE); without either it would be `skipped` or `unknown`.
    expected = {fleet.agents[n].address: float(len(engines_on(fleet, n))) for n in NODES}

    def all_live() -> dict[str, float] | None:
        seen = by_instance(prom.query('shmctl_regions{status="live"}'))
        return seen if seen == expected else None

    wait_for(
        all_live,
        PATIENCE,
        "every engine judged live by its agent",
        alive=fleet.alive,
        explain=lambda: f"{fleet.explain()}\nregions: {prom.query('shmctl_regions != 0')}",
    )


def test_a_killed_engine_fires_orphaned_bytes_until_its_agent_reaps_it(fleet: Fleet) -> None:
    prom = fleet.prometheus
    agent = fleet.agents["node-a"]
    doomed = [e for name, e in fleet.engines.items() if "/doomed-" in name]
    survivor = fleet.engines["node-a/live-region"]
    for engine in doomed:
        engine.kill()
        fleet.killed.append(engine)
    states: set[str] = set()

    def reaped_and_resolved() -> bool | None:
        # Polled all along, so a pending or firing state shows in the failure message.
        states.update(a["state"] for a in prom.alerts("ShmctlOrphanedBytes"))
        if any(e.path.exists() for e in doomed):
            return None
        orphaned = by_instance(prom.query("shmctl_orphan_bytes"))
        firing = prom.alerts("ShmctlOrphanedBytes")
        return True if orphaned.get(agent.address) == 0 and not firing else None

    wait_for(
        reaped_and_resolved,
        PATIENCE,
        "the reap of the killed engines and the alert resolved",
        alive=fleet.alive,
        explain=lambda: f"{fleet.explain()}\nalert states seen: {states}",
    )
    # The alert as Prometheus recorded it at every evaluation (the ALERTS series), with the
    # labels an operator gets: which node, pod and root.
    history = prom.query(f'max_over_time(ALERTS{{alertname="ShmctlOrphanedBytes"}}{fleet.since_start()})')
    assert {r["metric"]["alertstate"] for r in history} >= {"pending", "firing"}, (history, states)
    for r in history:
        labels = r["metric"]
        assert labels["instance"] == agent.address
        assert labels["node"] == "node-a"
        assert labels["root"] == str(fleet.volumes["node-a"])
        assert labels["pod_uid"] == fleet.volumes["node-a"].parents[2].name
        assert labels["severity"] == "warning"
    # Removed by the agent, each as its own event; the live engine beside them untouched.
    removed = {e["engine_id"] for e in agent.events() if e["event"] == "removed"}
    assert removed == {e.engine_id for e in doomed}
    assert survivor.path.stat().st_ino == survivor.inode


def test_every_query_of_the_grafana_dashboard_returns_series_from_the_agents(fleet: Fleet) -> None:
    # After the reap above: orphans were found and removed, so the reap counters have moved
    # and the per-engine orphan series have been non-zero. Still here: every agent (node-c
    # is killed only in the next test).
    from tests.system.test_deploy import DASHBOARDS, dashboard_queries

    prom = fleet.prometheus
    #: The dashboard's variables as a person picks them (all nodes) and Grafana's own.
    values = {"job": JOB, "node": ".*", "__rate_interval": "1m", "__interval": "15s", "__range": "1h"}
    # Each panel has a real series here; none has a conflict staged (a parked file whose name
    # another file took needs a dead reaper's park holding a live engine's file inside the
    # agent's sandbox), so the "Conflicts" panel's series are the agent's 0 per pod volume
    # (a reaping agent starts every watched root's counters at 0).
    queries = []
    for path in DASHBOARDS:
        for title, ref_id, expr in dashboard_queries(json.loads(path.read_text())):
            substituted = re.sub(
                r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]",
                lambda m: values[next(g for g in m.groups() if g)],
                expr,
            )
            assert "$" not in substituted, substituted
            queries.append((f"{path.name}: {title} {ref_id}", substituted))
    empty: list[str] = []

    def every_query_has_series() -> bool | None:
        empty[:] = [f"{name}: {expr}" for name, expr in queries if not prom.query(expr)]
        return True if not empty else None

    wait_for(
        every_query_has_series,
        PATIENCE,
        "a series for every query of the dashboard",
        alive=fleet.alive,
        explain=lambda: f"{fleet.explain()}\nno series: {empty}",
    )
    # The reaps of the test above show in the reap panel's own query, over the whole run.
    files = [expr for name, expr in queries if "Reaped files" in name]
    assert files, "the dashboard has no 'Reaped files' panel"
    counted = prom.query(files[0].replace("[1m]", fleet.since_start()))
    assert any(float(r["value"][1]) > 0 for r in counted if r["metric"].get("node") == "node-a"), counted


def test_a_killed_agent_fires_watch_down(fleet: Fleet) -> None:
    prom = fleet.prometheus
    dead = fleet.agents["node-c"]
    fleet.killed_agents.add("node-c")
    dead.kill()

    # Polled rather than read once: a scrape of a live agent that a loaded machine delays past
    # its one-second timeout is a moment of up 0, not the state the test asks about.
    def only_the_dead_agent_down() -> list[dict[str, Any]] | None:
        firing = [a for a in prom.alerts("ShmctlWatchDown") if a["state"] == "firing"]
        up = by_instance(prom.query(f'up{{job="{JOB}"}}'))
        everyone_else_up = all(up.get(a.address) == 1 for n, a in fleet.agents.items() if n != "node-c")
        only_dead = [a["labels"]["instance"] for a in firing] == [dead.address]
        return firing if only_dead and up.get(dead.address) == 0 and everyone_else_up else None

    alerts = wait_for(
        only_the_dead_agent_down,
        PATIENCE,
        "ShmctlWatchDown firing for node-c alone, the other agents up",
        alive=fleet.alive,
        explain=lambda: f"{fleet.explain()}\nShmctlWatchDown: {prom.alerts('ShmctlWatchDown')}",
    )
    (alert,) = alerts
    assert alert["labels"]["node"] == "node-c"
    assert alert["labels"]["severity"] == "warning"
    assert dead.address in alert["annotations"]["summary"]


def test_no_live_engine_was_orphaned_at_any_scrape_of_the_run(fleet: Fleet) -> None:
    prom = fleet.prometheus
    run = fleet.since_start()
    live = [e for name, e in fleet.engines.items() if "/live-" in name]
    ids = "|".join(e.engine_id for e in live)
    # Every scrape of every agent is in the range: the per-engine series of an orphan would
    # be there, at any one of them, with its engine_id.
    assert prom.query(f'count_over_time(shmctl_orphan_engine_bytes{{engine_id=~"{ids}"}}{run})') == []
    for node in ("node-b", "node-c"):
        address = fleet.agents[node].address

        def orphaned_regions(address: str = address) -> list[Any] | None:
            # A scrape has a 1 s timeout: on a loaded machine every scrape of a node can miss it
            # for a while, and no sample is no evidence either way. Wait for one in the run.
            series = f'shmctl_regions{{status="orphaned", instance="{address}"}}{fleet.since_start()}'
            return prom.query(f"max_over_time({series})") or None

        seen = wait_for(
            orphaned_regions, PATIENCE, f"a scrape of {node}'s shmctl_regions", explain=fleet.explain
        )
        assert [float(r["value"][1]) for r in seen] == [0.0], node
    # The same queries find what was orphaned: they can fail.
    if fleet.killed:
        dead = "|".join(e.engine_id for e in fleet.killed)
        found = prom.query(f'count_over_time(shmctl_orphan_engine_bytes{{engine_id=~"{dead}"}}{run})')
        assert {r["metric"]["engine_id"] for r in found} == {e.engine_id for e in fleet.killed}
    for engine in live:
        assert engine.path.stat().st_ino == engine.inode, engine.engine_id
