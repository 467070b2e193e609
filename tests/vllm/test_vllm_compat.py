"""`make vllm-compat`'s parts that need no download: the adapter, the index lookup, the report.

The run itself (vLLM's tests against both) needs the network and is not part of `make test`.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tests.support.procs import REPO

# The harness is a package in compat/ (beside compat/vllm_engine/, which imports it so too).
sys.path.insert(0, str(REPO / "compat"))
from vllm_compat.comparison import FileRow, compare
from vllm_compat.differences import Difference, load_differences
from vllm_compat.environment import hf_hub_cache
from vllm_compat.errors import SetupError
from vllm_compat.isolation import GroupRun, Interrupted, ProcessGroups, private_shm_argv, run_in_group
from vllm_compat.junit import parse_junit
from vllm_compat.outcomes import Outcome, settle
from vllm_compat.pins import pins_outside_vllms_ranges, requirement_lines
from vllm_compat.runs import run_file
from vllm_compat.scope import SDIST, TESTS, discover, scope_of
from vllm_compat.sdist import (
    Candidate,
    IndexConfig,
    download,
    find_sdist,
    parse_project_page,
    pip_index_config,
)
from vllm_compat.tables import render_reasons, render_report, render_table

ADAPTER = REPO / "compat" / "adapter"


@pytest.fixture
def vllm_tree(tmp_path: Path) -> Path:
    """A stand-in for vLLM's source tree: the packages above kv_offload, and nothing of it."""
    for package in ("vllm", "vllm/v1"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    return tmp_path


def run_python(code: str, vllm_tree: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COV_CORE", "COVERAGE_"))} | {
        "PYTHONPATH": os.pathsep.join((str(ADAPTER), str(REPO), str(vllm_tree)))
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=vllm_tree,
        timeout=120,
        check=False,
    )


# ----------------------------------------------------------------- the adapter


def test_a_vllm_module_name_is_the_kvoffload_module_itself(vllm_tree: Path) -> None:
    done = run_python(
        """
        import vllm.v1.kv_offload.cpu.manager as theirs
        import kvoffload.cpu.manager as ours
        from vllm.v1.kv_offload.cpu import shared_offload_region
        import kvoffload.cpu.shared_offload_region as region
        import vllm.v1.kv_offload as top, kvoffload
        print(theirs is ours, shared_offload_region is region, top is kvoffload)
        """,
        vllm_tree,
    )
    assert (done.returncode, done.stdout.split(), done.stderr) == (0, ["True", "True", "True"], "")


def test_a_patch_through_the_vllm_name_patches_what_kvoffload_runs(vllm_tree: Path) -> None:
    done = run_python(
        """
        import vllm.v1.kv_offload.base as theirs
        from kvoffload import base
        theirs.make_offload_key = lambda h, g: b"patched"
        print(base.make_offload_key(b"x", 0))
        """,
        vllm_tree,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "b'patched'")


def test_a_module_kvoffload_lacks_fails_to_import_instead_of_loading_vllms(vllm_tree: Path) -> None:
    # vLLM's own copy sits on the path: the adapter must never fall back to it.
    own = vllm_tree / "vllm" / "v1" / "kv_offload"
    own.mkdir()
    (own / "__init__.py").write_text("")
    (own / "no_such_module.py").write_text("print('vllm code ran')\n")
    done = run_python("import vllm.v1.kv_offload.no_such_module", vllm_tree)
    assert done.returncode == 1
    assert "vllm code ran" not in done.stdout
    assert "ModuleNotFoundError: kvoffload has no kvoffload.no_such_module" in done.stderr


def test_names_outside_kv_offload_come_from_vllms_tree(vllm_tree: Path) -> None:
    (vllm_tree / "vllm" / "utils.py").write_text("WHERE = 'vllm source'\n")
    done = run_python("import vllm.utils; print(vllm.utils.WHERE)", vllm_tree)
    assert (done.returncode, done.stdout.strip()) == (0, "vllm source")


def test_a_spawned_child_loads_the_adapter_too(vllm_tree: Path) -> None:
    # vLLM's region tests start creator and joiner processes with spawn: each child is a fresh
    # interpreter, which sees vLLM's names only because sitecustomize installs the adapter.
    script = vllm_tree / "child.py"
    script.write_text(
        textwrap.dedent(
            """
            import multiprocessing as mp

            def name(q):
                import vllm.v1.kv_offload.base as b
                q.put(b.__name__)

            if __name__ == "__main__":
                ctx = mp.get_context("spawn")
                q = ctx.Queue()
                p = ctx.Process(target=name, args=(q,))
                p.start()
                print(q.get(timeout=60))
                p.join()
            """
        )
    )
    done = run_python(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')", vllm_tree)
    assert (done.returncode, done.stdout.strip()) == (0, "kvoffload.base")


# ----------------------------------------------------------------- finding the sdist


def simple_index(root: Path, files: dict[str, bytes]) -> str:
    """A PEP 503 index on disk (what `pip download` takes as a file:// index)."""
    project = root / "simple" / "vllm"
    project.mkdir(parents=True)
    links = []
    for name, body in files.items():
        (project / name).write_bytes(body)
        links.append(f'<a href="{name}#sha256={hashlib.sha256(body).hexdigest()}">{name}</a>')
    (project / "index.html").write_text("<html><body>" + "".join(links) + "</body></html>")
    return (root / "simple").as_uri()


def test_the_sdist_is_found_on_a_pep503_index_and_checked(tmp_path: Path) -> None:
    body = b"not really a tarball"
    index = simple_index(tmp_path, {"vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl": b"w", SDIST: body})
    config = IndexConfig(("file:///nonexistent/simple", index), (), None)
    found = find_sdist(config)
    assert found.url.endswith("/vllm/" + SDIST)
    assert found.sha256 == hashlib.sha256(body).hexdigest()
    dest = download(found, tmp_path / "out" / SDIST, None)
    assert dest.read_bytes() == body


def test_a_download_whose_sha256_differs_is_refused_and_removed(tmp_path: Path) -> None:
    index = simple_index(tmp_path, {SDIST: b"good"})
    found = find_sdist(IndexConfig((index,), (), None))
    (tmp_path / "simple" / "vllm" / SDIST).write_bytes(b"tampered")
    dest = tmp_path / "out" / SDIST
    with pytest.raises(SetupError, match="sha256"):
        download(found, dest, None)
    assert list((tmp_path / "out").iterdir()) == []


def test_the_json_simple_api_gives_url_and_hash() -> None:
    page = {
        "files": [
            {"filename": "vllm-0.32.0.tar.gz", "url": "../../x/vllm-0.32.0.tar.gz", "hashes": {}},
            {
                "filename": SDIST,
                "url": "https://files.example/v/" + SDIST,
                "hashes": {"sha256": "ab" * 32},
            },
        ]
    }
    found = parse_project_page(
        json.dumps(page).encode(),
        "application/vnd.pypi.simple.v1+json",
        "https://idx.example/simple/vllm/",
        SDIST,
    )
    assert found == Candidate("https://files.example/v/" + SDIST, "ab" * 32)


def test_no_index_listing_the_sdist_is_one_error_naming_each_place_tried(tmp_path: Path) -> None:
    index = simple_index(tmp_path, {"vllm-0.32.0.tar.gz": b"old"})
    with pytest.raises(
        SetupError,
        match=r"none of pip's indexes: .*vllm/ \(no vllm-0.33.0.tar.gz\).*PIP_INDEX_URL",
    ):
        find_sdist(IndexConfig((index,), (), None))


def test_the_indexes_are_pips_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.invalid/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///srv/extra/simple")
    config = pip_index_config()
    assert config.index_urls[:2] == ("https://mirror.invalid/simple", "file:///srv/extra/simple")


def test_no_registry_host_is_written_into_the_harness() -> None:
    text = "".join(
        p.read_text() for p in (REPO / "compat").rglob("*") if p.suffix in {".py", ".toml", ".txt"}
    )
    for host in ("pypi.org", "pythonhosted.org", "files.python"):
        assert host not in text


# ----------------------------------------------------------------- the scope and the pins


def sdist_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_every_test_file_under_each_scope_is_collected_and_nothing_else(tmp_path: Path) -> None:
    sdist = sdist_tree(
        tmp_path,
        {
            "tests/v1/kv_offload/conftest.py": "",
            "tests/v1/kv_offload/__init__.py": "",
            "tests/v1/kv_offload/test_a.py": "",
            "tests/v1/kv_offload/tiering/p2p/test_b.py": "",
            "tests/v1/kv_offload/tiering/p2p/c_test.py": "",
            "tests/v1/kv_offload/tiering/p2p/p2p_connector_proxy.py": "",
            "tests/v1/kv_connector/unit/offloading_connector/utils.py": "",
            "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py": "",
            "tests/v1/kv_connector/unit/test_offloading_connector.py": "",
            "tests/v1/kv_connector/unit/test_nixl_connector.py": "",
        },
    )
    assert discover(sdist) == [
        "kv_offload/test_a.py",
        "kv_offload/tiering/p2p/c_test.py",
        "kv_offload/tiering/p2p/test_b.py",
        "kv_connector/unit/offloading_connector/test_scheduler.py",
        "kv_connector/unit/test_offloading_connector.py",
    ]
    assert scope_of("kv_offload/tiering/p2p/test_b.py") == "tests/v1/kv_offload"
    assert scope_of("kv_connector/unit/test_offloading_connector.py") == (
        "tests/v1/kv_connector/unit/test_offloading_connector.py"
    )
    with pytest.raises(SetupError, match="in none of the harness's scopes"):
        scope_of("kv_connector/unit/test_nixl_connector.py")


def test_a_scope_missing_from_the_sdist_is_a_setup_error(tmp_path: Path) -> None:
    sdist = sdist_tree(tmp_path, {"tests/v1/kv_offload/test_a.py": ""})
    with pytest.raises(SetupError, match="offloading_connector is not in"):
        discover(sdist)


VLLM_REQUIREMENTS = {
    "requirements/common.txt": textwrap.dedent(
        """
        numpy
        transformers >= 5.16.1, < 5.21.0  # a comment
        fastapi[standard] >= 0.133.0, < 0.137.0
        llguidance >= 1.7.0, < 1.8.0; platform_machine == "no-such-machine"
        """
    ),
    "requirements/cpu.txt": "-r common.txt\ntorch==2.14.0+cpu\n",
    "requirements/test/cpu.txt": "pytest==9.1.0\n    # via -r requirements/test/cuda.in\n",
}


def test_pins_inside_vllms_declared_ranges_pass(tmp_path: Path) -> None:
    sdist = sdist_tree(tmp_path, VLLM_REQUIREMENTS)
    pins = ["numpy==2.4.6", "transformers==5.20.2", "fastapi==0.136.3", "pytest==9.1.0"]
    assert pins_outside_vllms_ranges(pins, sdist) == []


def test_a_pin_outside_vllms_range_or_not_its_requirement_is_named_with_the_range(tmp_path: Path) -> None:
    sdist = sdist_tree(tmp_path, VLLM_REQUIREMENTS)
    pins = ["transformers==5.24.0", "fastapi==0.165.0", "pytest==9.2.0", "openai-harmony==0.0.8"]
    assert pins_outside_vllms_ranges(pins, sdist) == [
        "transformers==5.24.0: outside vLLM's transformers<5.21.0,>=5.16.1 (requirements/common.txt)",
        "fastapi==0.165.0: outside vLLM's fastapi<0.137.0,>=0.133.0 (requirements/common.txt)",
        "pytest==9.2.0: outside vLLM's pytest==9.1.0 (requirements/test/cpu.txt)",
        "openai-harmony==0.0.8: openai-harmony is not among vLLM 0.33.0's requirements",
    ]


def test_an_entry_whose_marker_is_false_here_is_not_a_requirement(tmp_path: Path) -> None:
    sdist = sdist_tree(tmp_path, VLLM_REQUIREMENTS)
    assert pins_outside_vllms_ranges(["llguidance==1.9.1"], sdist) == [
        "llguidance==1.9.1: llguidance is not among vLLM 0.33.0's requirements"
    ]


def test_every_pin_is_one_version() -> None:
    lines = requirement_lines(REPO / "compat" / "requirements.txt")
    assert lines
    assert all(line.count("==") == 1 for line in lines)


def test_the_shipped_model_configs_are_laid_out_as_a_hub_cache(tmp_path: Path) -> None:
    cache = hf_hub_cache(tmp_path / "hub")
    repo = cache / "models--facebook--opt-125m"
    snapshot = repo / "snapshots" / (repo / "refs" / "main").read_text()
    shipped = REPO / "compat" / "hf" / "facebook" / "opt-125m" / "config.json"
    assert (snapshot / "config.json").read_bytes() == shipped.read_bytes()
    assert json.loads(shipped.read_text())["model_type"] == "opt"


# ----------------------------------------------------------------- the report


JUNIT = b"""<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.v1.kv_offload.cpu.test_manager" name="test_plain" time="0.1"/>
<testcase classname="tests.v1.kv_offload.cpu.test_manager" name="test_param[lru]" time="0.1">
  <failure message="AssertionError: assert 1 == 2&#10;more">trace</failure></testcase>
<testcase classname="tests.v1.kv_offload.cpu.test_manager.TestArc" name="test_ghost" time="0.1">
  <skipped message="needs CUDA"/></testcase>
</testsuite></testsuites>"""


def test_junit_cases_become_pytest_node_ids_with_their_first_message_line() -> None:
    outcomes = parse_junit(JUNIT, "kv_offload/cpu/test_manager.py")
    assert outcomes == [
        Outcome("kv_offload/cpu/test_manager.py::test_plain", "passed"),
        Outcome("kv_offload/cpu/test_manager.py::test_param[lru]", "failed", "AssertionError: assert 1 == 2"),
        Outcome("kv_offload/cpu/test_manager.py::TestArc::test_ghost", "skipped", "needs CUDA"),
    ]


def test_a_module_that_fails_to_import_is_one_collection_error_with_the_exception_it_raised() -> None:
    body = b"""<testsuites><testsuite><testcase classname="" name="tests.v1.kv_offload.test_x">
    <error message="collection failure">ImportError while importing test module '/s/test_x.py'.
Traceback:
tests/v1/kv_offload/test_x.py:3: in &lt;module&gt;
    import triton
E   ModuleNotFoundError: No module named 'triton'</error>
    </testcase></testsuite></testsuites>"""
    assert parse_junit(body, "kv_offload/test_x.py") == [
        Outcome(
            "kv_offload/test_x.py::<collection>", "error", "ModuleNotFoundError: No module named 'triton'"
        )
    ]


def test_a_module_skipped_whole_is_one_skipped_collection_with_its_reason() -> None:
    body = b"""<testsuites><testsuite><testcase classname="" name="tests.v1.kv_offload.test_k">
    <skipped message="collection skipped">('/s/tests/v1/kv_offload/test_k.py', 14,
    "Skipped: could not import 'kvcr': No module named 'kvcr'")</skipped>
    </testcase></testsuite></testsuites>"""
    assert parse_junit(body, "kv_offload/test_k.py") == [
        Outcome(
            "kv_offload/test_k.py::<collection>", "skipped", "could not import 'kvcr': No module named 'kvcr'"
        )
    ]


def outcome(test: str, result: str, message: str = "") -> Outcome:
    return Outcome(f"f.py::{test}", result, message)


def test_compare_counts_deliberate_unexpected_and_stale() -> None:
    vllm = [outcome(t, "passed") for t in ("a", "b[1]", "b[2]", "c", "d")] + [outcome("e", "skipped")]
    kvo = [
        outcome("a", "passed"),
        outcome("b[1]", "failed"),
        outcome("b[2]", "failed"),
        outcome("c", "failed"),
        outcome("d", "passed"),
    ]
    differences = [Difference(("f.py::b", "f.py::d"), "what", "why")]
    row = compare("f.py", vllm, kvo, differences)
    assert (row.tests, row.not_on_vllm, row.passed_vllm, row.passed_kvoffload, row.deliberate) == (
        6,
        1,
        5,
        2,
        2,
    )
    assert [o.test for o in row.unexpected] == ["f.py::c"]
    assert row.stale == ("f.py::d",)


def test_a_pass_during_which_no_kvoffload_code_ran_is_vllm_only_not_kvoffloads() -> None:
    vllm = [outcome("runs_kvoffload", "passed"), outcome("parses_vllms_config", "passed")]
    kvo = [outcome("runs_kvoffload", "passed"), outcome("parses_vllms_config", "passed")]
    row = compare("f.py", vllm, kvo, [], frozenset({"f.py::runs_kvoffload"}))
    assert (row.passed_kvoffload, row.vllm_only) == (1, ("f.py::parses_vllms_config",))


def test_a_test_that_passed_only_when_rerun_is_flaky_never_a_plain_pass() -> None:
    first = [
        outcome("steady", "passed"),
        outcome("wobbly", "failed", "Empty: queue"),
        outcome("broken", "failed"),
    ]
    rerun = [outcome("wobbly", "passed"), outcome("broken", "failed", "still broken")]
    settled = settle(first, rerun)
    assert settled == [
        outcome("steady", "passed"),
        outcome("wobbly", "flaky", "Empty: queue"),
        outcome("broken", "failed", "still broken"),
    ]
    vllm = [outcome("steady", "flaky"), outcome("wobbly", "passed"), outcome("broken", "passed")]
    row = compare("f.py", vllm, settled, [])
    assert row.flaky == (("f.py::steady", "vLLM"), ("f.py::wobbly", "kvoffload"))
    assert (row.passed_vllm, row.passed_kvoffload, [o.test for o in row.unexpected]) == (
        2,
        0,
        ["f.py::broken"],
    )
    table = render_report([row])
    assert "* `f.py::wobbly` (rerun needed on kvoffload)" in table


def test_a_file_that_does_not_import_on_kvoffload_fails_each_test_with_the_import_error() -> None:
    vllm = [outcome("a", "passed"), outcome("b", "passed")]
    kvo = [Outcome("f.py::<collection>", "error", "ImportError: no X")]
    row = compare("f.py", vllm, kvo, [])
    assert [(o.test, o.outcome, o.message) for o in row.unexpected] == [
        ("f.py::a", "missing", "ImportError: no X"),
        ("f.py::b", "missing", "ImportError: no X"),
    ]


def test_tests_that_skip_or_fail_on_vllm_are_counted_apart_with_their_reasons() -> None:
    vllm = [
        outcome("a", "passed"),
        outcome("cuda[1]", "skipped", "requires CUDA"),
        outcome("cuda[2]", "skipped", "requires CUDA"),
        outcome("hub", "failed", "ValidationError: no config"),
    ]
    row = compare("f.py", vllm, [outcome("a", "passed")], [])
    assert (row.tests, row.not_on_vllm, row.passed_vllm, row.unexpected) == (4, 3, 1, ())
    assert row.reasons == (("skipped: requires CUDA", 2), ("failed: ValidationError: no config", 1))
    assert "| `f.py` | 3 | 2 × skipped: requires CUDA; 1 × failed: ValidationError: no config |" in (
        render_reasons([row])
    )


def test_every_listed_difference_names_a_test_file_of_the_scope_and_is_explained_in_the_docs() -> None:
    differences = load_differences(REPO / "compat" / "differences.toml")
    explained = (REPO / "docs" / "vllm-compat.md").read_text()
    assert differences
    for difference in differences:
        for test in difference.tests:
            test_file = test.split("::")[0]
            assert test_file.endswith(".py"), test
            scope_of(test_file)  # raises for a file outside the scopes
            assert test.split("::")[1].split("[")[0] in explained, (
                f"{test} is not explained in docs/vllm-compat.md"
            )


def row(name: str, *counts: int) -> FileRow:
    tests, not_on_vllm, passed_vllm, passed_kvo, vllm_only, flaky, deliberate, unexpected = counts
    return FileRow(
        name,
        tests,
        not_on_vllm,
        passed_vllm,
        passed_kvo,
        tuple(f"{name}::v{i}" for i in range(vllm_only)),
        tuple((f"{name}::f{i}", "vLLM") for i in range(flaky)),
        deliberate,
        tuple(Outcome(f"{name}::u{i}", "failed") for i in range(unexpected)),
        (),
        (),
    )


def test_the_table_has_a_row_per_file_and_a_total() -> None:
    lines = render_table([row("a.py", 9, 2, 6, 3, 1, 1, 1, 0), row("b.py", 2, 0, 2, 1, 0, 0, 0, 1)])
    assert lines.splitlines()[0] == (
        "| vLLM test file | tests | skip/fail on vLLM | pass on vLLM | pass on kvoffload | vLLM-only | flaky"
        " | deliberate | unexpected |"
    )
    assert lines.splitlines()[2] == "| `a.py` | 9 | 2 | 6 | 3 | 1 | 1 | 1 | 0 |"
    assert (
        lines.splitlines()[-1]
        == "| **total** | **11** | **2** | **8** | **4** | **1** | **1** | **1** | **1** |"
    )


# ----------------------------------------------------------------- process groups


def sleeper(pid_file: Path, *, ignore_sigint: bool = False) -> list[str]:
    """A process that starts a child (which sleeps), writes the child's pid, and sleeps too."""
    code = f"""
import signal, subprocess, sys, time
if {ignore_sigint}:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
open({str(pid_file)!r}, "w").write(str(child.pid))
time.sleep(1000)
"""
    return [sys.executable, "-c", code]


def dead(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet: either way it runs no more."""
    for _ in range(600):  # wait for SIGKILL to land, up to a minute under load
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        threading.Event().wait(0.1)
    return False


def test_a_run_out_of_time_is_interrupted_then_its_whole_group_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    done = run_in_group(
        sleeper(pid_file, ignore_sigint=True),
        cwd=tmp_path,
        env=os.environ,
        log=tmp_path / "log",
        timeout_s=3,
        grace_s=1,
    )
    assert done.timed_out
    assert done.returncode == -signal.SIGKILL
    assert done.leftovers == 1
    assert dead(int(pid_file.read_text()))


def test_a_child_left_behind_by_a_run_that_ended_is_killed_with_its_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    code = f"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
open({str(pid_file)!r}, "w").write(str(child.pid))
"""
    done = run_in_group(
        [sys.executable, "-c", code], cwd=tmp_path, env=os.environ, log=tmp_path / "log", timeout_s=120
    )
    assert (done.timed_out, done.returncode, done.leftovers) == (False, 0, 1)
    assert dead(int(pid_file.read_text()))


def test_a_run_that_wrote_its_report_but_does_not_exit_is_killed_with_its_group(tmp_path: Path) -> None:
    # vLLM's region tests: pytest is done, but multiprocessing joins children that wait forever.
    pid_file, report = tmp_path / "child.pid", tmp_path / "report.xml"
    code = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
open({str(pid_file)!r}, "w").write(str(child.pid))
open({str(report)!r}, "w").write("<testsuites/>")
child.wait()
"""
    done = run_in_group(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=os.environ,
        log=tmp_path / "log",
        timeout_s=600,
        report=report,
        exit_grace_s=1,
    )
    assert (done.hung_at_exit, done.timed_out, done.returncode, done.leftovers) == (True, False, -9, 1)
    assert dead(int(pid_file.read_text()))


def test_an_interrupted_harness_kills_every_group_in_flight_and_starts_no_other(tmp_path: Path) -> None:
    groups = ProcessGroups()
    pid_file = tmp_path / "child.pid"
    results: list[GroupRun] = []
    runner = threading.Thread(
        target=lambda: results.append(
            run_in_group(
                sleeper(pid_file),
                cwd=tmp_path,
                env=os.environ,
                log=tmp_path / "log",
                timeout_s=600,
                groups=groups,
            )
        )
    )
    runner.start()
    for _ in range(600):
        if pid_file.is_file() and pid_file.read_text():
            break
        threading.Event().wait(0.1)
    groups.kill_all()
    runner.join(timeout=120)
    assert [r.returncode for r in results] == [-signal.SIGKILL]
    assert dead(int(pid_file.read_text()))
    with pytest.raises(Interrupted):
        run_in_group(
            ["sleep", "1000"],
            cwd=tmp_path,
            env=os.environ,
            log=tmp_path / "log2",
            timeout_s=600,
            groups=groups,
        )


# ----------------------------------------------------------------- one run, for real


def can_unshare() -> bool:
    try:
        argv = [*private_shm_argv(), "true"]
    except SetupError:
        return False
    return subprocess.run(argv, capture_output=True, timeout=60, check=False).returncode == 0


needs_unshare = pytest.mark.skipif(not can_unshare(), reason="needs unshare with a mount namespace")


@needs_unshare
def test_a_run_writes_into_a_tmpfs_of_its_own_and_never_into_the_hosts(tmp_path: Path) -> None:
    name = f"kvtest-compat-{os.getpid()}"
    script = f"touch /dev/shm/{name} && ls /dev/shm && grep ' /dev/shm ' /proc/self/mounts"
    done = subprocess.run(
        [*private_shm_argv(), "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == name  # nothing of the host's is visible in there
    assert "vllm-compat /dev/shm tmpfs" in done.stdout
    assert name not in os.listdir("/dev/shm")


def vllm_tests(vllm_tree: Path, name: str, code: str) -> str:
    """A test file of the fake sdist, under kv_offload; its name as the table gives it."""
    tests = vllm_tree / TESTS / "kv_offload"
    tests.mkdir(parents=True, exist_ok=True)
    for package in ("tests", TESTS, f"{TESTS}/kv_offload"):
        (vllm_tree / package / "__init__.py").write_text("")
    (tests / name).write_text(textwrap.dedent(code))
    return f"kv_offload/{name}"


def runs(tmp_path: Path) -> Path:
    out = tmp_path / "runs"
    out.mkdir(exist_ok=True)
    return out


@needs_unshare
def test_one_file_runs_on_both_targets_and_each_test_is_reported(vllm_tree: Path, tmp_path: Path) -> None:
    test_file = vllm_tests(
        vllm_tree,
        "test_names.py",
        """
        import os
        import vllm.v1.kv_offload.base as base

        def test_the_module_is_kvoffloads():
            assert base.__name__ == "kvoffload.base"

        def test_shm_is_private():
            open("/dev/shm/vllm_offload_kvtest-compat.mmap", "w").close()
            assert os.listdir("/dev/shm") == ["vllm_offload_kvtest-compat.mmap"]
        """,
    )
    python = Path(sys.executable)
    ours = run_file(python, vllm_tree, "kvoffload", test_file, runs(tmp_path))
    theirs = run_file(python, vllm_tree, "vllm", test_file, runs(tmp_path))
    assert [(o.test, o.outcome) for o in ours.outcomes] == [
        (f"{test_file}::test_the_module_is_kvoffloads", "passed"),
        (f"{test_file}::test_shm_is_private", "passed"),
    ]
    # Without the adapter vLLM's tree has no kv_offload here: the module fails to import.
    assert [(o.test, o.outcome) for o in theirs.outcomes] == [(f"{test_file}::<collection>", "error")]
    assert theirs.outcomes[0].message == "ModuleNotFoundError: No module named 'vllm.v1.kv_offload'"
    assert "vllm_offload_kvtest-compat.mmap" not in os.listdir("/dev/shm")


@needs_unshare
def test_the_probe_sees_kvoffload_code_run_in_the_test_its_threads_and_its_spawned_children(
    vllm_tree: Path, tmp_path: Path
) -> None:
    test_file = vllm_tests(
        vllm_tree,
        "test_probe.py",
        """
        import multiprocessing as mp
        import threading
        import vllm.v1.kv_offload.base as base

        def test_calls_kvoffload():
            assert base.get_offload_group_idx(base.make_offload_key(b"h", 3)) == 3

        def test_only_reads_a_name():
            assert base.__name__ == "kvoffload.base"

        def test_calls_kvoffload_in_a_thread():
            worker = threading.Thread(target=base.make_offload_key, args=(b"h", 0))
            worker.start()
            worker.join()

        def key_in_child():
            import vllm.v1.kv_offload.base as b
            b.make_offload_key(b"h", 1)

        def test_calls_kvoffload_in_a_spawned_child():
            child = mp.get_context("spawn").Process(target=key_in_child)
            child.start()
            child.join(120)
            assert child.exitcode == 0

        def test_only_spawns_a_child_that_runs_no_kvoffload():
            child = mp.get_context("spawn").Process(target=print)
            child.start()
            child.join(120)
            assert child.exitcode == 0
        """,
    )
    run = run_file(Path(sys.executable), vllm_tree, "kvoffload", test_file, runs(tmp_path))
    assert [o.outcome for o in run.outcomes] == ["passed"] * 5
    assert run.kvoffload_ran == {
        f"{test_file}::test_calls_kvoffload",
        f"{test_file}::test_calls_kvoffload_in_a_thread",
        f"{test_file}::test_calls_kvoffload_in_a_spawned_child",
    }


@needs_unshare
def test_a_file_that_runs_out_of_time_keeps_what_it_finished_and_leaves_no_process(
    vllm_tree: Path, tmp_path: Path
) -> None:
    pid_file = tmp_path / "child.pid"
    test_file = vllm_tests(
        vllm_tree,
        "test_hangs.py",
        f"""
        import subprocess, sys, time

        def test_finishes():
            pass

        def test_hangs_with_a_child():
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
            open({str(pid_file)!r}, "w").write(str(child.pid))
            child.wait()
        """,
    )
    run = run_file(Path(sys.executable), vllm_tree, "vllm", test_file, runs(tmp_path), timeout_s=20)
    assert run.timed_out
    assert [(o.test, o.outcome) for o in run.outcomes] == [
        (f"{test_file}::test_finishes", "passed"),
        (f"{test_file}::<run>", "error"),
    ]
    assert run.outcomes[-1].message == "timed out after 20 s; killed"
    assert dead(int(pid_file.read_text()))
    row = compare(test_file, run.outcomes, [], [])
    assert row.reasons == (("the run failed: timed out after 20 s; killed", 1),)


@needs_unshare
def test_why_a_file_does_not_run_comes_from_its_own_collection(vllm_tree: Path, tmp_path: Path) -> None:
    missing = vllm_tests(vllm_tree, "test_missing.py", "import no_such_package_here\n")
    skipped = vllm_tests(
        vllm_tree,
        "test_skipped.py",
        """
        import pytest
        pytest.importorskip("no_such_package_here")
        """,
    )
    marked = vllm_tests(
        vllm_tree,
        "test_marked.py",
        """
        import pytest

        @pytest.mark.skipif(True, reason="requires CUDA")
        def test_on_a_gpu():
            pass
        """,
    )
    python, out = Path(sys.executable), runs(tmp_path)
    rows = [
        compare(f, run_file(python, vllm_tree, "vllm", f, out).outcomes, [], [])
        for f in (missing, skipped, marked)
    ]
    assert [r.reasons for r in rows] == [
        (("does not import: ModuleNotFoundError: No module named 'no_such_package_here'", 1),),
        (
            (
                "skipped whole: could not import 'no_such_package_here': "
                "No module named 'no_such_package_here'",
                1,
            ),
        ),
        (("skipped: requires CUDA", 1),),
    ]
    assert [(r.tests, r.not_on_vllm) for r in rows] == [(0, 0), (0, 0), (1, 1)]


@needs_unshare
def test_a_test_that_fails_then_passes_alone_is_reported_flaky(vllm_tree: Path, tmp_path: Path) -> None:
    marker = tmp_path / "failed-once"
    test_file = vllm_tests(
        vllm_tree,
        "test_wobbly.py",
        f"""
        import os

        def test_fails_the_first_time():
            if not os.path.exists({str(marker)!r}):
                open({str(marker)!r}, "w").close()
                raise AssertionError("first time")
        """,
    )
    python, out = Path(sys.executable), runs(tmp_path)
    first = run_file(python, vllm_tree, "vllm", test_file, out)
    failed = [o.test for o in first.outcomes if o.outcome == "failed"]
    again = run_file(python, vllm_tree, "vllm", test_file, out, failed)
    settled = settle(first.outcomes, again.outcomes)
    assert [(o.outcome, o.message) for o in settled] == [("flaky", "AssertionError: first time")]
