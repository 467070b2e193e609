"""What ``pip install .`` gives an operator: a wheel built without warnings that carries the
licence, type information, schemas, completions, units and man page; a core install with no
numpy, psutil or torch in which every command but a real ``init`` works; a man page that is what
the CLI says today.

The wheel is built once per session, from a copy of the working tree (tracked and untracked
files git does not ignore), with setuptools' own PEP 517 hooks: what pip runs, minus the
isolated build environment it would download.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.utils import canonicalize_name

from tests.support.procs import REPO, shm_dir

#: The wheel and the core venv are built once per worker: their tests share one.
pytestmark = pytest.mark.xdist_group("packaging")

#: Lines of a build log that mean the packaging config is on its way out.
WARNING = re.compile(r"(?i)deprecat|SetuptoolsWarning|SetuptoolsDeprecationWarning|\bwarning\b")
CORE = {"typer", "rich", "prometheus-client", "orjson"}
MAN_PAGE = REPO / "man" / "shmctl.1"
CONFIG = '{"kv_connector":"OffloadingConnector","kv_connector_extra_config":{"cpu_bytes_to_use":268435456}}'
INIT = ("init", "--kv-transfer-config", CONFIG, "--model", "llama-3-8b")


def source_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [name for name in listed.split("\0") if name and (REPO / name).is_file()]


def build_wheel(work: Path) -> tuple[Path, str]:
    """``(wheel, build log)`` for the working tree as it is now, built under ``work``."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a checkout to know which files are the project's")
    tree, dist = work / "src", work / "dist"
    for name in source_files():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, tree / name)
    dist.mkdir()
    # -W always: every warning setuptools emits reaches the log, once per place.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run(
        [
            sys.executable,
            "-W",
            "always",
            "-c",
            "import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))",
            str(dist),
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    return dist / done.stdout.strip().splitlines()[-1], log


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``(wheel, build log)`` for the working tree as it is now."""
    return build_wheel(tmp_path_factory.mktemp("build"))


def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode()


def test_the_build_emits_no_setuptools_warning(built: tuple[Path, str]) -> None:
    _, log = built
    assert [line for line in log.splitlines() if WARNING.search(line)] == [], log


def test_the_wheel_carries_license_py_typed_schemas_completions_units_and_man_page(
    built: tuple[Path, str],
) -> None:
    wheel, _ = built
    names = wheel_names(wheel)
    data = next(n.split("/")[0] for n in names if ".data/" in n)
    expected = {
        "kvoffload/py.typed",
        "shmctl/py.typed",
        f"{data}/data/share/man/man1/shmctl.1",
        f"{data}/data/share/bash-completion/completions/shmctl",
        f"{data}/data/share/zsh/site-functions/_shmctl",
        f"{data}/data/share/fish/vendor_completions.d/shmctl.fish",
        f"{data}/data/share/shmctl/install-units.sh",
        *(f"{data}/data/share/shmctl/completions/shmctl.{sh}" for sh in ("bash", "zsh", "fish")),
        *(f"{data}/data/share/shmctl/systemd/{u.name}" for u in (REPO / "deploy" / "systemd").iterdir()),
    }
    assert expected <= names, sorted(expected - names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
    schemas = {f"shmctl/schemas/{p.name}" for p in (REPO / "shmctl" / "schemas").glob("*.json")}
    assert schemas, "no JSON Schema in shmctl/schemas"
    assert schemas <= names, sorted(schemas - names)


def test_each_shell_finds_one_completion_file_under_the_name_it_looks_up(built: tuple[Path, str]) -> None:
    names = wheel_names(built[0])
    found = {
        directory: {n.rsplit("/", 1)[1] for n in names if f".data/data/share/{directory}/" in n}
        for directory in ("bash-completion/completions", "zsh/site-functions", "fish/vendor_completions.d")
    }
    assert found == {
        "bash-completion/completions": {"shmctl"},
        "zsh/site-functions": {"_shmctl"},
        "fish/vendor_completions.d": {"shmctl.fish"},
    }


def test_the_wheel_declares_classifiers_and_keywords_but_no_licence_classifier(
    built: tuple[Path, str],
) -> None:
    lines = metadata(built[0]).splitlines()
    classifiers = {line.removeprefix("Classifier: ") for line in lines if line.startswith("Classifier: ")}
    assert {
        "Environment :: Console",
        "Intended Audience :: System Administrators",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: System :: Systems Administration",
        "Typing :: Typed",
    } <= classifiers, sorted(classifiers)
    assert [c for c in classifiers if c.startswith("Development Status :: ")], sorted(classifiers)
    # The licence is the License-Expression; setuptools refuses a licence classifier beside one.
    assert not [c for c in classifiers if c.startswith("License :: ")]
    keywords = next(line.removeprefix("Keywords: ") for line in lines if line.startswith("Keywords: "))
    assert {"vllm", "kv-cache", "shared-memory"} <= set(keywords.split(","))


def test_the_wheel_declares_an_spdx_license_and_only_the_core_dependencies(built: tuple[Path, str]) -> None:
    meta = metadata(built[0])
    assert "License-Expression: Apache-2.0" in meta.splitlines()
    required = {
        re.split(r"[<>=!~;\[ ]", line.removeprefix("Requires-Dist: "))[0].lower()
        for line in meta.splitlines()
        if line.startswith("Requires-Dist: ") and "extra ==" not in line
    }
    assert required == CORE


def test_numpy_comes_with_the_torch_extra(built: tuple[Path, str]) -> None:
    torch_extra = {
        re.split(r"[<>=!~; ]", line.removeprefix("Requires-Dist: "))[0]
        for line in metadata(built[0]).splitlines()
        if line.startswith("Requires-Dist: ") and 'extra == "torch"' in line
    }
    assert torch_extra == {"torch", "numpy"}


def test_install_units_keeps_its_execute_bit_in_the_wheel(built: tuple[Path, str]) -> None:
    with zipfile.ZipFile(built[0]) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("share/shmctl/install-units.sh"))
    assert (info.external_attr >> 16) & 0o111, oct(info.external_attr >> 16)


# --------------------------------------------------------------- a core install, no torch


@pytest.fixture(scope="session")
def core_venv(built: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel and its core dependencies only (no torch, numpy or psutil)."""
    wheel, _ = built
    home = tmp_path_factory.mktemp("core-venv")
    venv.create(home, with_pip=True)
    pip = [str(home / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    requirements = [
        line.removeprefix("Requires-Dist: ")
        for line in metadata(wheel).splitlines()
        if line.startswith("Requires-Dist: ") and "extra ==" not in line
    ]
    for args in (["--no-deps", str(wheel)], requirements):
        done = subprocess.run([*pip, *args], capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    return home


@pytest.fixture
def core_root() -> Iterator[Path]:
    with shm_dir() as path:
        yield path


def run_core(home: Path, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # cwd outside the checkout, so nothing imports from the working tree by accident.
    path = os.pathsep.join([str(home / "bin"), os.environ["PATH"]])
    return subprocess.run(
        [str(home / "bin" / "shmctl"), *args],
        env={**os.environ, "SHMCTL_ROOT": str(root), "PATH": path},
        cwd=home,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
def test_the_core_install_has_neither_numpy_nor_psutil_nor_torch(core_venv: Path) -> None:
    probe = subprocess.run(
        [
            str(core_venv / "bin" / "python"),
            "-c",
            "import importlib.util as u; "
            "print(sorted(m for m in ('numpy', 'psutil', 'torch') if u.find_spec(m)))",
        ],
        cwd=core_venv,
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == "[]"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ("scan",),
        ("reap", "--dry-run"),
        ("faults",),
        (*INIT, "--dry-run"),
        pytest.param(("audit", "--", "true"), marks=pytest.mark.system_wide),  # audits the shm tmpfs
    ],
    ids=["scan", "reap --dry-run", "faults", "init --dry-run", "audit"],
)
def test_without_torch_every_command_but_a_real_init_works(
    core_venv: Path, core_root: Path, args: tuple[str, ...]
) -> None:
    done = run_core(core_venv, core_root, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_without_torch_a_real_init_fails_with_one_line_naming_the_torch_extra(
    core_venv: Path, core_root: Path
) -> None:
    done = run_core(core_venv, core_root, *INIT)
    assert done.returncode == 3, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("shmctl: error: ")
    assert "shmctl[torch]" in lines[0]
    assert done.stdout == ""
    assert list(core_root.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "env"),
    [
        (("scan",), {}),
        # a rank: a Tab typer answers (shmctl.launch answers the fixed lists and engine ids itself)
        ((), {"_SHMCTL_COMPLETE": "complete_bash", "COMP_WORDS": "shmctl init --rank ", "COMP_CWORD": "3"}),
    ],
    ids=["scan", "tab"],
)
def test_the_core_install_parses_and_completes_without_importing_pydantic(
    core_venv: Path, core_root: Path, args: tuple[str, ...], env: dict[str, str]
) -> None:
    # typer 0.29 builds a pydantic TypeAdapter for every option it parses: ~0.2 s more per Tab
    # (docs/install.md), which is why pyproject.toml keeps typer below 0.29.
    done = subprocess.run(
        [str(core_venv / "bin" / "shmctl"), *args],
        env={**os.environ, **env, "SHMCTL_ROOT": str(core_root), "PYTHONPROFILEIMPORTTIME": "1"},
        cwd=core_venv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "shmctl.app" in imported, done.stderr[-2000:]
    assert not {m for m in imported if m.split(".")[0] in {"pydantic", "pydantic_core"}}


# ------------------------------------------------------------- beside vLLM, one environment

PYPI = "https://pypi.org/simple"
#: vLLM 0.33.0's own requirements (its wheel's Requires-Dist, verbatim) through which pip picks a
#: package shmctl installs too: typer, rich and theirs (fastapi[standard] through fastapi-cli
#: and fastapi-cloud-cli, transformers, fastsafetensors), prometheus-client, annotated-doc.
#: Found by resolving all of vllm==0.33.0 (`pip install --dry-run --report`: 198 packages, of
#: which typer 0.29.2 alone changed when shmctl was added). The rest of the list reaches none of
#: them; it is left out because PyPI serves no PEP 658 metadata for these wheels, so resolving
#: it downloads every wheel, some 5 GB (torch, CUDA libraries), for nothing shmctl shares.
VLLM_0_33_REQUIREMENTS_SHARED_WITH_SHMCTL = (
    "transformers<5.21.0,>=5.16.1",
    "fastapi[standard]<0.137.0,>=0.133.0",
    "prometheus_client>=0.18.0",
    "prometheus-fastapi-instrumentator>=8.0.0",
    "model-hosting-container-standards<1.0.0,>=0.1.14",
    "fastsafetensors>=0.3.3",
)


def pypi_pip_env() -> dict[str, str]:
    """The environment for a pip that asks PyPI alone: no pip.conf (its local indexes,
    find-links and constraints), but the certificate and proxy settings it is given."""
    keep = {"PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in keep}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@pytest.fixture(scope="module")
def beside_vllm(
    built: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, str], dict[str, str]]:
    """``(vLLM alone, vLLM and shmctl)``: name -> version, as pip resolves them from PyPI."""
    probe = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "typer", "--index-url", PYPI, "--retries", "0"],
        env=pypi_pip_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"PyPI does not answer: {(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    reports = tmp_path_factory.mktemp("beside-vllm")
    runs = {}
    for name, extra in (("alone", ()), ("together", (str(built[0]),))):
        report = reports / f"{name}.json"
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        command += ["--only-binary", ":all:", "--index-url", PYPI, "--report", str(report)]
        # The two resolutions run at once: each is mostly waiting on PyPI.
        process = subprocess.Popen(
            [*command, *VLLM_0_33_REQUIREMENTS_SHARED_WITH_SHMCTL, *extra],
            env=pypi_pip_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        runs[name] = (process, report)
    try:
        finished = [
            (process.communicate(timeout=300)[0], process, report) for process, report in runs.values()
        ]
    finally:
        for process, _ in runs.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    resolved: list[dict[str, str]] = []
    for output, process, report in finished:
        assert process.returncode == 0, output
        installs = json.loads(report.read_text())["install"]
        resolved.append(
            {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}
        )
    return resolved[0], resolved[1]


@pytest.mark.timeout(600)
def test_installed_into_vllm_0_33s_environment_shmctl_conflicts_with_nothing_and_moves_only_typer(
    beside_vllm: tuple[dict[str, str], dict[str, str]],
) -> None:
    # typer is held below 0.29 (0.29.2 -> 0.28.x), which every package of vLLM's that needs typer
    # accepts; docs/install.md says to install shmctl apart all the same (pipx, its own venv, the
    # images), so vLLM's environment keeps the typer its own resolution picks.
    alone, together = beside_vllm
    assert "typer" in alone, "vLLM's requirements no longer bring typer: read docs/install.md again"
    moved = {
        name: (version, together.get(name))
        for name, version in alone.items()
        if together.get(name) != version
    }
    assert set(moved) <= {"typer"}, moved
    assert together["shmctl"]


# ------------------------------------------------------------------------- torch, Makefile


@pytest.mark.parametrize(
    ("overrides", "index"),
    [((), "https://download.pytorch.org/whl/cpu"), (("TORCH_INDEX=",), "")],
    ids=["default", "TORCH_INDEX="],
)
def test_make_installs_torch_with_pytorchs_cpu_index_unless_told_not_to(
    overrides: tuple[str, ...], index: str
) -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # -n prints the venv's recipe without running it; -B as if the venv were out of date.
    done = subprocess.run(
        ["make", "-n", "-B", *overrides, ".venv/.installed"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert f'index="{index}"' in done.stdout, done.stdout
    assert '${index:+--extra-index-url "$index"} "torch==2.13.0"' in done.stdout, done.stdout


# --------------------------------------------------------------------------- man page


def test_the_committed_man_page_is_what_the_cli_says_now() -> None:
    fresh = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_manpage.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert fresh == MAN_PAGE.read_text(), "man/shmctl.1 is stale: run `make man`"


def test_the_man_page_documents_every_command_and_every_visible_option_under_it() -> None:
    import typer.main

    from shmctl.app import app

    section = re.compile(r"^\.SS shmctl (\S+) .*?\n(.*?)(?=^\.S[SH] )", re.M | re.S)
    sections = dict(section.findall(MAN_PAGE.read_text()))
    root: Any = typer.main.get_command(app)  # a click Group, from the click typer vendors
    assert set(sections) == set(root.commands)
    for name, command in root.commands.items():
        for param in command.params:
            if getattr(param, "hidden", False) or param.param_type_name == "argument":
                continue
            for option in param.opts:
                roff = "\\fB" + option.replace("-", "\\-")
                assert roff in sections[name], (name, option)


def test_groff_renders_the_man_page_without_a_warning() -> None:
    if shutil.which("groff") is None:
        pytest.skip("groff is not installed")
    done = subprocess.run(
        ["groff", "-man", "-ww", "-z", "-Tutf8", str(MAN_PAGE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")


def test_man_renders_the_man_page_without_a_warning() -> None:
    if shutil.which("man") is None:
        pytest.skip("man is not installed")
    done = subprocess.run(
        ["man", "--warnings", "-l", str(MAN_PAGE)],
        env={**os.environ, "MANPAGER": "cat", "MANWIDTH": "100"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert "shmctl - find, explain and safely reap" in done.stdout
