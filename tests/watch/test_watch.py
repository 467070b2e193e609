"""shmctl watch: the node agent, run as a real process over a simulated kubelet node.

Pod volumes are real tmpfs mounts where the kubelet puts them (``tests/support/kubelet.py``);
engines are real processes holding regions the ways vLLM and kvoffload do, some in their
own PID and mount namespaces (``unshare``), some SIGKILLed; a pod is deleted (unmounted)
while the agent runs. The agent is ``python -m shmctl watch``: its stdout JSON lines are
parsed and validated against ``watch-event.schema.json``, its ``/metrics`` scraped over
loopback and parsed with prometheus-client's parser, and compared with the files on disk
(``st_blocks * 512``). The pass loop's rules (two orphaned passes, the same inodes) are
also tested in-process with ``Watcher.run_pass``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.errors import ConfigError
from kvoffload.liveness.events import KeptUnknown, PassReport, Removed, RootUnreadable
from kvoffload.liveness.reap import reap
from kvoffload.liveness.roots import pod_uid_of
from kvoffload.liveness.scan import Status
from kvoffload.liveness.watch import WatchConfig, Watcher
from kvoffload.shm import names
from shmctl.serve.agent import parse_listen
from shmctl.serve.state import WatchMetrics
from tests.support.hostile import shmctl
from tests.support.kubelet import KubeletNode
from tests.support.procs import REPO, Child, region_path, write_file
from tests.support.schemas import validate

IN_CHILD_PID_NS = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")
JSON = dict[str, Any]
Series = tuple[str, frozenset[tuple[str, str]]]
PAGE = 4096


def require_unshare() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for engines in their own PID namespaces")
    probe = subprocess.run([*IN_CHILD_PID_NS, "true"], check=False, capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a PID namespace here: {probe.stderr.decode().strip()}")


class Agent:
    """``python -m shmctl watch ARGS`` as a real process; its events parsed as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shmctl", "watch", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            text=True,
        )
        self.events: list[JSON] = []
        self.lines: list[str] = []
        self.stderr: list[str] = []
        self._new: queue.Queue[JSON] = queue.Queue()
        self._readers = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            event = json.loads(line)
            self.events.append(event)
            self._new.put(event)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def port(self, timeout: float = 20) -> int:
        """The port the agent bound (``--listen 127.0.0.1:0``), from its note on stderr."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.stderr:
                if "serving /metrics" in line:
                    return int(line.rsplit(":", 1)[1])
            assert self.proc.poll() is None, "".join(self.stderr)
            time.sleep(0.02)
        raise AssertionError(f"no listening note on stderr: {self.stderr}")

    def wait_for(self, done: Callable[[list[JSON]], bool], timeout: float = 30) -> list[JSON]:
        """Wait until ``done(events so far)``; the events."""
        deadline = time.monotonic() + timeout
        while not done(list(self.events)):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; events: {self.events}; stderr: {self.stderr}"
            assert self.proc.poll() is None, f"the agent exited: {self.stderr}"
            with contextlib.suppress(queue.Empty):
                self._new.get(timeout=min(left, 0.5))
        return list(self.events)

    def passes_after(self, count: int, n: int) -> Callable[[list[JSON]], bool]:
        """A ``wait_for`` condition: ``n`` more pass events after the first ``count`` events."""
        return lambda events: len([e for e in events[count:] if e["event"] == "pass"]) >= n

    def get(self, path: str) -> tuple[int, str]:
        url = f"http://127.0.0.1:{self.port()}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> dict[Series, float]:
        status, text = self.get("/metrics")
        assert status == 200
        return parse(text)

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, float]:
        """Send ``sig``; the exit status and the seconds it took to exit."""
        sent = time.monotonic()
        self.proc.send_signal(sig)
        code = self.proc.wait(10)
        took = time.monotonic() - sent
        self._close()
        return code, took

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._close()

    def _close(self) -> None:
        for reader in self._readers:
            reader.join(5)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    yield started
    for agent in started:
        agent.kill()


def parse(text: str) -> dict[Series, float]:
    found: dict[Series, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in found, f"series exported twice: {key}"
            found[key] = sample.value
    return found


def of_root(got: dict[Series, float], root: Path) -> dict[Series, float]:
    return {key: value for key, value in got.items() if dict(key[1]).get("root") == str(root)}


def value(got: dict[Series, float], name: str, root: Path, **labels: str) -> float:
    want = {"root": str(root), "pod_uid": pod_uid_of(root) or "", **labels}
    return got[(name, frozenset(want.items()))]


def resident(*paths: Path) -> int:
    return sum(os.stat(p).st_blocks * 512 for p in paths)


def events_of(events: list[JSON], kind: str) -> list[JSON]:
    return [e for e in events if e["event"] == kind]


# --- the agent over a simulated kubelet node ------------------------------------------------------


@pytest.mark.root
@pytest.mark.slow
def test_the_agent_removes_exactly_the_dead_regions_of_every_pod_and_its_metrics_match_the_disk(
    tmp_path: Path, engine_id: str, agents: list[Agent]
) -> None:
    require_unshare()
    with KubeletNode(tmp_path / "kubelet") as node:
        pod_a, pod_b, pod_c = (
            "pod-a-" + engine_id[-12:],
            "pod-b-" + engine_id[-12:],
            "pod-c-" + engine_id[-12:],
        )
        a, b, c = node.add_pod(pod_a), node.add_pod(pod_b), node.add_pod(pod_c)
        live: dict[Path, Child] = {}
        dead: set[Path] = set()
        try:
            # Pod A: a live vLLM engine in its own PID and mount namespaces, and a crashed one.
            live[region_path(a, f"{engine_id}-a-live")] = Child(
                "vllm", region_path(a, f"{engine_id}-a-live"), prefix=IN_CHILD_PID_NS
            )
            crashed = Child("vllm", region_path(a, f"{engine_id}-a-dead"), prefix=IN_CHILD_PID_NS)
            crashed.kill()
            dead.add(region_path(a, f"{engine_id}-a-dead"))
            # Pod B: a live kvoffload region (lock + owner record) with a segment that only a
            # mapping keeps (the fd closed, as vLLM's segments are held), and a dead region with its
            # segment (base and segment go together).
            base = region_path(b, f"{engine_id}-b-live")
            live[base] = Child("region", base, prefix=IN_CHILD_PID_NS)
            segment = write_file(region_path(b, f"{engine_id}-b-live", 1), size=8 * PAGE, touch=8)
            live[segment] = Child("map-only", segment, prefix=IN_CHILD_PID_NS)
            dead_base = region_path(b, f"{engine_id}-b-dead")
            Child("region", dead_base).kill()
            dead |= {dead_base, write_file(region_path(b, f"{engine_id}-b-dead", 1), size=4 * PAGE, touch=3)}
            # Pod C: a crashed engine only; the pod is deleted while the agent runs.
            Child("vllm", region_path(c, f"{engine_id}-c-dead"), size=2 * PAGE).kill()

            agent = Agent(
                "--root",
                node.glob,
                "--interval",
                "0.2s",
                "--grace",
                "0s",
                "--reap",
                "--listen",
                "127.0.0.1:0",
            )
            agents.append(agent)
            agent.port()
            agent.wait_for(lambda ev: len(events_of(ev, "pass")) >= 1)
            node.delete_pod(pod_c)  # likely mid-pass: the agent scans back to back
            agent.wait_for(
                lambda ev: any(e["event"] == "root_vanished" and e["pod_uid"] == pod_c for e in ev)
            )
            agent.wait_for(
                lambda ev: (
                    {e["engine_id"] for e in events_of(ev, "removed")}
                    >= {f"{engine_id}-a-dead", f"{engine_id}-b-dead"}
                )
            )
            # A live engine of pod A crashes now: it goes too, two passes later.
            victim = region_path(a, f"{engine_id}-a-live")
            live.pop(victim).kill()
            dead.add(victim)
            agent.wait_for(lambda ev: any(e.get("engine_id") == f"{engine_id}-a-live" for e in ev))
            settled = agent.wait_for(agent.passes_after(len(agent.events), 2))
            got = agent.metrics()
            health = agent.get("/healthz")

            on_disk = {p for root in (a, b) for p in root.iterdir()}
            assert on_disk == set(live), "exactly the dead regions are gone, every live one stays"
            assert not any(p.exists() for p in dead)
            removed = events_of(settled, "removed")
            # Pod C may have gone before the agent's second pass over it: then nothing was removed there.
            assert {e["engine_id"] for e in removed} - {f"{engine_id}-c-dead"} == {
                f"{engine_id}-a-dead",
                f"{engine_id}-b-dead",
                f"{engine_id}-a-live",
            }
            assert all(e["files"] == (2 if "-b-" in e["engine_id"] else 1) for e in removed)
            for line in agent.lines:
                validate(json.loads(line), "watch-event")
            assert {e["pod_uid"] for e in events_of(settled, "root_appeared")} == {pod_a, pod_b, pod_c}

            assert of_root(got, c) == {}, "a deleted pod's series are dropped"
            for root, uid in ((a, pod_a), (b, pod_b)):
                files = [p for p in live if p.parent == root]
                assert value(got, "shmctl_scan_success", root) == 1
                # A base and its segments are one region.
                engines = {n.engine_id for p in files if (n := names.parse(p.name)) is not None}
                assert value(got, "shmctl_regions", root, status="live") == len(engines)
                if root == b:  # its live region is a base and a segment: one region, two files
                    assert (len(engines), len(files)) == (1, 2)
                assert value(got, "shmctl_region_files", root, status="live") == len(files)
                assert value(got, "shmctl_regions", root, status="orphaned") == 0
                assert value(got, "shmctl_region_resident_bytes", root, status="live") == resident(*files)
                assert value(got, "shmctl_orphan_bytes", root) == 0
                mine = [e for e in removed if e["root"] == str(root)]
                assert {e["pod_uid"] for e in mine} == {uid}
                assert value(got, "shmctl_reaped_files_total", root) == sum(e["files"] for e in mine)
                assert value(got, "shmctl_reaped_bytes_total", root) == sum(e["bytes"] for e in mine)
                sizes: dict[str, int] = {}
                for p in files:
                    engine = p.name.split(".mmap")[0]
                    sizes[engine] = sizes.get(engine, 0) + p.stat().st_size
                assert value(got, "shmctl_region_size_max_bytes", root) == max(sizes.values(), default=0)
                statvfs = os.statvfs(root)
                assert value(got, "shmctl_root_size_bytes", root) == statvfs.f_blocks * statvfs.f_frsize
            assert got[("shmctl_watch_up", frozenset())] == 1
            assert got[("shmctl_watch_roots", frozenset())] == 2
            assert got[("shmctl_watch_passes_total", frozenset())] >= len(events_of(settled, "pass"))
            assert health == (200, "ok\n")

            code, took = agent.stop()
            assert code == 0, agent.stderr
            assert took < 5  # prompt (test_a_signal_ends_the_agent_with_status_0_within_a_second)
            assert [line for line in agent.stderr if "serving" not in line] == []
        finally:
            for child in live.values():
                child.kill()


@pytest.mark.root
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_agent_with_status_0_within_a_second(
    tmp_path: Path, engine_id: str, agents: list[Agent], sig: int
) -> None:
    with KubeletNode(tmp_path / "kubelet") as node:
        for i in range(20):
            volume = node.add_pod(size="1m")
            write_file(region_path(volume, f"{engine_id}-{i}"), size=PAGE)
        agent = Agent("--root", node.glob, "--interval", "1h", "--grace", "0s", "--reap")
        agents.append(agent)
        agent.wait_for(lambda ev: len(events_of(ev, "pass")) >= 1)
        code, took = agent.stop(sig)
        assert code == 0, agent.stderr
        # Asleep until its next pass in an hour, it must wake for the signal: an agent that
        # slept the interval out would take an hour. A loaded machine can stretch a prompt
        # exit past a second (the documented figure); it cannot stretch it to 5 s.
        assert took < 5
        assert agent.stderr == []


# --- the pass loop's rules, in-process -------------------------------------------------------------


def watcher(root: Path, *, reap_: bool = True) -> tuple[Watcher, list[Any]]:
    """A one-root watcher; with ``reap_`` the root must be on a tmpfs (the ``root`` fixture) for
    anything to go: elsewhere removal is refused (``test_watch_roots``)."""
    seen: list[Any] = []
    config = WatchConfig(roots=(str(root),), interval_s=0, reap=reap_, grace_s=0)
    return Watcher(config, on_event=seen.append), seen


def removed_in(report: PassReport) -> list[str]:
    return sorted(e.name for r in report.roots if r.reaped for e in r.reaped.removed)


def test_an_orphan_goes_in_the_second_pass_that_finds_it_orphaned_and_not_before(
    root: Path, engine_id: str
) -> None:
    path = write_file(region_path(root, engine_id), touch=2)
    w, seen = watcher(root)

    first = w.run_pass()
    assert path.exists()
    second = w.run_pass()

    assert removed_in(first) == []
    assert removed_in(second) == [path.name]
    assert not path.exists()
    assert [(e.engine_id, e.files, e.bytes) for e in seen if isinstance(e, Removed)] == [
        (engine_id, 1, 2 * PAGE)
    ]


def test_a_name_that_now_names_another_inode_starts_over(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    w, _ = watcher(root)
    w.run_pass()
    # Another engine's file under the same name (created before the old one goes, so the
    # filesystem cannot hand out the same inode number again): not the last pass's orphan.
    os.replace(write_file(root / "new"), path)

    assert removed_in(w.run_pass()) == []
    assert path.exists()
    assert removed_in(w.run_pass()) == [path.name]


def test_a_region_live_in_the_last_pass_is_not_removed_in_the_first_pass_it_is_dead(
    root: Path, engine_id: str
) -> None:
    path = region_path(root, engine_id)
    w, _ = watcher(root)
    with Child("vllm", path) as engine:
        assert removed_in(w.run_pass()) == []
        engine.kill()
        assert removed_in(w.run_pass()) == []
        assert path.exists()
    assert removed_in(w.run_pass()) == [path.name]


def test_a_live_region_is_never_removed_however_many_passes(root: Path, engine_id: str) -> None:
    path = region_path(root, engine_id)
    w, _ = watcher(root)
    with Child("map-only", write_file(path)):
        for _ in range(5):
            assert removed_in(w.run_pass()) == []
        assert path.exists()
    path.unlink()


def test_without_reap_nothing_is_removed(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    w, _ = watcher(root, reap_=False)
    for _ in range(3):
        w.run_pass()
    assert path.exists()
    path.unlink()


def test_an_unknown_region_is_kept_and_told_once(root: Path, tmp_path: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id), touch=1)
    config = WatchConfig(
        roots=(str(root),),
        interval_s=0,
        reap=True,
        grace_s=0,
        use_lease=False,
        proc_root=tmp_path / "no-proc",  # no /proc at all: nobody can be shown not to hold it
    )
    seen: list[Any] = []
    w = Watcher(config, on_event=seen.append)
    for _ in range(3):
        w.run_pass()
    unknown = [e for e in seen if isinstance(e, KeptUnknown)]
    assert path.exists()
    assert [(e.engine_id, e.files, e.bytes) for e in unknown] == [(engine_id, 1, PAGE)]
    assert unknown[0].reason
    path.unlink()


def test_a_missing_literal_root_is_unreadable_once_and_never_vanishes(tmp_path: Path) -> None:
    missing = tmp_path / "not-here"
    w, seen = watcher(missing)
    reports = [w.run_pass() for _ in range(3)]
    assert [type(e).event for e in seen if e.event != "pass"] == ["root_appeared", "root_unreadable"]
    assert [e.error for e in seen if isinstance(e, RootUnreadable)] == ["does not exist"]
    assert [r.summary.errors for r in reports] == [1, 1, 1]
    missing.mkdir()
    assert w.run_pass().summary.errors == 0


def test_a_root_the_glob_stops_matching_vanishes_and_its_state_goes(tmp_path: Path, engine_id: str) -> None:
    for name in ("p1", "p2"):
        (tmp_path / "pods" / name / "volumes" / "v").mkdir(parents=True)
    write_file(region_path(tmp_path / "pods" / "p2" / "volumes" / "v", engine_id))
    seen: list[Any] = []
    w = Watcher(
        WatchConfig(roots=(str(tmp_path / "pods/*/volumes/*"),), interval_s=0, grace_s=0),
        on_event=seen.append,
    )
    w.run_pass()
    shutil.rmtree(tmp_path / "pods" / "p2")
    report = w.run_pass()
    assert report.vanished == (tmp_path / "pods" / "p2" / "volumes" / "v",)
    assert [e.pod_uid for e in seen if e.event == "root_vanished"] == ["p2"]
    assert w.watched == (tmp_path / "pods" / "p1" / "volumes" / "v",)


def test_the_pod_uid_is_the_kubelet_paths_own() -> None:
    uid = "0f6c7a3e-1d2b-4c5d-8e9f-0a1b2c3d4e5f"
    assert pod_uid_of(f"/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/dshm") == uid
    assert pod_uid_of("/dev/shm") is None


def test_the_loop_stops_between_roots_when_asked(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"r{i}").mkdir()
    asked = 0

    def should_stop() -> bool:
        nonlocal asked
        asked += 1
        return asked > 3

    w = Watcher(WatchConfig(roots=(str(tmp_path / "r*"),), interval_s=3600), should_stop=should_stop)
    started = time.monotonic()
    assert w.run() == 1
    assert time.monotonic() - started < 60  # it did not sleep out the interval
    assert w.passes == 1


def test_reap_stops_between_regions_and_keeps_the_rest_orphaned(root: Path, engine_id: str) -> None:
    paths = [write_file(region_path(root, f"{engine_id}-{i}")) for i in range(3)]
    asked = 0

    def after_one() -> bool:
        nonlocal asked
        asked += 1
        return asked > 1

    done = reap(root, grace_s=0, should_stop=after_one)

    assert [e.name for e in done.removed] == [paths[0].name]
    assert sorted(e.name for e in done.kept) == [p.name for p in paths[1:]]
    assert {e.status for e in done.kept} == {Status.ORPHANED}
    assert all("stopped" in e.reason for e in done.kept)
    for p in paths[1:]:
        p.unlink()


# --- health, the command line ----------------------------------------------------------------------


def test_healthz_needs_a_pass_within_three_intervals_and_a_live_loop(tmp_path: Path) -> None:
    now = [100.0]
    metrics = WatchMetrics(interval_s=2, monotonic=lambda: now[0])
    w = Watcher(WatchConfig(roots=(str(tmp_path),), interval_s=2))
    assert not metrics.healthy()
    metrics.record(w.run_pass())
    assert metrics.healthy()
    now[0] += 6.0
    assert metrics.healthy()
    now[0] += 0.1
    assert not metrics.healthy()
    metrics.record(w.run_pass())
    metrics.alive = False
    assert not metrics.healthy()


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("--root", "relative/*"), "--root"),
        (("--root", ""), "--root"),
        (("--root", "  "), "--root"),
        (("--listen", "nonsense"), "--listen"),
        (("--listen", "127.0.0.1:99999"), "--listen"),
        (("--listen", "::1:9477"), "--listen"),
        (("--interval", "0"), "--interval"),
        (("--interval", "soon"), "--interval"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag_and_exit_2(
    tmp_path: Path, engine_id: str, args: tuple[str, ...], flag: str
) -> None:
    orphan = write_file(region_path(tmp_path, engine_id))
    result = shmctl("watch", "--root", str(tmp_path), "--grace", "0s", "--reap", "--max-passes", "3", *args)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"shmctl: error: {flag}") or flag in lines[0]
    assert "fix:" in lines[0]
    assert orphan.exists()
    orphan.unlink()


def test_a_port_in_use_is_a_usage_error_before_anything_is_removed(tmp_path: Path, engine_id: str) -> None:
    orphan = write_file(region_path(tmp_path, engine_id))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = shmctl(
            "watch", "--root", str(tmp_path), "--grace", "0s", "--reap", "--listen", f"127.0.0.1:{port}"
        )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        f"shmctl: error: --listen: 127.0.0.1:{port}: address already in use "
        "(fix: pick another port, or stop what listens there)\n"
    )
    assert orphan.exists()
    orphan.unlink()


def test_two_passes_on_the_command_line_reap_an_orphan_and_every_line_is_an_event(
    root: Path, engine_id: str
) -> None:
    orphan = write_file(region_path(root, engine_id), touch=3)

    result = shmctl(
        "watch",
        "--root",
        str(root),
        "--grace",
        "0s",
        "--reap",
        "--max-passes",
        "2",
        "--interval",
        "0.05s",
    )

    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    events = [json.loads(line) for line in result.stdout.splitlines()]
    for event in events:
        validate(event, "watch-event")
    assert [e["event"] for e in events] == ["root_appeared", "pass", "removed", "pass"]
    assert events[2] == {
        "event": "removed",
        "time": events[2]["time"],
        "root": str(root),
        "pod_uid": None,
        "engine_id": engine_id,
        "bytes": 3 * PAGE,
        "files": 1,
    }
    assert events[3]["removed_files"] == 1
    assert events[3]["orphaned_bytes"] == 0
    assert not orphan.exists()


def test_listen_addresses_parse_as_host_and_port() -> None:
    assert parse_listen("127.0.0.1:9477") == ("127.0.0.1", 9477)
    assert parse_listen("[::1]:0") == ("::1", 0)
    assert parse_listen(":9477") == ("", 9477)
    assert parse_listen("[::]:9477") == ("::", 9477)
    with pytest.raises(ConfigError, match="--listen"):
        parse_listen("9477")


def test_with_reap_every_root_counts_from_0_and_a_vanished_roots_series_go(
    root: Path, engine_id: str
) -> None:
    pods = root / "pods"
    clean, leaky = pods / "clean" / "volumes" / "v", pods / "leaky" / "volumes" / "v"
    clean.mkdir(parents=True)
    leaky.mkdir(parents=True)
    orphan = write_file(region_path(leaky, engine_id), touch=2)
    metrics = WatchMetrics(interval_s=1, reaping=True)
    w = Watcher(WatchConfig(roots=(str(pods / "*/volumes/*"),), interval_s=0, reap=True, grace_s=0))
    for _ in range(2):
        metrics.record(w.run_pass())
    got = parse(metrics.text().decode())
    assert value(got, "shmctl_reaped_files_total", clean) == 0
    assert value(got, "shmctl_reaped_files_total", leaky) == 1
    assert value(got, "shmctl_reaped_bytes_total", leaky) == 2 * PAGE
    assert not orphan.exists()

    shutil.rmtree(pods / "leaky")
    metrics.record(w.run_pass())

    got = parse(metrics.text().decode())
    assert of_root(got, leaky) == {}
    assert value(got, "shmctl_scan_success", clean) == 1
    assert got[("shmctl_watch_roots", frozenset())] == 1
    assert metrics.series_roots == (clean,)
