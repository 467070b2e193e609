"""`make vllm-compat`: vLLM 0.33's own kv_offload tests, run against vLLM and against kvoffload.

    python compat/vllm_compat.py [--work build/vllm-compat] [--only FILE]... [--jobs N] [--json PATH]

1. Finds ``vllm-0.33.0.tar.gz`` through pip's own index configuration (``index-url``,
   ``extra-index-url``, ``find-links`` from pip's config files and ``PIP_*`` variables), over
   the simple API (PEP 691 JSON, or PEP 503 HTML), checks its sha256 and unpacks it under the work
   folder. ``pip download`` is not used: for an sdist it runs vLLM's setup.py to learn the version,
   which needs a build toolchain and, with ``VLLM_TARGET_DEVICE=empty``, reports ``0.33.0+empty``.
2. Builds a venv of its own there (torch's CPU build, then ``compat/requirements.txt``).
3. Runs each CPU-runnable test file twice, each run in a private tmpfs mounted over ``/dev/shm``
   in a mount namespace of its own (the host's ``/dev/shm`` is never touched): once on vLLM's
   source (the baseline) and once with ``compat/adapter`` first on PYTHONPATH, which loads
   kvoffload under vLLM's module names in the test process and in every child it spawns.
4. Prints one table: per file, the tests, how many pass on vLLM and on kvoffload, and how many
   of kvoffload's failures are the deliberate differences listed in ``compat/differences.toml``
   (each one is explained in docs/vllm-compat.md).

Exit status: 0 when every test that passes on vLLM passes on kvoffload or is a listed
difference; 1 when one does not (it is named, with its first error line), or a listed
difference passes now (the list is stale); 2 when the setup failed (download, venv, unshare).
Nothing from the sdist is copied into the repository.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import html.parser
import json
import os
import shutil
import ssl
import subprocess
import sys
import tarfile
import time
import tomllib
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMPAT = REPO / "compat"
PROJECT = "vllm"
VERSION = "0.33.0"
SDIST = f"{PROJECT}-{VERSION}.tar.gz"
TORCH = os.environ.get("TORCH", "torch==2.13.0")
TESTS = "tests/v1/kv_offload"

#: The kv_offload test files that run on a CPU machine, in the order of the table. The others
#: need CUDA or Triton (gpu_worker, canonical layout, swap kernels), NIXL (obj, p2p) or an
#: external library (kvcr).
FILES = (
    "cpu/test_shared_offload_region.py",
    "cpu/test_manager.py",
    "cpu/policies/test_factory.py",
    "cpu/test_capacity.py",
    "test_factory.py",
    "tiering/test_tiering_offloading.py",
    "tiering/test_tier_poll_thread.py",
    "tiering/test_factory.py",
    "tiering/test_fs_tier.py",
    "tiering/test_async_lookup.py",
    "tiering/test_backpressure.py",
    "tiering/test_metrics.py",
    "test_file_mapper.py",
)
TARGETS = ("vllm", "kvoffload")
TEST_TIMEOUT_S = 300
TMPFS_SIZE = "8g"


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
    if not (top / TESTS).is_dir():
        raise SetupError(f"{archive}: no {TESTS} in the sdist; it is not vLLM {VERSION}'s")
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


# ----------------------------------------------------------------- running one file


@dataclasses.dataclass(frozen=True)
class Outcome:
    test: str  # "cpu/test_manager.py::test_name[param]"
    outcome: str  # passed, failed, error, skipped
    message: str = ""


def private_shm_argv() -> list[str]:
    """Run the rest of argv with a fresh tmpfs over /dev/shm that only it and its children see."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SetupError("unshare is not installed; install util-linux")
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    mount = f'mount -t tmpfs -o size={TMPFS_SIZE},mode=1777 vllm-compat /dev/shm && exec "$@"'
    return [unshare, *user, "--mount", "--propagation", "private", "sh", "-c", mount, "sh"]


def run_file(
    python: Path, sdist: Path, target: str, test_file: str, out: Path, tests: Sequence[str] = ()
) -> list[Outcome]:
    """One pytest process for one file (or only ``tests`` of it); outcomes from its JUnit report."""
    stem = f"{target}-{test_file.replace('/', '_')}" + ("-rerun" if tests else "")
    junit = out / f"{stem}.xml"
    log = junit.with_suffix(".log")
    junit.unlink(missing_ok=True)
    paths = [str(sdist)] if target == "vllm" else [str(COMPAT / "adapter"), str(REPO), str(sdist)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    for name in [n for n in env if n.startswith(("COV_CORE", "COVERAGE_"))]:
        del env[name]
    argv = [
        *private_shm_argv(),
        str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
        f"--timeout={TEST_TIMEOUT_S}", f"--confcutdir={TESTS}", f"--junitxml={junit}",
        "-o", "junit_family=xunit2",
        *([f"{TESTS}/{t}" for t in tests] or [f"{TESTS}/{test_file}"]),
    ]  # fmt: skip
    with log.open("wb") as sink:
        subprocess.run(argv, check=False, cwd=sdist, env=env, stdout=sink, stderr=subprocess.STDOUT)
    if not junit.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return [Outcome(f"{test_file}::<run>", "error", tail[0])]
    return parse_junit(junit.read_bytes(), test_file)


def parse_junit(body: bytes, test_file: str) -> list[Outcome]:
    """Per-test outcomes; a file that failed to import is one ``error`` named ``<collection>``."""
    module = TESTS.replace("/", ".") + "." + test_file.removesuffix(".py").replace("/", ".")
    outcomes = []
    for case in ET.fromstring(body).iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        if classname == module:
            test = f"{test_file}::{name}"
        elif classname.startswith(module + "."):
            test = f"{test_file}::{classname[len(module) + 1 :].replace('.', '::')}::{name}"
        else:  # pytest's record of a module that failed to import
            test = f"{test_file}::<collection>"
        result, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                result = {"failure": "failed"}.get(child.tag, child.tag)
                first = (child.get("message") or child.text or "").strip().splitlines()
                message = first[0] if first else ""
                break
        outcomes.append(Outcome(test, result, message[:300]))
    return outcomes


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
    file: str
    tests: int
    passed_vllm: int
    passed_kvoffload: int
    deliberate: int
    unexpected: tuple[Outcome, ...]
    stale: tuple[str, ...]


def compare(
    test_file: str, vllm: Iterable[Outcome], kvo: Iterable[Outcome], differences: Sequence[Difference]
) -> FileRow:
    base = {o.test: o for o in vllm}
    ours = {o.test: o for o in kvo}
    unexpected, deliberate, stale = [], 0, []
    for test, theirs in base.items():
        if theirs.outcome != "passed":
            continue
        mine = ours.get(test) or ours.get(f"{test_file}::<collection>") or ours.get(f"{test_file}::<run>")
        listed = any(d.covers(test) for d in differences)
        if mine is not None and mine.test == test and mine.outcome == "passed":
            if listed:
                stale.append(test)
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
        tests=sum(1 for o in base.values() if o.outcome != "skipped"),
        passed_vllm=sum(1 for o in base.values() if o.outcome == "passed"),
        passed_kvoffload=sum(1 for t, o in ours.items() if o.outcome == "passed" and t in base),
        deliberate=deliberate,
        unexpected=tuple(unexpected),
        stale=tuple(stale),
    )


def render_table(rows: Sequence[FileRow]) -> str:
    head = (
        "vLLM test file (CPU-runnable)",
        "tests",
        "pass on vLLM",
        "pass on kvoffload",
        "deliberate",
        "unexpected",
    )
    body = [
        (
            r.file,
            str(r.tests),
            str(r.passed_vllm),
            str(r.passed_kvoffload),
            str(r.deliberate),
            str(len(r.unexpected)),
        )
        for r in rows
    ]
    total = ("total", *(str(sum(int(b[i]) for b in body)) for i in range(1, 6)))
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * 5) + "|"]
    lines += ["| " + " | ".join((f"`{b[0]}`", *b[1:])) + " |" for b in body]
    lines.append("| " + " | ".join(f"**{c}**" for c in total) + " |")
    return "\n".join(lines)


def shm_listing() -> frozenset[str]:
    try:
        return frozenset(os.listdir("/dev/shm"))
    except OSError:
        return frozenset()


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
        "--only", action="append", choices=FILES, metavar="FILE", help="run only this test file (repeatable)"
    )
    parser.add_argument(
        "--target",
        choices=("both", *TARGETS),
        default="both",
        help="run against vLLM, kvoffload or both (default)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="pytest processes at once (default: 2)")
    parser.add_argument("--json", type=Path, help="also write the results here (default: WORK/results.json)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    work: Path = args.work.resolve()
    files = tuple(args.only or FILES)
    targets = TARGETS if args.target == "both" else (args.target,)
    before = shm_listing()
    started = time.monotonic()
    try:
        differences = load_differences(COMPAT / "differences.toml")
        config = pip_index_config()
        candidate = find_sdist(config)
        print(f"vllm-compat: {SDIST} from {candidate.url}", file=sys.stderr)
        sdist = unpack(download(candidate, work / SDIST, config.cert), work)
        python = ensure_venv(work / "venv", COMPAT / "requirements.txt")
    except SetupError as exc:
        print(f"vllm-compat: {exc}", file=sys.stderr)
        return 2
    out = work / "runs"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, str], list[Outcome]] = {}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_file, python, sdist, t, f, out): (t, f) for f in files for t in targets}
        for future in concurrent.futures.as_completed(futures):
            target, test_file = futures[future]
            try:
                results[target, test_file] = future.result()
            except SetupError as exc:
                print(f"vllm-compat: {exc}", file=sys.stderr)
                return 2
            print(f"vllm-compat: ran {test_file} on {target}", file=sys.stderr)
    # Spawned creators and joiners wait on queues with timeouts that a loaded 2-core machine can
    # miss (vLLM's own region tests fail so with --jobs 2 beside other work). Each failure is run
    # once more, alone, and its second outcome counts; the report says which were rerun.
    rerun: dict[tuple[str, str], tuple[str, ...]] = {}
    for key, outcomes in sorted(results.items()):
        failed = tuple(
            o.test
            for o in outcomes
            if o.outcome in ("failed", "error")
            and "::<" not in o.test
            and not (key[0] == "kvoffload" and any(d.covers(o.test) for d in differences))
        )
        if failed:
            again = {o.test: o for o in run_file(python, sdist, *key, out, failed)}
            results[key] = [again.get(o.test, o) for o in outcomes]
            rerun[key] = failed
            print(
                f"vllm-compat: reran {len(failed)} failed test(s) of {key[1]} on {key[0]} alone",
                file=sys.stderr,
            )
    if args.target != "both":
        for (target, test_file), outcomes in sorted(results.items()):
            counts = {
                k: sum(1 for o in outcomes if o.outcome == k)
                for k in ("passed", "failed", "error", "skipped")
            }
            print(f"{test_file} on {target}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
        return 0
    rows = [compare(f, results["vllm", f], results["kvoffload", f], differences) for f in files]
    table = render_table(rows)
    print(table)
    for row in rows:
        for o in row.unexpected:
            print(f"unexpected: {o.test}: {o.outcome}: {o.message}")
        for test in row.stale:
            print(f"stale: {test} passes on kvoffload; take it out of compat/differences.toml")
    after = shm_listing()
    if after != before:
        print(f"vllm-compat: /dev/shm changed during the run: {sorted(after ^ before)}", file=sys.stderr)
    document = {
        "vllm": VERSION,
        "sdist": candidate.url,
        "duration_s": time.monotonic() - started,
        "files": [
            {**dataclasses.asdict(r), "unexpected": [dataclasses.asdict(o) for o in r.unexpected]}
            for r in rows
        ],
        "rerun": {f"{t}:{f}": list(v) for (t, f), v in sorted(rerun.items())},
        "outcomes": {f"{t}:{f}": [dataclasses.asdict(o) for o in v] for (t, f), v in sorted(results.items())},
    }
    (args.json or work / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    (work / "results.md").write_text(table + "\n")
    return 1 if any(r.unexpected or r.stale for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
