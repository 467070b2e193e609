"""``shmctl watch --listen``: prometheus-client's exposition, on a server no client can starve.

The formats (HEAD, gzip, OpenMetrics) and the listen forms are asked of the real server in
this process over loopback. The abuse is done to a real agent (``python -m shmctl watch``)
scanning real pod-volume directories, its ``RLIMIT_NOFILE`` lowered to 1,024 as a node's
container runtime may set it: 1,200 half-open connections, 1,500 idle keep-alive ones,
1,000 requests aborted in four ways. Every loop here is bounded in count and in time.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import os
import queue
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.errors import ConfigError
from kvoffload.liveness.watch import WatchConfig, Watcher
from shmctl.serve import server as server_http
from shmctl.serve.agent import serving
from shmctl.serve.state import WatchMetrics
from tests.support.procs import REPO, region_path, write_file

NOFILE = 1024
JSON = dict[str, Any]
#: How long a test waits for the agent at most (a bound of the test, not a contract): a hang
#: guard, far beyond what a loaded machine takes.
PATIENCE_S = 300.0

#: Runs shmctl with RLIMIT_NOFILE lowered (soft and hard), as ``prlimit --nofile`` would.
LIMITED = textwrap.dedent(
    """
    import resource, runpy, sys
    limit = int(sys.argv.pop(1))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    sys.argv[0] = "shmctl"
    runpy.run_module("shmctl", run_name="__main__", alter_sys=True)
    """
)


# --- the formats, in this process -------------------------------------------------------------


@pytest.fixture
def port(tmp_path: Path) -> Iterator[int]:
    """A server for one scanned root, on loopback; its port."""
    metrics = WatchMetrics(interval_s=60)
    metrics.record(Watcher(WatchConfig(roots=(str(tmp_path),), interval_s=60)).run_pass())
    with serving("127.0.0.1:0", metrics) as (_, bound):
        yield bound


@dataclass(frozen=True)
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes


def ask(port: int, method: str, path: str, host: str = "127.0.0.1", **headers: str) -> Answer:
    """One request on a new connection (``Accept_Encoding`` for ``Accept-Encoding``); closed after."""
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path, headers={k.replace("_", "-"): v for k, v in headers.items()})
        answer = conn.getresponse()
        return Answer(answer.status, answer.headers, answer.read())
    finally:
        conn.close()


def test_head_metrics_is_get_without_the_body(port: int) -> None:
    with contextlib.closing(http.client.HTTPConnection("127.0.0.1", port, timeout=10)) as conn:
        conn.request("HEAD", "/metrics")
        head = conn.getresponse()
        assert head.read() == b""
        # The same connection next: a body sent after the HEAD answer would garble this one.
        conn.request("GET", "/metrics")
        get = conn.getresponse()
        body = get.read()

    assert head.status == get.status == 200
    assert (
        head.getheader("Content-Type")
        == get.getheader("Content-Type")
        == "text/plain; version=0.0.4; charset=utf-8"
    )
    assert int(head.getheader("Content-Length") or -1) == len(body)
    assert "shmctl_watch_up" in {f.name for f in text_string_to_metric_families(body.decode())}


def test_metrics_are_gzipped_for_a_client_that_accepts_it(port: int) -> None:
    zipped = ask(port, "GET", "/metrics", Accept_Encoding="gzip")
    plain = ask(port, "GET", "/metrics")

    assert zipped.headers["Content-Encoding"] == "gzip"
    assert plain.headers["Content-Encoding"] is None
    text = gzip.decompress(zipped.body).decode()
    assert {f.name for f in text_string_to_metric_families(text)} == {
        f.name for f in text_string_to_metric_families(plain.body.decode())
    }


def test_openmetrics_is_what_an_openmetrics_client_gets(port: int) -> None:
    answer = ask(port, "GET", "/metrics", Accept="application/openmetrics-text; version=1.0.0; charset=utf-8")

    assert answer.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    text = answer.body.decode()
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in openmetrics_families(text)}  # type: ignore[no-untyped-call]
    assert families["shmctl_watch_up"].samples[0].value == 1
    assert families["shmctl_watch_passes"].type == "counter"


def samples(text: str) -> set[tuple[str, frozenset[tuple[str, str]], float]]:
    return {
        (s.name, frozenset(s.labels.items()), s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name != "shmctl_lease_break_time_seconds"  # read again per scrape
    }


def test_the_exposition_served_is_the_agents_own_whatever_the_names(tmp_path: Path, engine_id: str) -> None:
    for name in (b'q"uote', b"back\\slash", b"new\nline", b"brace}{#", b"\xff\xfe", b"caf\xc3\xa9"):
        volume = os.fsencode(tmp_path) + b"/" + name
        os.mkdir(volume)
        write_file(region_path(Path(os.fsdecode(volume)), engine_id + os.fsdecode(b"-\xff")))
    metrics = WatchMetrics(interval_s=60)
    metrics.record(Watcher(WatchConfig(roots=(f"{tmp_path}/*",), interval_s=60, grace_s=0)).run_pass())

    with serving("127.0.0.1:0", metrics) as (_, port):
        served = ask(port, "GET", "/metrics")

    assert served.status == 200
    own = samples(metrics.text().decode())
    assert len({dict(labels).get("root") for _, labels, _ in own} - {None}) == 6
    assert samples(served.body.decode()) == own


def test_healthz_and_an_unknown_path_answer_as_before(port: int) -> None:
    health = ask(port, "GET", "/healthz")
    assert (health.status, health.body) == (200, b"ok\n")
    assert ask(port, "GET", "/nothing").status == 404
    refused = ask(port, "POST", "/metrics")
    assert (refused.status, refused.headers["Allow"]) == (405, "GET, HEAD")


def has_ipv6() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("form", [":0", "[::]:0"], ids=["every-address", "ipv6-any"])
def test_listen_on_every_address_answers_ipv4_and_ipv6_loopback(tmp_path: Path, form: str) -> None:
    if form.startswith("[") and not has_ipv6():
        pytest.skip("no IPv6 on this machine")
    metrics = WatchMetrics(interval_s=60)
    metrics.record(Watcher(WatchConfig(roots=(str(tmp_path),), interval_s=60)).run_pass())
    with serving(form, metrics) as (_, bound):
        hosts = ["127.0.0.1", "::1"] if has_ipv6() else ["127.0.0.1"]
        for host in hosts:
            answer = ask(bound, "GET", "/healthz", host=host)
            assert (answer.status, answer.body) == (200, b"ok\n"), host


def test_listen_forms_that_are_not_addresses_are_usage_errors(tmp_path: Path) -> None:
    metrics = WatchMetrics(interval_s=60)
    for form in ("9477", ":port", "[nonsense]:1", "::1:9477"):
        with pytest.raises(ConfigError, match="--listen"), serving(form, metrics):
            pass


# --- the agent, abused ----------------------------------------------------------------------------


class Agent:
    """``shmctl watch ARGS`` at ``RLIMIT_NOFILE`` ``nofile``; its events and stderr as they come."""

    def __init__(self, *args: str, nofile: int = NOFILE) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LIMITED, str(nofile), "watch", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
        )
        self.events: list[JSON] = []
        self.stderr: list[str] = []
        self._new: queue.Queue[None] = queue.Queue()
        self._readers = [
            threading.Thread(target=self._read_events, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_events(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.append(json.loads(line.decode("utf-8", "strict")))
            self._new.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line.decode("utf-8", "replace"))
            self._new.put(None)

    def wait_for(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + PATIENCE_S
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}; stderr: {self.stderr}"
            assert self.proc.poll() is None, f"the agent exited: {self.stderr}"
            with contextlib.suppress(queue.Empty):
                self._new.get(timeout=0.2)

    def port(self) -> int:
        """The port it bound (``--listen 127.0.0.1:0``), from its note on stderr."""

        def notes() -> list[str]:
            return [line for line in self.stderr if "serving /metrics" in line]

        self.wait_for(lambda: bool(notes()), "its address")
        return int(notes()[0].rsplit(":", 1)[1])

    def passes(self) -> list[JSON]:
        return [e for e in self.events if e["event"] == "pass"]

    def wait_passes(self, n: int) -> list[JSON]:
        """``n`` pass events after those seen so far."""
        before = len(self.passes())
        self.wait_for(lambda: len(self.passes()) >= before + n, f"{n} passes")
        return self.passes()[before:]

    def threads(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
        raise AssertionError("no Threads line in /proc/PID/status")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(10)
        for reader in self._readers:
            reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for reader in self._readers:
            reader.join(5)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def node(tmp_path: Path, engine_id: str) -> str:
    """20 pod volumes with an orphan each (kept: no --reap), as a kubelet glob."""
    for i in range(20):
        volume = tmp_path / "pods" / f"uid-{i}" / "volumes" / "kubernetes.io~empty-dir" / "dshm"
        volume.mkdir(parents=True)
        write_file(region_path(volume, f"{engine_id}-{i}"))
    return str(tmp_path / "pods/*/volumes/kubernetes.io~empty-dir/*")


@pytest.fixture
def agent(node: str) -> Iterator[Agent]:
    started = Agent("--root", node, "--interval", "0.2s", "--grace", "0s", "--listen", "127.0.0.1:0")
    try:
        started.wait_passes(1)
        yield started
    finally:
        started.kill()


@pytest.fixture
def many_sockets() -> Iterator[None]:
    """This process may open what the tests below open (1,500 sockets and its own files)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"needs RLIMIT_NOFILE {want} for its clients, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def healthz(port: int) -> tuple[int, bytes]:
    """GET /healthz on a new connection: status and body."""
    answer = ask(port, "GET", "/healthz")
    return answer.status, answer.body


def still_waiting(sock: socket.socket) -> bool:
    """The server has neither answered nor closed this connection (it still waits for its head):
    nothing to read, no end of file, no error, asked of the kernel without waiting."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLRDHUP)
    return not poller.poll(0)


def scanned_cleanly(passes: list[JSON]) -> bool:
    return all(p["roots"] == 20 and p["errors"] == 0 for p in passes)


def no_trouble(agent: Agent) -> list[str]:
    """The agent's stderr lines other than its note of the address (and rate-limited notes)."""
    return [line for line in agent.stderr if "serving /metrics" not in line]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("cpu-heavy")  # CPU-bound: one at a time, never against each other
@pytest.mark.usefixtures("many_sockets")
def test_1200_half_open_connections_neither_delay_healthz_nor_stop_a_scan(agent: Agent) -> None:
    port = agent.port()
    baseline_fds = agent.fds()
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + PATIENCE_S
        for i in range(1200):
            assert time.monotonic() < deadline, f"only {i} connections made"
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            held.append(sock)
            if i % 2:
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        fds_during = agent.fds()

        status, body = healthz(port)

        assert (status, body) == (200, b"ok\n")
        # Past the cap the server closes the longest-idle connections, so it holds only the latest
        # ones. Queued behind them, /healthz would be answered only once the server had given up
        # on their heads (READ_TIMEOUT_S) and closed them. Answered while some of the latest still
        # wait: it was never behind them, however loaded the machine.
        latest = held[-server_http.MAX_CONNECTIONS // 2 :]
        assert any(still_waiting(sock) for sock in latest), (
            f"none of the latest {len(latest)} half-open connections still waited when /healthz was answered"
        )
        # The connection cap, and a few fds the scan holds at the moment it is looked at.
        assert fds_during <= baseline_fds + server_http.MAX_CONNECTIONS + 8, (baseline_fds, fds_during)
        passes = agent.wait_passes(3)
    finally:
        for sock in held:
            sock.close()

    assert scanned_cleanly(passes), passes
    assert not [e for e in agent.events if e["event"] == "root_unreadable"]
    assert no_trouble(agent) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("cpu-heavy")  # CPU-bound: one at a time, never against each other
@pytest.mark.usefixtures("many_sockets")
def test_1500_idle_keep_alive_connections_cost_no_thread(agent: Agent) -> None:
    port = agent.port()
    for path in ("/metrics", "/healthz"):
        assert ask(port, "GET", path).status == 200
    warm = agent.threads()
    held: list[http.client.HTTPConnection] = []
    try:
        deadline = time.monotonic() + PATIENCE_S
        for i in range(1500):
            assert time.monotonic() < deadline, f"only {i} connections made"
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/healthz")
            answer = conn.getresponse()
            assert (answer.status, answer.read()) == (200, b"ok\n")
            assert not answer.will_close, "kept alive"
            held.append(conn)
        threads = agent.threads()
        passes = agent.wait_passes(2)
    finally:
        for conn in held:
            conn.close()

    assert threads <= warm + server_http.SCRAPE_WORKERS, (warm, threads)
    assert scanned_cleanly(passes), passes
    assert no_trouble(agent) == []


def reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), as a client killed mid-request does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def abort(port: int, how: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if how == 0:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n")
        reset(sock)
    elif how == 1:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.recv(1)  # the answer has begun
        reset(sock)
    elif how == 2:
        sock.sendall(b"GET /met")
        sock.close()
    else:
        reset(sock)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("cpu-heavy")  # CPU-bound: one at a time, never against each other
def test_1000_aborted_requests_print_no_traceback_and_at_most_a_line_a_kind(agent: Agent) -> None:
    port = agent.port()
    deadline = time.monotonic() + PATIENCE_S
    for i in range(1000):
        assert time.monotonic() < deadline, f"only {i} requests made"
        abort(port, i % 4)

    status, body = healthz(port)
    passes = agent.wait_passes(2)
    code = agent.stop()

    assert (status, body) == (200, b"ok\n")
    assert code == 0
    assert scanned_cleanly(passes)
    lines = no_trouble(agent)
    assert not [line for line in lines if "Traceback" in line or not line.startswith("shmctl: ")], lines
    assert len(lines) <= 2, lines


# --- the server's own limits ------------------------------------------------------------------------

#: More than loopback's socket buffers hold (tcp_wmem and tcp_rmem at most 4 and 6 MiB by default).
BIG = b"x" * (16 << 20)


def big_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "application/octet-stream")])
    return [BIG]


def test_clients_that_leave_mid_answer_are_one_rate_limited_line() -> None:
    said: list[str] = []
    sock = server_http.listening_socket("127.0.0.1", 0)
    server = server_http.Server(sock, big_app, log=said.append)
    with server_http.serving(server):
        port = server.address[1]
        for _ in range(200):
            abort(port, 1)  # the answer cannot all be in flight when the RST comes
        answer = ask(port, "GET", "/")
        assert answer.status == 200
        assert len(answer.body) == len(BIG)

    assert len(said) == 1, said
    assert said[0].startswith("--listen: a client went away before its answer was sent")


def test_a_head_that_does_not_arrive_in_time_closes_its_connection() -> None:
    sock = server_http.listening_socket("127.0.0.1", 0)
    server = server_http.Server(sock, big_app, log=lambda line: None, read_timeout_s=0.2)
    with server_http.serving(server), socket.create_connection(server.address, timeout=10) as slow:
        slow.sendall(b"GET / HTTP/1.1\r\n")
        assert slow.recv(1) == b"", "closed, no answer"


EMFILE_SERVER = textwrap.dedent(
    """
    import resource, sys
    from shmctl.serve import server as http
    sock = http.listening_socket("127.0.0.1", 0)
    resource.setrlimit(resource.RLIMIT_NOFILE, (24, 24))

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    server = http.Server(sock, app, log=lambda line: print(line, file=sys.stderr), max_connections=1000)
    with http.serving(server):
        print(server.address[1], flush=True)
        sys.stdin.read()
    """
)


def test_out_of_fds_on_accept_is_one_line_and_the_server_recovers() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", EMFILE_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdin is not None
        port = int(child.stdout.readline())
        held = []
        for _ in range(60):  # far more than 24 fds: accept(2) fails with EMFILE
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never finished: each stays open
            held.append(sock)
        time.sleep(1.5)  # several pauses of accepting (ACCEPT_PAUSE_S)
        for sock in held:
            sock.close()
        answer = ask(port, "GET", "/")
        assert (answer.status, answer.body) == (200, b"ok")
        child.stdin.close()
        child.wait(10)
        stderr = child.stderr.read() if child.stderr else ""
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        for pipe in (child.stdout, child.stderr):
            if pipe is not None:
                pipe.close()

    lines = stderr.splitlines()
    assert "Traceback" not in stderr
    assert len(lines) == 1, lines
    assert "Too many open files" in lines[0]
