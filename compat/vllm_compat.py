"""`make vllm-compat`: vLLM 0.33's own offloading tests, run against vLLM and against kvoffload.

    python compat/vllm_compat.py [--work build/vllm-compat] [--only FILE]... [--jobs N]
                                 [--file-timeout S] [--json PATH]

1. Finds ``vllm-0.33.0.tar.gz`` through pip's own index configuration (``index-url``,
   ``extra-index-url``, ``find-links`` from pip's config files and ``PIP_*`` variables), over
   the simple API (PEP 691 JSON, or PEP 503 HTML), checks its sha256 and unpacks it under the work
   folder. ``pip download`` is not used: for an sdist it runs vLLM's setup.py to learn the version,
   which needs a build toolchain and, with ``VLLM_TARGET_DEVICE=empty``, reports ``0.33.0+empty``.
2. Checks every pin of ``compat/requirements.txt`` against the ranges vLLM declares in the sdist's
   ``requirements/`` and builds a venv of its own (torch's CPU build, then those pins).
3. Collects every test file under ``SCOPES`` (all of ``tests/v1/kv_offload`` and the offloading
   connector's unit tests) and runs each twice, each run one pytest process in a process group of
   its own, with a time limit, in a private tmpfs mounted over ``/dev/shm`` in a mount namespace
   of its own (the host's ``/dev/shm`` is never touched): once on vLLM's source (the baseline)
   and once with ``compat/adapter`` first on PYTHONPATH, which loads kvoffload under vLLM's module
   names in the test process and in every child it spawns. The group is killed when the run ends
   or runs out of time, so no child of a test outlives it. Every failure is run once more, alone.
4. Prints one table over the whole scope, per file: the tests; those that skip or fail on vLLM
   here (the reasons, from each file's own collection and skips, follow the table); how many pass
   on vLLM; how many pass on kvoffload with kvoffload code running (a probe records it per test);
   those that pass on kvoffload but ran no kvoffload code ("vLLM-only"); those that passed only
   when rerun ("flaky", never a plain pass); and kvoffload's failures, split into the deliberate
   differences listed in ``compat/differences.toml`` (each explained in docs/vllm-compat.md) and
   the unexpected ones.

Exit status: 0 when every test that passes on vLLM passes on kvoffload or is a listed
difference; 1 when one does not (it is named, with its first error line), or a listed
difference passes now (the list is stale); 2 when the setup failed (download, a pin outside
vLLM's ranges, venv, unshare); 130 on SIGINT, 143 on SIGTERM (every run's group is killed first).
Nothing from the sdist is copied into the repository.
"""

from __future__ import annotations

import argparse
import ast
import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import fnmatch
import hashlib
import html.parser
import json
import os
import re
import select
import shutil
import signal
import ssl
import subprocess
import sys
import tarfile
import threading
import time
import tomllib
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMPAT = REPO / "compat"
PROJECT = "vllm"
VERSION = "0.33.0"
SDIST = f"{PROJECT}-{VERSION}.tar.gz"
TORCH = os.environ.get("TORCH", "torch==2.13.0")
#: Test files are named relative to this folder of the sdist, in the table and in differences.toml.
TESTS = "tests/v1"


#: The tests the harness runs, in the sdist: a folder (every test file under it) or one file. They
#: run from the sdist's top, as vLLM's CI runs them, so vLLM's ``tests/conftest.py`` (its
#: fixtures such as ``caplog_vllm`` and ``default_vllm_config``) is loaded as there.
SCOPES = (
    "tests/v1/kv_offload",
    "tests/v1/kv_connector/unit/offloading_connector",
    "tests/v1/kv_connector/unit/test_offloading_connector.py",
)
#: pytest's default ``python_files`` (vLLM's pytest configuration keeps it).
TEST_FILE_PATTERNS = ("test_*.py", "*_test.py")
TARGETS = ("vllm", "kvoffload")
TEST_TIMEOUT_S = 300
FILE_TIMEOUT_S = 1200
#: After the time limit pytest gets SIGINT and this long to write its report, then SIGKILL.
REPORT_GRACE_S = 30
#: How long a run may take to exit once its report is written. Past that it is held by children
#: that wait on each other (multiprocessing joins them at exit): the group is killed.
EXIT_GRACE_S = 60
TMPFS_SIZE = "8g"
PROBE = "kvoffload_probe"


class SetupError(Exception):
    """The harness could not get as far as running a test (exit 2)."""


# ----------------------------------------------------------------- finding the sdist


@dataclasses.dataclass(frozen=True)
class IndexConfig:
    index_urls: tuple[str, ...]
    find_links: tuple[str, ...]
    cert: str | None


def pip_index_config(args: Sequence[str] = ()) -> IndexConfig:
    """The indexes pip itself would ask, from its config files, ``PIP_*`` variables and ``args``."""
    try:
        from pip._internal.commands import create_command
    except ImportError as exc:
        raise SetupError(f"pip is not importable ({exc}); run this with the project's venv python") from exc
    options, _ = create_command("download").parse_args(list(args))
    urls = () if options.no_index else (options.index_url, *options.extra_index_urls)
    return IndexConfig(tuple(urls), tuple(options.find_links), options.cert)


@dataclasses.dataclass(frozen=True)
class Candidate:
    url: str
    sha256: str | None


class _Anchors(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def parse_project_page(body: bytes, content_type: str, base_url: str, filename: str) -> Candidate | None:
    """The link to ``filename`` on one simple-API project page (PEP 691 JSON or PEP 503 HTML)."""
    if "json" in content_type:
        for entry in json.loads(body).get("files", ()):
            if entry.get("filename") == filename:
                return Candidate(
                    urllib.parse.urljoin(base_url, entry["url"]), entry.get("hashes", {}).get("sha256")
                )
        return None
    anchors = _Anchors()
    anchors.feed(body.decode("utf-8", "replace"))
    for href in anchors.hrefs:
        url, _, fragment = urllib.parse.urljoin(base_url, href).partition("#")
        if urllib.parse.unquote(url.rsplit("/", 1)[-1]) == filename:
            algo, _, digest = fragment.partition("=")
            return Candidate(url, digest if algo == "sha256" and digest else None)
    return None


def _ssl_context(cert: str | None) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cert) if cert else ssl.create_default_context()


def _fetch(url: str, cert: str | None, accept: str | None = None) -> tuple[bytes, str, str]:
    if url.startswith("file:"):
        path = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
        if path.is_dir():
            path = path / "index.html"
        return path.read_bytes(), "text/html", path.as_uri()
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=120, context=_ssl_context(cert)) as response:
        return response.read(), response.headers.get("Content-Type", ""), response.geturl()


_ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"


def find_sdist(config: IndexConfig, filename: str = SDIST, project: str = PROJECT) -> Candidate:
    """Ask each index and find-links location in pip's order; the first that lists the file wins."""
    tried: list[str] = []
    for location in config.find_links:
        local = (
            Path(urllib.request.url2pathname(urllib.parse.urlparse(location).path))
            if "://" in location
            else Path(location)
        )
        if (local / filename).is_file():
            return Candidate((local / filename).as_uri(), None)
        tried.append(location)
    for index in config.index_urls:
        page = index.rstrip("/") + f"/{project}/"
        try:
            body, content_type, final_url = _fetch(page, config.cert, _ACCEPT)
        except (OSError, ValueError) as exc:
            tried.append(f"{page} ({exc})")
            continue
        found = parse_project_page(body, content_type, final_url, filename)
        if found is not None:
            return found
        tried.append(f"{page} (no {filename})")
    raise SetupError(
        f"{filename} is on none of pip's indexes: {'; '.join(tried) or 'none configured'}; "
        "set PIP_INDEX_URL (or index-url in pip.conf) to an index that has it"
    )


def download(candidate: Candidate, dest: Path, cert: str | None) -> Path:
    """``dest``, downloaded once and checked against the index's sha256 when it gives one."""
    if dest.is_file() and (candidate.sha256 is None or _sha256(dest) == candidate.sha256):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".part")
    body, _, _ = _fetch(candidate.url, cert)
    partial.write_bytes(body)
    if candidate.sha256 is not None and (got := _sha256(partial)) != candidate.sha256:
        partial.unlink()
        raise SetupError(
            f"{candidate.url}: sha256 {got} is not the index's {candidate.sha256}; download it again"
        )
    partial.replace(dest)
    return dest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def unpack(archive: Path, into: Path) -> Path:
    """The sdist's top folder under ``into``, unpacked once (a marker says it finished)."""
    top = into / archive.name.removesuffix(".tar.gz")
    marker = top / ".unpacked"
    if marker.is_file():
        return top
    shutil.rmtree(top, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    missing = [scope for scope in SCOPES if not (top / scope).exists()]
    if missing:
        raise SetupError(f"{archive}: no {', '.join(missing)} in the sdist; it is not vLLM {VERSION}'s")
    marker.touch()
    return top


# ----------------------------------------------------------------- the venv


def ensure_venv(venv: Path, requirements: Path) -> Path:
    """A venv with torch's CPU build and the tests' imports; rebuilt when the requirements change."""
    python = venv / "bin" / "python"
    stamp = venv / ".requirements.sha256"
    want = hashlib.sha256(f"{TORCH}\n".encode() + requirements.read_bytes()).hexdigest()
    if python.exists() and stamp.is_file() and stamp.read_text().strip() == want:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    steps = (
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "-q", TORCH],
        [str(python), "-m", "pip", "install", "-q", "-r", str(requirements)],
    )
    for step in steps:
        if subprocess.run(step, check=False).returncode != 0:
            raise SetupError(f"`{' '.join(step)}` failed; see pip's message above")
    stamp.write_text(want + "\n")
    return python


# ----------------------------------------------------------------- pins within vLLM's ranges


@dataclasses.dataclass(frozen=True)
class Declared:
    specifier: str  # "" for any version
    source: str  # the requirements file, relative to the sdist


def read_requirements(path: Path, root: Path) -> dict[str, list[Declared]]:
    """What one of vLLM's requirements files (and the files it ``-r`` includes) declares here.

    Entries whose environment marker is false on this interpreter are left out (vLLM's
    ``torch==2.14.0`` for macOS, say). Options and URLs are kept only for their name.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    out: dict[str, list[Declared]] = {}
    for raw in path.read_text().splitlines():
        line = re.sub(r"(^|\s)#.*", "", raw).strip()
        if line.startswith(("-r ", "--requirement ")):
            for name, entries in read_requirements(path.parent / line.split()[-1], root).items():
                out.setdefault(name, []).extend(entries)
            continue
        if not line or line.startswith("-"):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        source = path.relative_to(root).as_posix()
        out.setdefault(canonicalize_name(req.name), []).append(Declared(str(req.specifier), source))
    return out


#: Where vLLM declares its runtime ranges for a CPU machine, then the pins its CPU test
#: environment was compiled with (for the test-only packages: pytest, pytest-timeout, ...).
RUNTIME_REQUIREMENTS = "requirements/cpu.txt"
TEST_REQUIREMENTS = "requirements/test/cpu.txt"


def pins_outside_vllms_ranges(pins: Iterable[str], sdist: Path) -> list[str]:
    """One line for each ``name==version`` that vLLM's requirements do not allow, or do not name.

    A name vLLM declares for its runtime must fall in that range; any other name must be one of
    the pins vLLM's CPU tests were compiled with, at a version that range allows.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    runtime = read_requirements(sdist / RUNTIME_REQUIREMENTS, sdist)
    tests = read_requirements(sdist / TEST_REQUIREMENTS, sdist)
    problems = []
    for pin in pins:
        try:
            req = Requirement(pin)
        except InvalidRequirement as exc:
            problems.append(f"{pin}: not a requirement ({exc})")
            continue
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            problems.append(f"{pin}: pin one version with ==")
            continue
        version = Version(specs[0].version)
        name = canonicalize_name(req.name)
        declared = runtime.get(name) or tests.get(name)
        if not declared:
            problems.append(f"{pin}: {req.name} is not among vLLM {VERSION}'s requirements")
            continue
        for entry in declared:
            if not SpecifierSet(entry.specifier).contains(version, prereleases=True):
                problems.append(f"{pin}: outside vLLM's {req.name}{entry.specifier} ({entry.source})")
    return problems


def requirement_lines(path: Path) -> list[str]:
    return [line for raw in path.read_text().splitlines() if (line := raw.split("#")[0].strip())]


# ----------------------------------------------------------------- models the tests name


#: Hugging Face configs the tests build a ``ModelConfig`` from (``facebook/opt-125m`` for the
#: connector's scheduler tests), copied from the hub: ``HF_CONFIGS/<org>/<name>/config.json``.
#: Nothing reaches the hub here, so the harness lays them out as a hub cache that both sides
#: read offline. No weights: no test that loads a model runs here.
HF_CONFIGS = COMPAT / "hf"


def hf_hub_cache(into: Path, configs: Path = HF_CONFIGS) -> Path:
    """A Hugging Face hub cache (``HF_HUB_CACHE``) holding each shipped config, one snapshot each."""
    for config in sorted(configs.glob("*/*/config.json")):
        org, name = config.parent.parent.name, config.parent.name
        body = config.read_bytes()
        revision = hashlib.sha1(body).hexdigest()  # a snapshot is named by a 40-hex commit
        repo = into / f"models--{org}--{name}"
        (repo / "snapshots" / revision).mkdir(parents=True, exist_ok=True)
        (repo / "snapshots" / revision / "config.json").write_bytes(body)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    return into


# ----------------------------------------------------------------- the test files


def discover(sdist: Path, scopes: Sequence[str] = SCOPES) -> list[str]:
    """Every test file of ``scopes``, named relative to ``TESTS``, in path order per scope."""
    files: list[str] = []
    for scope in scopes:
        where = sdist / scope
        if where.is_file():
            found = [where]
        elif where.is_dir():
            found = sorted(
                p
                for p in where.rglob("*.py")
                if any(fnmatch.fnmatch(p.name, pattern) for pattern in TEST_FILE_PATTERNS)
            )
        else:
            raise SetupError(f"{scope} is not in {sdist}; it is not vLLM {VERSION}'s sdist")
        files += [p.relative_to(sdist / TESTS).as_posix() for p in found]
    return files


def scope_of(test_file: str, scopes: Sequence[str] = SCOPES) -> str:
    """The scope ``test_file`` (named relative to ``TESTS``) belongs to; ``SetupError`` if none."""
    path = f"{TESTS}/{test_file}"
    for scope in scopes:
        if path == scope or path.startswith(scope + "/"):
            return scope
    raise SetupError(f"{test_file} is in none of the harness's scopes ({', '.join(scopes)})")


# ----------------------------------------------------------------- process groups


class Interrupted(Exception):
    """The harness was interrupted: no new run starts."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a CI's time limit, ``timeout``): unwound as an interrupt, so groups are killed."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


class ProcessGroups:
    """The process group of every run in flight, so that an interrupted harness kills them all.

    A run is started as the leader of a new session (so of a new process group); its children
    stay in that group unless they make their own session, which no test here does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[int] = set()
        self._closed = False

    def add(self, pgid: int) -> None:
        with self._lock:
            if self._closed:
                _kill_group(pgid)
                raise Interrupted
            self._live.add(pgid)

    def discard(self, pgid: int) -> None:
        with self._lock:
            self._live.discard(pgid)

    def kill_all(self) -> None:
        with self._lock:
            self._closed = True
            for pgid in self._live:
                _kill_group(pgid)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def group_members(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """The processes in group ``pgid`` other than its leader, from ``/proc/<pid>/stat``."""
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == pgid:
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it exited meanwhile
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        if int(stat[stat.rindex(")") + 2 :].split()[2]) == pgid:
            members.append(int(entry.name))
    return members


def _exited_within(pid: int, timeout_s: float) -> bool:
    """Whether child ``pid`` exits within ``timeout_s``; it is left unreaped (a zombie).

    Unreaped, the leader keeps its pid, and so its process group id, from being reused: the
    group can be killed afterwards without hitting anyone else's.
    """
    try:
        fd = os.pidfd_open(pid)
    except OSError as exc:  # a kernel before 5.3: poll
        if exc.errno != errno.ENOSYS:
            raise
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if status is not None:
                return True
            time.sleep(0.1)
        return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout_s * 1000))))
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class GroupRun:
    returncode: int
    timed_out: bool
    leftovers: int  # processes still in the group when its leader ended (killed with it)
    duration_s: float
    hung_at_exit: bool = False  # its report was written, but it did not exit: killed


def run_in_group(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    log: Path,
    timeout_s: float,
    groups: ProcessGroups | None = None,
    grace_s: float = REPORT_GRACE_S,
    report: Path | None = None,
    exit_grace_s: float = EXIT_GRACE_S,
) -> GroupRun:
    """Run ``argv`` as the leader of a new process group; kill the whole group when it is done.

    At ``timeout_s`` the leader gets SIGINT (pytest then stops and writes its report with the
    tests it finished) and ``grace_s`` more. A leader that has written ``report`` and still runs
    ``exit_grace_s`` later is done too. Then, or as soon as the leader exits, every process left
    in the group is killed: a test's child that waits forever cannot hold the harness.
    """
    groups = groups or ProcessGroups()
    started = time.monotonic()
    deadline = started + timeout_s
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=dict(env), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    timed_out = hung = False
    try:
        groups.add(proc.pid)
        reported: float | None = None
        while not _exited_within(proc.pid, max(0.0, min(1.0, deadline - time.monotonic()))):
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGINT)
                _exited_within(proc.pid, grace_s)
                break
            if report is not None and reported is None and report.exists():
                reported = now
            if reported is not None and now - reported >= exit_grace_s:
                hung = True
                break
        leftovers = len(group_members(proc.pid))
    finally:
        _kill_group(proc.pid)
        returncode = proc.wait()
        groups.discard(proc.pid)
    return GroupRun(returncode, timed_out, leftovers, time.monotonic() - started, hung)


# ----------------------------------------------------------------- running one file


@dataclasses.dataclass(frozen=True)
class Outcome:
    test: str  # "kv_offload/cpu/test_manager.py::test_name[param]"
    outcome: str  # passed, failed, error, skipped; after a rerun also flaky
    message: str = ""


@dataclasses.dataclass(frozen=True)
class FileRun:
    """One pytest process over one file (or some of its tests) on one side."""

    outcomes: tuple[Outcome, ...]
    kvoffload_ran: frozenset[str] = frozenset()  # tests during which kvoffload code ran
    timed_out: bool = False
    leftovers: int = 0
    duration_s: float = 0.0
    hung_at_exit: bool = False


def private_shm_argv() -> list[str]:
    """Run the rest of argv with a fresh tmpfs over /dev/shm that only it and its children see."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SetupError("unshare is not installed; install util-linux")
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    mount = f'mount -t tmpfs -o size={TMPFS_SIZE},mode=1777 vllm-compat /dev/shm && exec "$@"'
    return [unshare, *user, "--mount", "--propagation", "private", "sh", "-c", mount, "sh"]


def run_file(
    python: Path,
    sdist: Path,
    target: str,
    test_file: str,
    out: Path,
    tests: Sequence[str] = (),
    *,
    timeout_s: float = FILE_TIMEOUT_S,
    groups: ProcessGroups | None = None,
    hf_cache: Path | None = None,
) -> FileRun:
    """One pytest process for one file (or only ``tests`` of it); outcomes from its JUnit report."""
    stem = f"{target}-{test_file.replace('/', '_')}" + ("-rerun" if tests else "")
    junit = out / f"{stem}.xml"
    probe = out / f"{stem}.probe"
    log = junit.with_suffix(".log")
    junit.unlink(missing_ok=True)
    probe.unlink(missing_ok=True)
    paths = [str(sdist)] if target == "vllm" else [str(COMPAT / "adapter"), str(REPO), str(sdist)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    for name in [n for n in env if n.startswith(("COV_CORE", "COVERAGE_", "KVOFFLOAD_PROBE_"))]:
        del env[name]
    if hf_cache is not None:
        env["HF_HUB_CACHE"] = str(hf_cache)
    plugin: list[str] = []
    if target == "kvoffload":
        env |= {"KVOFFLOAD_PROBE_OUT": str(probe), "KVOFFLOAD_PROBE_ROOT": str(REPO / "kvoffload") + os.sep}
        plugin = ["-p", PROBE]
    argv = [
        *private_shm_argv(),
        str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin,
        f"--timeout={TEST_TIMEOUT_S}",
        f"--junitxml={junit}", "-o", "junit_family=xunit2",
        *([f"{TESTS}/{t}" for t in tests] or [f"{TESTS}/{test_file}"]),
    ]  # fmt: skip
    run = run_in_group(argv, cwd=sdist, env=env, log=log, timeout_s=timeout_s, groups=groups, report=junit)
    outcomes = parse_junit(junit.read_bytes(), test_file) if junit.is_file() else []
    if run.timed_out:
        outcomes.append(Outcome(f"{test_file}::<run>", "error", f"timed out after {timeout_s:.0f} s; killed"))
    elif not junit.is_file():  # pytest stopped before collecting: a conftest.py failed to import
        text = log.read_text(errors="replace")
        tail = text.strip().splitlines()[-1:] or ["no output"]
        outcomes.append(Outcome(f"{test_file}::<run>", "error", (raised(text) or tail[0])[:300]))
    ran = probe.read_text().splitlines() if probe.is_file() else []
    prefix = f"{TESTS}/"
    return FileRun(
        tuple(outcomes),
        frozenset(t.removeprefix(prefix) for t in ran),
        run.timed_out,
        run.leftovers,
        run.duration_s,
        run.hung_at_exit,
    )


def parse_junit(body: bytes, test_file: str) -> list[Outcome]:
    """Per-test outcomes; a file that failed to import is one ``error`` named ``<collection>``.

    A file skipped as a whole (``pytest.importorskip`` at module level) is one ``skipped``
    ``<collection>``. A collection error's message is the exception it ended with.
    """
    module = TESTS.replace("/", ".") + "." + test_file.removesuffix(".py").replace("/", ".")
    outcomes = []
    for case in ET.fromstring(body).iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        if not name:  # the test an interrupt (SIGINT at the time limit) stopped: not an outcome
            continue
        if classname == module:
            test = f"{test_file}::{name}"
        elif classname.startswith(module + "."):
            test = f"{test_file}::{classname[len(module) + 1 :].replace('.', '::')}::{name}"
        else:  # pytest's record of a module that failed to import, or was skipped whole
            test = f"{test_file}::<collection>"
        result, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                result = {"failure": "failed"}.get(child.tag, child.tag)
                if child.tag == "error":  # at collection, setup or teardown: the exception says why
                    message = raised(child.text or "") or (child.get("message") or "")
                elif test.endswith("::<collection>"):
                    message = skipped_whole(child.text or "") or (child.get("message") or "")
                else:
                    first = (child.get("message") or child.text or "").strip().splitlines()
                    message = first[0] if first else ""
                break
        outcomes.append(Outcome(test, result, message[:300]))
    return outcomes


def raised(report: str) -> str:
    """The exception a pytest traceback ends with: its last ``E   Name: what`` line."""
    lines = [line[1:].strip() for line in report.splitlines() if line.startswith("E ")]
    named = [line for line in lines if re.match(r"[\w.]+(Error|Exception|Exit|Interrupt)\b", line)]
    return (named or lines or [""])[-1]


def skipped_whole(report: str) -> str:
    """The reason of a module-level skip; pytest writes ``(path, line, 'Skipped: why')``."""
    try:
        where = ast.literal_eval(report.strip())
    except (ValueError, SyntaxError):
        return ""
    if isinstance(where, tuple) and where and isinstance(where[-1], str):
        return where[-1].removeprefix("Skipped: ")
    return ""


PSEUDO = ("::<collection>", "::<run>")


def settle(first: Sequence[Outcome], rerun: Sequence[Outcome]) -> list[Outcome]:
    """Each test's outcome after the rerun of its failures: ``flaky`` when it passed only then."""
    again = {o.test: o for o in rerun if not o.test.endswith(PSEUDO)}
    settled = []
    for o in first:
        second = again.get(o.test)
        if second is None:
            settled.append(o)
        elif second.outcome == "passed":
            settled.append(Outcome(o.test, "flaky", o.message))
        else:
            settled.append(second)
    return settled


# ----------------------------------------------------------------- deliberate differences


@dataclasses.dataclass(frozen=True)
class Difference:
    tests: tuple[str, ...]
    what: str
    why: str

    def covers(self, test: str) -> bool:
        # "file::name" covers every parameter of name, "file::name[p]" just that one.
        return any(test == t or test.startswith(t + "[") for t in self.tests)


def load_differences(path: Path) -> list[Difference]:
    data = tomllib.loads(path.read_text())
    out = []
    for i, entry in enumerate(data.get("difference", ())):
        try:
            out.append(Difference(tuple(entry["tests"]), entry["what"], entry["why"]))
        except (KeyError, TypeError) as exc:
            raise SetupError(f"{path}: difference #{i + 1} lacks {exc}; give tests, what and why") from exc
    return out


# ----------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class FileRow:
    """One file's line of the table; every test that passes on vLLM is counted once, in one of
    ``passed_kvoffload``, ``vllm_only``, ``flaky``, ``deliberate`` and ``unexpected``."""

    file: str
    tests: int  # collected on vLLM (0 when the file does not import, or skips whole)
    not_on_vllm: int  # skipped or failed on vLLM here
    passed_vllm: int  # passed on vLLM at the first try
    passed_kvoffload: int  # passed on kvoffload at the first try, kvoffload code running
    vllm_only: tuple[str, ...]  # passed on kvoffload, but no kvoffload code ran
    flaky: tuple[tuple[str, str], ...]  # (test, the side(s) that needed the rerun)
    deliberate: int
    unexpected: tuple[Outcome, ...]
    stale: tuple[str, ...]
    reasons: tuple[tuple[str, int], ...]  # why tests do not pass on vLLM here, most frequent first


def compare(
    test_file: str,
    vllm: Iterable[Outcome],
    kvo: Iterable[Outcome],
    differences: Sequence[Difference],
    kvoffload_ran: frozenset[str] | None = None,
) -> FileRow:
    """One file's row from both sides' settled outcomes (``settle``).

    ``kvoffload_ran``: the tests during which kvoffload code ran; ``None`` counts every
    kvoffload pass as kvoffload's (no probe).
    """
    base = {o.test: o for o in vllm}
    ours = {o.test: o for o in kvo}
    reasons: collections.Counter[str] = collections.Counter()
    unexpected, vllm_only, flaky, stale = [], [], [], []
    deliberate = passed_vllm = passed_kvo = not_on_vllm = 0
    for test, theirs in base.items():
        if test.endswith(PSEUDO):
            if theirs.outcome != "passed":
                reasons[_reason(theirs)] += 1
            continue
        if theirs.outcome not in ("passed", "flaky"):
            not_on_vllm += 1
            reasons[_reason(theirs)] += 1
            continue
        passed_vllm += theirs.outcome == "passed"
        mine = ours.get(test) or ours.get(f"{test_file}::<collection>") or ours.get(f"{test_file}::<run>")
        listed = any(d.covers(test) for d in differences)
        if mine is not None and mine.test == test and mine.outcome in ("passed", "flaky"):
            if listed:
                stale.append(test)
            sides = [side for side, o in (("vLLM", theirs), ("kvoffload", mine)) if o.outcome == "flaky"]
            if sides:
                flaky.append((test, " and ".join(sides)))
            elif kvoffload_ran is not None and test not in kvoffload_ran:
                vllm_only.append(test)
            else:
                passed_kvo += 1
        elif listed:
            deliberate += 1
        else:
            unexpected.append(
                mine
                if mine is not None and mine.test == test
                else Outcome(test, "missing", mine.message if mine else "not run")
            )
    return FileRow(
        file=test_file,
        tests=sum(1 for t in base if not t.endswith(PSEUDO)),
        not_on_vllm=not_on_vllm,
        passed_vllm=passed_vllm,
        passed_kvoffload=passed_kvo,
        vllm_only=tuple(vllm_only),
        flaky=tuple(flaky),
        deliberate=deliberate,
        unexpected=tuple(unexpected),
        stale=tuple(stale),
        reasons=tuple(reasons.most_common()),
    )


def _reason(o: Outcome) -> str:
    if o.test.endswith("::<collection>"):
        what = "skipped whole" if o.outcome == "skipped" else "does not import"
        return f"{what}: {o.message}"
    if o.test.endswith("::<run>"):
        return f"the run failed: {o.message}"
    return f"{o.outcome}: {o.message}" if o.message else o.outcome


COLUMNS = (
    "tests",
    "skip/fail on vLLM",
    "pass on vLLM",
    "pass on kvoffload",
    "vLLM-only",
    "flaky",
    "deliberate",
    "unexpected",
)


def _counts(r: FileRow) -> tuple[int, ...]:
    return (
        r.tests,
        r.not_on_vllm,
        r.passed_vllm,
        r.passed_kvoffload,
        len(r.vllm_only),
        len(r.flaky),
        r.deliberate,
        len(r.unexpected),
    )


def render_table(rows: Sequence[FileRow]) -> str:
    """The whole scope: a row per collected file (``TESTS``-relative), then the totals."""
    lines = [
        "| " + " | ".join(("vLLM test file", *COLUMNS)) + " |",
        "|" + "|".join(["---"] + ["---:"] * len(COLUMNS)) + "|",
    ]
    lines += ["| " + " | ".join((f"`{r.file}`", *map(str, _counts(r)))) + " |" for r in rows]
    totals = [sum(c) for c in zip(*(_counts(r) for r in rows), strict=True)] if rows else [0] * len(COLUMNS)
    lines.append("| " + " | ".join(f"**{c}**" for c in ("total", *totals)) + " |")
    return "\n".join(lines)


def _cell(text: str, limit: int = 160) -> str:
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("|", "\\|").replace("`", "'")


def render_reasons(rows: Sequence[FileRow], most: int = 3) -> str:
    """Why tests do not run (or do not pass) on vLLM here, per file, from its own run."""
    lines = ["| vLLM test file | tests | why, from the file's own run on vLLM |", "|---|---:|---|"]
    for r in rows:
        if not r.reasons:
            continue
        shown = [f"{n} × {_cell(reason)}" for reason, n in r.reasons[:most]]
        if len(r.reasons) > most:
            shown.append(f"{sum(n for _, n in r.reasons[most:])} × other reasons (results.json)")
        count = str(r.not_on_vllm) if r.tests else "—"
        lines.append(f"| `{r.file}` | {count} | {'; '.join(shown)} |")
    return "\n".join(lines)


def render_report(rows: Sequence[FileRow], notes: Sequence[str] = ()) -> str:
    """results.md: the table, the reasons, and every flaky and vLLM-only test by name."""
    parts = [render_table(rows), "", "Tests that skip or fail on vLLM here:", "", render_reasons(rows)]
    flaky = [f"* `{t}` (rerun needed on {sides})" for r in rows for t, sides in r.flaky]
    vllm_only = [f"* `{t}`" for r in rows for t in r.vllm_only]
    if flaky:
        parts += ["", "Flaky (failed, then passed when rerun alone):", "", *flaky]
    if vllm_only:
        parts += ["", "vLLM-only (pass on kvoffload, but no kvoffload code ran):", "", *vllm_only]
    if notes:
        parts += ["", *[f"* {n}" for n in notes]]
    return "\n".join(parts)


def shm_listing() -> frozenset[str]:
    try:
        return frozenset(os.listdir("/dev/shm"))
    except OSError:
        return frozenset()


# ----------------------------------------------------------------- main


def _run_all(
    jobs: int, runs: Sequence[tuple[str, str]], run: Callable[[str, str], FileRun], groups: ProcessGroups
) -> dict[tuple[str, str], FileRun]:
    results: dict[tuple[str, str], FileRun] = {}
    pool = concurrent.futures.ThreadPoolExecutor(jobs)
    try:
        futures = {pool.submit(run, target, test_file): (target, test_file) for target, test_file in runs}
        for future in concurrent.futures.as_completed(futures):
            target, test_file = futures[future]
            results[target, test_file] = done = future.result()
            notes = " (timed out)" if done.timed_out else ""
            print(
                f"vllm-compat: ran {test_file} on {target} in {done.duration_s:.0f} s{notes}", file=sys.stderr
            )
    except BaseException:
        # Interrupted (or a run could not start): no queued file starts, no group survives.
        groups.kill_all()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results


def _failures(outcomes: Iterable[Outcome], worth: Callable[[str], bool]) -> tuple[str, ...]:
    return tuple(
        o.test
        for o in outcomes
        if o.outcome in ("failed", "error") and not o.test.endswith(PSEUDO) and worth(o.test)
    )


def _worth_rerunning(
    target: str, vllm: Sequence[Outcome] | None, differences: Sequence[Difference]
) -> Callable[[str], bool]:
    """A kvoffload failure is worth a rerun only where vLLM passes and no difference lists it."""
    if target != "kvoffload" or vllm is None:
        return lambda test: True
    passing = {o.test for o in vllm if o.outcome in ("passed", "flaky")}
    return lambda test: test in passing and not any(d.covers(test) for d in differences)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=REPO / "build" / "vllm-compat",
        help="download, venv and reports (default: build/vllm-compat)",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="FILE",
        help=f"run only this test file, named relative to {TESTS} (repeatable)",
    )
    parser.add_argument(
        "--target",
        choices=("both", *TARGETS),
        default="both",
        help="run against vLLM, kvoffload or both (default)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="pytest processes at once (default: 2)")
    parser.add_argument(
        "--file-timeout",
        type=float,
        default=FILE_TIMEOUT_S,
        metavar="S",
        help=f"time limit of one file's run; then its process group is killed (default: {FILE_TIMEOUT_S})",
    )
    parser.add_argument("--json", type=Path, help="also write the results here (default: WORK/results.json)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.file_timeout <= 0:
        parser.error("--file-timeout must be positive")
    work: Path = args.work.resolve()
    targets = TARGETS if args.target == "both" else (args.target,)
    before = shm_listing()
    started = time.monotonic()
    notes: list[str] = []
    try:
        differences = load_differences(COMPAT / "differences.toml")
        config = pip_index_config()
        candidate = find_sdist(config)
        print(f"vllm-compat: {SDIST} from {candidate.url}", file=sys.stderr)
        sdist = unpack(download(candidate, work / SDIST, config.cert), work)
        problems = pins_outside_vllms_ranges(requirement_lines(COMPAT / "requirements.txt"), sdist)
        if problems:
            raise SetupError("compat/requirements.txt: " + "; ".join(problems) + "; pin within vLLM's ranges")
        notes += [
            f"{TORCH} (the CPU build this machine installs; set TORCH to change it) {p.split(': ', 1)[1]}"
            for p in pins_outside_vllms_ranges([TORCH], sdist)
        ]
        python = ensure_venv(work / "venv", COMPAT / "requirements.txt")
        files = discover(sdist)
        unknown = sorted(set(args.only or ()) - set(files))
        if unknown:
            raise SetupError(f"no such test file: {', '.join(unknown)}; name one of: {' '.join(files)}")
        if args.only:
            files = [f for f in files if f in args.only]
    except SetupError as exc:
        print(f"vllm-compat: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"vllm-compat: note: {note}", file=sys.stderr)
    out = work / "runs"
    out.mkdir(parents=True, exist_ok=True)
    hf_cache = hf_hub_cache(work / "hf-hub")
    groups = ProcessGroups()
    signal.signal(signal.SIGTERM, _terminate)

    def run(target: str, test_file: str, tests: Sequence[str] = ()) -> FileRun:
        return run_file(
            python,
            sdist,
            target,
            test_file,
            out,
            tests,
            timeout_s=args.file_timeout,
            groups=groups,
            hf_cache=hf_cache,
        )

    try:
        first = _run_all(args.jobs, [(t, f) for f in files for t in targets], run, groups)
        # Spawned creators and joiners wait on queues with timeouts that a loaded 2-core machine
        # can miss. Each failure is run once more, alone; one that passes then is "flaky" in the
        # table, never a plain pass. kvoffload's are rerun only where vLLM passes.
        rerun: dict[tuple[str, str], FileRun] = {}
        settled: dict[tuple[str, str], list[Outcome]] = {}
        for target in targets:
            for test_file in files:
                key = (target, test_file)
                worth = _worth_rerunning(target, settled.get(("vllm", test_file)), differences)
                failed = _failures(first[key].outcomes, worth)
                if failed:
                    rerun[key] = run(target, test_file, failed)
                    print(
                        f"vllm-compat: reran {len(failed)} failed test(s) of {test_file} on {target} alone",
                        file=sys.stderr,
                    )
                settled[key] = settle(first[key].outcomes, rerun[key].outcomes if key in rerun else ())
    except (KeyboardInterrupt, Interrupted) as exc:
        groups.kill_all()
        print("vllm-compat: interrupted; every run's process group was killed", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
    except SetupError as exc:
        print(f"vllm-compat: {exc}", file=sys.stderr)
        return 2
    runs = [(k, "", v) for k, v in first.items()] + [(k, " (rerun)", v) for k, v in rerun.items()]
    for (target, test_file), which, done in sorted(runs):
        if done.timed_out:
            notes.append(f"{test_file} on {target}{which} ran out of its {args.file_timeout:.0f} s; killed")
        if done.hung_at_exit:
            notes.append(
                f"{test_file} on {target}{which} wrote its report but had not exited {EXIT_GRACE_S} s"
                " later; killed with its group"
            )
        if done.leftovers:
            notes.append(
                f"{test_file} on {target}{which} left {done.leftovers} process(es); killed with its group"
            )
    if args.target != "both":
        for (target, test_file), outcomes in sorted(settled.items()):
            counts = collections.Counter(o.outcome for o in outcomes if not o.test.endswith(PSEUDO))
            summary = ", ".join(f"{counts[k]} {k}" for k in ("passed", "flaky", "failed", "error", "skipped"))
            print(f"{test_file} on {target}: {summary}")
        return 0
    rows = [
        compare(
            f,
            settled["vllm", f],
            settled["kvoffload", f],
            differences,
            first["kvoffload", f].kvoffload_ran
            | (rerun["kvoffload", f].kvoffload_ran if ("kvoffload", f) in rerun else frozenset()),
        )
        for f in files
    ]
    after = shm_listing()
    if after != before:
        notes.append(f"/dev/shm changed during the run: {sorted(after ^ before)}")
    report = render_report(rows, notes)
    print(report)
    for row in rows:
        for o in row.unexpected:
            print(f"unexpected: {o.test}: {o.outcome}: {o.message}")
        for test in row.stale:
            print(f"stale: {test} passes on kvoffload; take it out of compat/differences.toml")
    document = {
        "vllm": VERSION,
        "sdist": candidate.url,
        "duration_s": time.monotonic() - started,
        "scopes": list(SCOPES),
        "notes": notes,
        "files": [
            {**dataclasses.asdict(r), "unexpected": [dataclasses.asdict(o) for o in r.unexpected]}
            for r in rows
        ],
        "runs": {
            f"{t}:{f}{which}": {
                "duration_s": d.duration_s,
                "timed_out": d.timed_out,
                "hung_at_exit": d.hung_at_exit,
                "leftovers": d.leftovers,
            }
            for (t, f), which, d in sorted(runs)
        },
        "rerun": {f"{t}:{f}": [o.test for o in v.outcomes] for (t, f), v in sorted(rerun.items())},
        "outcomes": {f"{t}:{f}": [dataclasses.asdict(o) for o in v] for (t, f), v in sorted(settled.items())},
    }
    (args.json or work / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    (work / "results.md").write_text(report + "\n")
    return 1 if any(r.unexpected or r.stale for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
