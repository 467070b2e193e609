"""Real components for the node agent's end-to-end test (tests/system/test_agent_e2e.py).

* ``AgentSpec``: the DaemonSet's agent container (deploy/kubernetes/daemonset.yaml) as data: its
  arguments, its environment and its security context. The sandbox is built from it, so a
  capability added to the manifest is a capability the test's agents get.
* ``Sandbox``: a process in a bubblewrap (``bwrap``) sandbox with that context: uid 0 with only
  the listed capabilities (effective, permitted and bounding), no_new_privs, its own PID
  namespace (it is PID 1 there, as a container's command is, and sees its own ``/proc``), its
  own IPC namespace, a read-only root and only its pod volume writable. The network is the
  host's, so Prometheus scrapes it on loopback. Not reproduced: the RuntimeDefault seccomp
  profile (the container runtime's own filter; nothing the agent does needs a syscall it
  denies) and the cgroup limits.
* ``Engine``: a holder of a region file in a pod volume, in a sandbox of its own (own PID and
  IPC namespaces, the volume at ``/dev/shm`` as in a vLLM pod), under an unprivileged uid.
* ``Prometheus``: the real server (Debian's ``prometheus`` binary) scraping the agents every
  second, with the shipped alert rules, their ``for:`` shortened; queried through its HTTP API.

Every one is a context manager whose ``close()`` kills what it started and is idempotent.
Nothing leaves loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import pytest
import yaml  # type: ignore[import-untyped]

from tests.support.procs import REPO

DAEMONSET = REPO / "deploy" / "kubernetes" / "daemonset.yaml"
RULES = REPO / "deploy" / "prometheus" / "shmctl-rules.yaml"
#: Where .ci/run puts the binaries it takes out of Debian's prometheus package.
CI_TOOLS = REPO / "build" / "tools"
#: The uid the engines run under: a pod's ``runAsUser``, not the agent's, so the agent needs
#: its capabilities to open (DAC_READ_SEARCH) and lease (LEASE) their 0600 files.
ENGINE_UID = 1000
#: The scrape job the alert rules select (the PodMonitor takes it from the pods' label).
JOB = "shmctl-watch"

#: linux/capability.h, in number order: the numbers behind the manifest's capability names.
# fmt: off
_CAPABILITY_NAMES = (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
    "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
    "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
    "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL",
    "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ",
    "PERFMON", "BPF", "CHECKPOINT_RESTORE",
)
# fmt: on
CAPABILITIES = {name: number for number, name in enumerate(_CAPABILITY_NAMES)}

T = TypeVar("T")


# -- what the test needs, or why it skips -------------------------------------------------------


def tool(name: str) -> str | None:
    """``name`` on the venv's bin, build/tools (.ci/run) or PATH."""
    search = os.pathsep.join([str(Path(sys.executable).parent), str(CI_TOOLS), os.environ.get("PATH", "")])
    return shutil.which(name, path=search)


def require_sandbox() -> str:
    """The bwrap binary, once it has shown it can build the agent's sandbox here; skip otherwise."""
    if os.geteuid() != 0:
        pytest.skip("the agents run as uid 0 with added capabilities, as in the DaemonSet: needs root")
    bwrap = tool("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap is not installed (Debian: apt-get install bubblewrap; .ci/run installs it)")
    if tool("setpriv") is None:
        pytest.skip("setpriv is not installed (Debian: util-linux)")
    probe = subprocess.run(
        [bwrap, *_namespaces(own_pid=True, own_ipc=True), "--ro-bind", "/", "/", "--proc", "/proc", "true"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"bwrap cannot build a sandbox here: {probe.stderr.strip() or probe.returncode}")
    return bwrap


def require_prometheus() -> str:
    found = tool("prometheus")
    if found is None:
        pytest.skip(
            "the prometheus server is not installed (Debian's prometheus package; "
            ".ci/run extracts its binary into build/tools)"
        )
    return found


# -- the DaemonSet's agent, as data -------------------------------------------------------------


@dataclass(frozen=True)
class AgentSpec:
    """The agent container of deploy/kubernetes/daemonset.yaml."""

    args: tuple[str, ...]
    env: dict[str, str]
    capabilities: tuple[str, ...]
    run_as_user: int
    read_only_root: bool
    own_pid_namespace: bool
    own_ipc_namespace: bool

    @property
    def capability_mask(self) -> int:
        """CapEff/CapPrm/CapBnd as /proc/PID/status shows them for this container."""
        return sum(1 << CAPABILITIES[name] for name in self.capabilities)

    def watch_args(self, *, root: str, interval: str, grace: str, listen: str) -> list[str]:
        """The container's arguments with the node's roots, timings and address the test's own.

        Every other option (``--reap``, ``--all-users``, whatever the manifest adds) is kept, so
        the agents run as the DaemonSet runs them.
        """
        replaced = {"--interval": interval, "--grace": grace, "--listen": listen}
        out: list[str] = []
        args = list(self.args)
        while args:
            arg = args.pop(0)
            name, eq, _ = arg.partition("=")
            if name == "--root" or name in replaced:
                if not eq:
                    args.pop(0)
                if name in replaced:
                    out += [name, replaced.pop(name)]
                continue
            out.append(arg)
        assert not replaced, f"the DaemonSet's agent has no {sorted(replaced)}: update tests/support/e2e.py"
        return [*out, "--root", root]


def daemonset_agent() -> AgentSpec:
    docs = [doc for doc in yaml.safe_load_all(DAEMONSET.read_text()) if doc]
    (daemonset,) = (doc for doc in docs if doc["kind"] == "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    context = container["securityContext"]
    caps = context["capabilities"]
    # What the sandbox reproduces; anything else in the manifest must be added here first.
    assert caps["drop"] == ["ALL"], caps
    assert not pod.get("hostNetwork"), "the sandbox shares loopback only because the pod has its own network"
    assert container["command"] == ["shmctl"], container["command"]
    assert not context.get("privileged"), context
    assert context.get("allowPrivilegeEscalation") is False, "bwrap always sets no_new_privs"
    return AgentSpec(
        args=tuple(container["args"]),
        env={e["name"]: e["value"] for e in container.get("env", [])},
        capabilities=tuple(caps.get("add", [])),
        run_as_user=context["runAsUser"],
        read_only_root=context["readOnlyRootFilesystem"],
        own_pid_namespace=not pod.get("hostPID", False),
        own_ipc_namespace=not pod.get("hostIPC", False),
    )


# -- sandboxes ----------------------------------------------------------------------------------


def _namespaces(*, own_pid: bool, own_ipc: bool) -> list[str]:
    return [*(["--unshare-pid"] if own_pid else []), *(["--unshare-ipc"] if own_ipc else [])]


def _environment(extra: dict[str, str]) -> list[str]:
    """A container's environment: PATH and what the manifest sets, nothing of pytest's own
    (pytest-cov's variables would start coverage in every sandboxed interpreter)."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", **extra}
    return ["--clearenv", *(arg for k, v in env.items() for arg in ("--setenv", k, v))]


def agent_sandbox(bwrap: str, spec: AgentSpec, volume: Path) -> list[str]:
    """The argv prefix that runs a command with ``spec``'s security context, ``volume`` writable.

    bwrap keeps the listed capabilities in the effective, permitted, inheritable and ambient
    sets but leaves the bounding set whole; ``setpriv`` (one more capability, SETPCAP, which it
    drops with the bounding set) narrows it to the same list, so nothing the process execs can
    get any other capability back: the container's bounding set.
    """
    if spec.run_as_user != 0:
        pytest.skip("the sandbox reproduces an agent that runs as uid 0 only")
    caps = [c.lower() for c in spec.capabilities]
    keep = ",".join(["-all", *(f"+{c}" for c in caps)])
    return [
        bwrap,
        "--die-with-parent",
        "--new-session",
        *_namespaces(own_pid=spec.own_pid_namespace, own_ipc=spec.own_ipc_namespace),
        # The container's command is PID 1 of its namespace: no reaper in between.
        *(["--as-pid-1"] if spec.own_pid_namespace else []),
        "--ro-bind" if spec.read_only_root else "--bind",
        "/",
        "/",
        "--dev",
        "/dev",
        # Its own PID namespace's /proc: the agent sees only its own processes (hostPID off).
        "--proc",
        "/proc",
        "--bind",
        str(volume),
        str(volume),
        "--chdir",
        str(REPO),
        *_environment(spec.env),
        "--cap-drop",
        "ALL",
        *(arg for c in [*caps, "setpcap"] for arg in ("--cap-add", f"CAP_{c.upper()}")),
        "--",
        "setpriv",
        f"--bounding-set={keep}",
        f"--inh-caps={keep}",
        f"--ambient-caps={keep}",
        "--",
    ]


def engine_sandbox(bwrap: str, volume: Path) -> list[str]:
    """The argv prefix of an engine: its own PID and IPC namespaces, no capability but the two
    it needs to become its pod's uid (ENGINE_SCRIPT does that, and a uid change from 0 clears
    them), its pod's memory volume at ``/dev/shm`` as vLLM sees it."""
    return [
        bwrap,
        "--die-with-parent",
        "--new-session",
        *_namespaces(own_pid=True, own_ipc=True),
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--bind",
        str(volume),
        "/dev/shm",
        "--chdir",
        str(REPO),
        *_environment({"PYTHONUNBUFFERED": "1"}),
        "--cap-drop",
        "ALL",
        "--cap-add",
        "CAP_SETUID",
        "--cap-add",
        "CAP_SETGID",
        "--",
    ]


class Sandbox:
    """A sandboxed command; output to files (a pipe nobody reads would block it)."""

    def __init__(self, argv: Sequence[str], log_dir: Path, name: str) -> None:
        self.name = name
        self.stdout_path = log_dir / f"{name}.stdout"
        self.stderr_path = log_dir / f"{name}.stderr"
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=err)

    def inner_pid(self, timeout: float = 30) -> int:
        """The host pid of the sandbox's PID 1 (bwrap's child): the agent itself."""
        return wait_for(
            lambda: next(iter(children(self.proc.pid)), None),
            timeout,
            f"{self.name}: bwrap's child",
            alive=self.check_alive,
        )

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited {self.proc.returncode}: {self.stderr_tail()}")

    def stderr_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.stderr_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def events(self) -> list[dict[str, Any]]:
        """The JSON event lines written so far, each strict UTF-8 (a line cut by a kill is left out)."""
        *lines, _cut = self.stdout_path.read_bytes().split(b"\n")
        return [json.loads(line.decode("utf-8")) for line in lines]

    def kill(self) -> None:
        kill_sandbox(self.proc)

    close = kill

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Agent(Sandbox):
    """``shmctl watch`` with the DaemonSet's arguments and security context over one volume."""

    def __init__(
        self,
        bwrap: str,
        spec: AgentSpec,
        *,
        volume: Path,
        root: str,
        interval: str,
        grace: str,
        log_dir: Path,
        name: str,
    ) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.volume = volume
        args = spec.watch_args(root=root, interval=interval, grace=grace, listen=self.address)
        super().__init__(
            [*agent_sandbox(bwrap, spec, volume), sys.executable, "-m", "shmctl", *args], log_dir, name
        )

    def get(self, path: str) -> tuple[int, str]:
        return http_get(f"http://{self.address}{path}")

    def wait_healthy(self, timeout: float = 60) -> None:
        def healthy() -> bool:
            try:
                return self.get("/healthz")[0] == 200
            except OSError:
                return False

        wait_for(lambda: healthy() or None, timeout, f"{self.name}: /healthz 200", alive=self.check_alive)


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def kill_sandbox(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL bwrap and wait until the sandbox's PID 1 is gone as well: it dies with bwrap
    (--die-with-parent), and with it every process of its PID namespace, as when a container
    is killed. Idempotent."""
    inner = children(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    wait_for(
        lambda: True if not any(running(pid) for pid in inner) else None, 30, "the sandbox's PID 1 to die"
    )


# -- engines ------------------------------------------------------------------------------------

#: Holds a region file like an engine (argv: mode, path, size, uid); prints ``ready``, waits on
#: stdin. ``vllm``: vLLM 0.33's own way (O_CREAT|O_EXCL, 0600, ftruncate, MAP_SHARED with the fd
#: kept), populated so its pages are resident as a running engine's are; ``region``: kvoffload's
#: SharedOffloadRegion (flock + owner record). It imports everything first and only then becomes
#: ``uid``: where the interpreter's stdlib is private to root (a pyenv under /root), the engine's
#: uid could not import it.
ENGINE_SCRIPT = r"""
import mmap, os, sys
from pathlib import Path
from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion
mode, path, size, uid = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
keep = []
if mode == "vllm":
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)
    keep += [fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED)]
elif mode == "region":
    engine_id = path.name[len("vllm_offload_"):-len(".mmap")]
    keep.append(SharedOffloadRegion(engine_id, 4, None, 2 * PAGESIZE, PAGESIZE, root=path.parent))
else:
    raise SystemExit(f"unknown mode {mode}")
print("ready", flush=True)
sys.stdin.read()
"""


class Engine:
    """An engine holding ``vllm_offload_<engine_id>.mmap`` in ``volume`` from its own sandbox."""

    def __init__(self, bwrap: str, volume: Path, engine_id: str, mode: str, size: int) -> None:
        self.engine_id = engine_id
        self.path = volume / f"vllm_offload_{engine_id}.mmap"
        self.proc = subprocess.Popen(
            [
                *engine_sandbox(bwrap, volume),
                sys.executable,
                "-c",
                ENGINE_SCRIPT,
                mode,
                f"/dev/shm/{self.path.name}",
                str(size),
                str(ENGINE_UID),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline() != b"ready\n":
            assert self.proc.stderr is not None
            self.proc.kill()
            why = self.proc.stderr.read().decode(errors="replace").strip()
            self.kill()
            raise RuntimeError(f"engine {engine_id} ({mode}) did not start: {why}")
        self.inode = self.path.stat().st_ino

    def kill(self) -> None:
        """SIGKILL its sandbox: no cleanup code runs, as with an OOM kill."""
        kill_sandbox(self.proc)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()

    close = kill

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# -- Prometheus ---------------------------------------------------------------------------------


def shortened_rules(dest: Path, for_: str) -> dict[str, dict[str, Any]]:
    """The shipped rules with every ``for:`` set to ``for_``, written to ``dest``; by alert name."""
    doc = yaml.safe_load(RULES.read_text())
    alerts: dict[str, dict[str, Any]] = {}
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = for_
            if "alert" in rule:
                alerts[rule["alert"]] = rule
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return alerts


class Prometheus:
    """A Prometheus server on loopback scraping ``targets`` (instance → ``node`` label) as
    job ``shmctl-watch`` every second and evaluating ``rules`` every second."""

    def __init__(self, binary: str, workdir: Path, targets: dict[str, str], rules: Path) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {
                    "job_name": JOB,
                    "static_configs": [
                        {"targets": [instance], "labels": {"node": node}}
                        for instance, node in targets.items()
                    ],
                }
            ],
        }
        config_file = workdir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = workdir / "prometheus.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config_file}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address={self.address}",
                    "--log.level=warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise AssertionError(f"prometheus exited {self.proc.returncode}: {tail}")

    def wait_ready(self, timeout: float = 60) -> None:
        def ready() -> bool:
            try:
                return http_get(f"http://{self.address}/-/ready")[0] == 200
            except OSError:
                return False

        wait_for(lambda: ready() or None, timeout, "prometheus ready", alive=self.check_alive)

    def api(self, path: str, **params: str) -> Any:
        url = f"http://{self.address}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        status, body = http_get(url)
        reply = json.loads(body)
        assert status == 200, f"{url}: {status} {body[:500]}"
        assert reply["status"] == "success", f"{url}: {body[:500]}"
        return reply["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector: ``[{"metric": {...}, "value": [t, "v"]}, ...]``."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    def targets(self) -> list[str]:
        """One line per scrape target: its health, last error and how long its last scrape took."""
        return [
            f"{t['scrapeUrl']}: {t['health']} {t['lastError']!r} ({t['lastScrapeDuration']:.3f} s)"
            for t in self.api("targets")["activeTargets"]
        ]

    def alerts(self, name: str) -> list[dict[str, Any]]:
        """The pending and firing alerts named ``name`` (labels, state, activeAt, value)."""
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == name]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(30)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# -- small things -------------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port nobody listens on now (the agent or Prometheus binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        with contextlib.closing(e):
            return e.code, e.read().decode(errors="replace")


def wait_for(
    probe: Callable[[], T | None],
    timeout: float,
    what: str,
    *,
    alive: Callable[[], None] | None = None,
    explain: Callable[[], str] | None = None,
    every: float = 0.2,
) -> T:
    """``probe()`` once it is not None, polled until ``timeout`` seconds; fail naming ``what``
    and, after it, what ``explain()`` says about the state of things then.

    ``alive`` raises when what is waited on has died, so a crash fails at once with its output
    rather than at the deadline.
    """
    deadline = time.monotonic() + timeout
    while True:
        if alive is not None:
            alive()
        found = probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            why = f"\n{explain()}" if explain is not None else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{why}")
        time.sleep(every)
