"""`make vllm-compat`'s parts that need no download: the adapter, the index lookup, the report.

The run itself (vLLM's tests against both) needs the network and is not part of `make test`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.procs import REPO

sys.path.insert(0, str(REPO / "compat"))  # compat/ is a folder of scripts, not a package
import vllm_compat

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
    index = simple_index(
        tmp_path, {"vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl": b"w", vllm_compat.SDIST: body}
    )
    config = vllm_compat.IndexConfig(("file:///nonexistent/simple", index), (), None)
    found = vllm_compat.find_sdist(config)
    assert found.url.endswith("/vllm/" + vllm_compat.SDIST)
    assert found.sha256 == hashlib.sha256(body).hexdigest()
    dest = vllm_compat.download(found, tmp_path / "out" / vllm_compat.SDIST, None)
    assert dest.read_bytes() == body


def test_a_download_whose_sha256_differs_is_refused_and_removed(tmp_path: Path) -> None:
    index = simple_index(tmp_path, {vllm_compat.SDIST: b"good"})
    found = vllm_compat.find_sdist(vllm_compat.IndexConfig((index,), (), None))
    (tmp_path / "simple" / "vllm" / vllm_compat.SDIST).write_bytes(b"tampered")
    dest = tmp_path / "out" / vllm_compat.SDIST
    with pytest.raises(vllm_compat.SetupError, match="sha256"):
        vllm_compat.download(found, dest, None)
    assert list((tmp_path / "out").iterdir()) == []


def test_the_json_simple_api_gives_url_and_hash() -> None:
    page = {
        "files": [
            {"filename": "vllm-0.32.0.tar.gz", "url": "../../x/vllm-0.32.0.tar.gz", "hashes": {}},
            {
                "filename": vllm_compat.SDIST,
                "url": "https://files.example/v/" + vllm_compat.SDIST,
                "hashes": {"sha256": "ab" * 32},
            },
        ]
    }
    found = vllm_compat.parse_project_page(
        json.dumps(page).encode(),
        "application/vnd.pypi.simple.v1+json",
        "https://idx.example/simple/vllm/",
        vllm_compat.SDIST,
    )
    assert found == vllm_compat.Candidate("https://files.example/v/" + vllm_compat.SDIST, "ab" * 32)


def test_no_index_listing_the_sdist_is_one_error_naming_each_place_tried(tmp_path: Path) -> None:
    index = simple_index(tmp_path, {"vllm-0.32.0.tar.gz": b"old"})
    with pytest.raises(
        vllm_compat.SetupError,
        match=r"none of pip's indexes: .*vllm/ \(no vllm-0.33.0.tar.gz\).*PIP_INDEX_URL",
    ):
        vllm_compat.find_sdist(vllm_compat.IndexConfig((index,), (), None))


def test_the_indexes_are_pips_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.invalid/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///srv/extra/simple")
    config = vllm_compat.pip_index_config()
    assert config.index_urls[:2] == ("https://mirror.invalid/simple", "file:///srv/extra/simple")


def test_no_registry_host_is_written_into_the_harness() -> None:
    text = "".join(
        p.read_text() for p in (REPO / "compat").rglob("*") if p.suffix in {".py", ".toml", ".txt"}
    )
    for host in ("pypi.org", "pythonhosted.org", "files.python"):
        assert host not in text


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
    outcomes = vllm_compat.parse_junit(JUNIT, "cpu/test_manager.py")
    assert outcomes == [
        vllm_compat.Outcome("cpu/test_manager.py::test_plain", "passed"),
        vllm_compat.Outcome(
            "cpu/test_manager.py::test_param[lru]", "failed", "AssertionError: assert 1 == 2"
        ),
        vllm_compat.Outcome("cpu/test_manager.py::TestArc::test_ghost", "skipped", "needs CUDA"),
    ]


def test_a_module_that_fails_to_import_is_one_collection_error() -> None:
    body = b"""<testsuites><testsuite><testcase classname="" name="tests.v1.kv_offload.test_x">
    <error message="collection failure">ImportError: cannot import name 'X'</error>
    </testcase></testsuite></testsuites>"""
    assert vllm_compat.parse_junit(body, "test_x.py") == [
        vllm_compat.Outcome("test_x.py::<collection>", "error", "collection failure")
    ]


def outcome(test: str, result: str) -> vllm_compat.Outcome:
    return vllm_compat.Outcome(f"f.py::{test}", result)


def test_compare_counts_deliberate_unexpected_and_stale() -> None:
    vllm = [outcome(t, "passed") for t in ("a", "b[1]", "b[2]", "c", "d")] + [outcome("e", "skipped")]
    kvo = [
        outcome("a", "passed"),
        outcome("b[1]", "failed"),
        outcome("b[2]", "failed"),
        outcome("c", "failed"),
        outcome("d", "passed"),
    ]
    differences = [vllm_compat.Difference(("f.py::b", "f.py::d"), "what", "why")]
    row = vllm_compat.compare("f.py", vllm, kvo, differences)
    assert (row.tests, row.passed_vllm, row.passed_kvoffload, row.deliberate) == (5, 5, 2, 2)
    assert [o.test for o in row.unexpected] == ["f.py::c"]
    assert row.stale == ("f.py::d",)


def test_a_file_that_does_not_import_on_kvoffload_fails_each_test_with_the_import_error() -> None:
    vllm = [outcome("a", "passed"), outcome("b", "passed")]
    kvo = [vllm_compat.Outcome("f.py::<collection>", "error", "ImportError: no X")]
    row = vllm_compat.compare("f.py", vllm, kvo, [])
    assert [(o.test, o.outcome, o.message) for o in row.unexpected] == [
        ("f.py::a", "missing", "ImportError: no X"),
        ("f.py::b", "missing", "ImportError: no X"),
    ]


def test_every_listed_difference_names_a_test_file_of_the_run_and_is_explained_in_the_docs() -> None:
    differences = vllm_compat.load_differences(REPO / "compat" / "differences.toml")
    explained = (REPO / "docs" / "vllm-compat.md").read_text()
    for difference in differences:
        for test in difference.tests:
            assert test.split("::")[0] in vllm_compat.FILES, test
            assert test.split("::")[1].split("[")[0] in explained, (
                f"{test} is not explained in docs/vllm-compat.md"
            )


def test_the_table_has_a_row_per_file_and_a_total() -> None:
    rows = [
        vllm_compat.FileRow("a.py", 3, 3, 2, 1, (), ()),
        vllm_compat.FileRow("b.py", 2, 2, 2, 0, (), ()),
    ]
    lines = vllm_compat.render_table(rows).splitlines()
    assert lines[2] == "| `a.py` | 3 | 3 | 2 | 1 | 0 |"
    assert lines[-1] == "| **total** | **5** | **5** | **4** | **1** | **0** |"


# ----------------------------------------------------------------- one run, for real


def can_unshare() -> bool:
    try:
        argv = [*vllm_compat.private_shm_argv(), "true"]
    except vllm_compat.SetupError:
        return False
    return subprocess.run(argv, capture_output=True, timeout=60, check=False).returncode == 0


needs_unshare = pytest.mark.skipif(not can_unshare(), reason="needs unshare with a mount namespace")


@needs_unshare
def test_a_run_writes_into_a_tmpfs_of_its_own_and_never_into_the_hosts(tmp_path: Path) -> None:
    name = f"kvtest-compat-{os.getpid()}"
    script = f"touch /dev/shm/{name} && ls /dev/shm && grep ' /dev/shm ' /proc/self/mounts"
    done = subprocess.run(
        [*vllm_compat.private_shm_argv(), "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == name  # nothing of the host's is visible in there
    assert "vllm-compat /dev/shm tmpfs" in done.stdout
    assert name not in os.listdir("/dev/shm")


@needs_unshare
def test_one_file_runs_on_both_targets_and_each_test_is_reported(vllm_tree: Path, tmp_path: Path) -> None:
    tests = vllm_tree / vllm_compat.TESTS
    tests.mkdir(parents=True)
    for package in ("tests", "tests/v1", vllm_compat.TESTS):
        (vllm_tree / package / "__init__.py").write_text("")
    (tests / "test_names.py").write_text(
        textwrap.dedent(
            """
            import os
            import vllm.v1.kv_offload.base as base

            def test_the_module_is_kvoffloads():
                assert base.__name__ == "kvoffload.base"

            def test_shm_is_private():
                open("/dev/shm/vllm_offload_kvtest-compat.mmap", "w").close()
                assert os.listdir("/dev/shm") == ["vllm_offload_kvtest-compat.mmap"]
            """
        )
    )
    out = tmp_path / "runs"
    out.mkdir()
    python = Path(sys.executable)
    ours = vllm_compat.run_file(python, vllm_tree, "kvoffload", "test_names.py", out)
    theirs = vllm_compat.run_file(python, vllm_tree, "vllm", "test_names.py", out)
    assert [(o.test, o.outcome) for o in ours] == [
        ("test_names.py::test_the_module_is_kvoffloads", "passed"),
        ("test_names.py::test_shm_is_private", "passed"),
    ]
    # Without the adapter vLLM's tree has no kv_offload here: the module fails to import.
    assert [(o.test, o.outcome) for o in theirs] == [("test_names.py::<collection>", "error")]
    assert "vllm_offload_kvtest-compat.mmap" not in os.listdir("/dev/shm")
