"""The images and what goes with them: the Dockerfiles pass hadolint, build from files that are
there and in the build context, pin everything they fetch, install the entrypoint the pod example
runs, and ``make image`` tags what the manifests name.

Nothing here builds an image (no test may need docker or podman): the Dockerfiles are read as
data and linted; ``make image`` is run only dry (``make -n``), where neither tool can be found, or
with a real docker client pointed at a socket nobody listens on.
The build recipe itself was run by hand on the base image's Python (docs/deployment.md).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.procs import REPO
from tests.system.test_deploy import tool

DOCKERFILE = REPO / "Dockerfile"
VLLM_DOCKERFILE = REPO / "deploy" / "docker" / "vllm.Dockerfile"
DOCKERFILES = [DOCKERFILE, VLLM_DOCKERFILE]
DOCKERIGNORE = REPO / ".dockerignore"
REQUIREMENTS = REPO / "deploy" / "docker" / "requirements.txt"
BUILD_REQUIREMENTS = REPO / "deploy" / "docker" / "build-requirements.txt"
ENTRYPOINT_SOURCE = "deploy/docker/entrypoint.sh"
ENTRYPOINT_PATH = "/usr/local/bin/shmctl-entrypoint.sh"
DAEMONSET = REPO / "deploy" / "kubernetes" / "daemonset.yaml"
PER_POD = REPO / "deploy" / "kubernetes" / "vllm-with-shmctl.yaml"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
#: A tag naming a patch release of Python 3.11 on a slim Debian, and the digest of what it named.
PINNED_BASE = re.compile(
    r"^(docker\.io/library/)?python:3\.11\.\d+-slim(-[a-z]+)?@sha256:[0-9a-f]{64}$",
)
#: What only torch's extra brings: the agent image must not carry it.
TORCH_ONLY = {"torch", "numpy", "nvidia-cuda-runtime-cu12", "triton"}


# ------------------------------------------------------------------ reading a Dockerfile


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, continuation lines joined, comments dropped."""
    found: list[tuple[str, str]] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued RUN
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = pending + line
        pending = ""
        keyword, _, args = whole.partition(" ")
        found.append((keyword.upper(), args.strip()))
    assert not pending, f"{dockerfile} ends inside a continued line"
    return found


def copies(dockerfile: Path) -> list[tuple[list[str], str, dict[str, str]]]:
    """Every COPY as ``(sources, destination, flags)``."""
    result = []
    for keyword, args in instructions(dockerfile):
        if keyword != "COPY":
            continue
        words = json.loads(args) if args.startswith("[") else shlex.split(args)
        flags = dict(w[2:].partition("=")[::2] for w in words if w.startswith("--"))
        paths = [w for w in words if not w.startswith("--")]
        result.append((paths[:-1], paths[-1], flags))
    return result


def context_copies(dockerfile: Path) -> list[tuple[list[str], str]]:
    """The COPYs that read the build context (not another stage)."""
    return [(sources, dest) for sources, dest, flags in copies(dockerfile) if "from" not in flags]


def args_default(dockerfile: Path, name: str) -> str | None:
    for keyword, args in instructions(dockerfile):
        key, sep, value = args.partition("=")
        if keyword == "ARG" and key == name:
            return value if sep else None
    raise AssertionError(f"{dockerfile.name} declares no ARG {name}")


def ignore_patterns() -> list[str]:
    return [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def excluded(path: str) -> bool:
    """Whether .dockerignore keeps ``path`` out of the build context (the last match wins; a
    pattern that matches a directory matches everything under it; ``**`` is any depth)."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    verdict = False
    for pattern in ignore_patterns():
        negated = pattern.startswith("!")
        body = pattern.removeprefix("!").strip("/")
        forms = {body, body.removeprefix("**/")}
        if any(fnmatch.fnmatchcase(p, form) for p in prefixes for form in forms):
            verdict = not negated
    return verdict


# ------------------------------------------------------------------ hadolint


def hadolint(dockerfile: Path, home: Path) -> subprocess.CompletedProcess[str]:
    """Every finding fails, style included; no inline ``# hadolint ignore=`` and no config file
    or HADOLINT_* variable from the machine running the tests can silence one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    return subprocess.run(
        [
            tool("hadolint"),
            "--no-color",
            "--failure-threshold",
            "style",
            "--disable-ignore-pragma",
            str(dockerfile),
        ],
        cwd=home,
        env={**env, "HOME": str(home), "XDG_CONFIG_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_dockerfile_passes_hadolint_with_no_finding_at_all(dockerfile: Path, tmp_path: Path) -> None:
    done = hadolint(dockerfile, tmp_path)
    assert (done.returncode, done.stdout) == (0, ""), done.stdout + done.stderr


def test_hadolint_fails_a_dockerfile_with_a_latest_base_and_an_unpinned_pip_install(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install --no-cache-dir shmctl\n")
    done = hadolint(bad, tmp_path)
    assert done.returncode != 0
    assert "DL3007" in done.stdout  # :latest
    assert "DL3013" in done.stdout  # pip install without a version


# ------------------------------------------------------------------ the build context


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_copy_source_exists_and_is_in_the_build_context(dockerfile: Path) -> None:
    sources = [source for found, _ in context_copies(dockerfile) for source in found]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"{dockerfile.name} copies {source}, which is not in the checkout"
        assert not excluded(source), f"{dockerfile.name} copies {source}, which .dockerignore leaves out"


def test_the_dockerignore_leaves_out_what_is_not_built_from() -> None:
    for path in (".venv/bin/python", "build/bench/results.json", "tests/system/test_image.py", ".git/config"):
        assert excluded(path), path
    for path in ("shmctl/__pycache__/app.cpython-311.pyc", "kvoffload/__pycache__/x.pyc"):
        assert excluded(path), path


def wheel_inputs() -> set[str]:
    """Every file or directory setuptools reads to build the wheel, from pyproject.toml."""
    project, tools = PYPROJECT["project"], PYPROJECT["tool"]["setuptools"]
    inputs = {"pyproject.toml", project["readme"], *project["license-files"]}
    inputs |= {pattern.rstrip("*") for pattern in tools["packages"]["find"]["include"]}
    inputs |= {path for paths in tools["data-files"].values() for path in paths}
    return inputs


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_build_stage_copies_everything_the_wheel_is_built_from(dockerfile: Path) -> None:
    copied = {source.rstrip("/") for found, _ in context_copies(dockerfile) for source in found}
    for needed in sorted(wheel_inputs()):
        covered = [c for c in copied if needed == c or needed.startswith(c + "/")]
        assert covered, f"{dockerfile.name} does not copy {needed}, which pyproject.toml builds from"
        assert not excluded(needed), f".dockerignore leaves out {needed}"


# ------------------------------------------------------------------ what the image holds


def manifest_container(manifest: Path, name: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all(manifest.read_text()):
        if doc and doc["kind"] in ("DaemonSet", "Pod"):
            spec = doc["spec"]["template"]["spec"] if doc["kind"] == "DaemonSet" else doc["spec"]
            for container in spec["containers"]:
                if container["name"] == name:
                    found: dict[str, Any] = container
                    return found
    raise AssertionError(f"no container {name!r} in {manifest.name}")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_each_image_installs_the_entrypoint_the_pod_example_runs(dockerfile: Path) -> None:
    engine = manifest_container(PER_POD, "vllm")
    assert engine["command"] == [ENTRYPOINT_PATH]
    assert ([ENTRYPOINT_SOURCE], ENTRYPOINT_PATH) in context_copies(dockerfile)
    # COPY keeps the checkout's mode: the kubelet execs the file directly.
    assert (REPO / ENTRYPOINT_SOURCE).stat().st_mode & 0o111


def test_the_vllm_image_has_the_shmctl_the_entrypoint_runs() -> None:
    # The entrypoint wrapper calls `shmctl` by name: the vLLM image puts the launcher on PATH.
    assert "shmctl reap" in (REPO / ENTRYPOINT_SOURCE).read_text()
    assert (["deploy/docker/shmctl-launcher.sh"], "/usr/local/bin/shmctl") in context_copies(VLLM_DOCKERFILE)
    assert (REPO / "deploy" / "docker" / "shmctl-launcher.sh").stat().st_mode & 0o111


def test_the_agent_image_runs_shmctl_without_a_shell() -> None:
    entrypoints = [args for keyword, args in instructions(DOCKERFILE) if keyword == "ENTRYPOINT"]
    (entrypoint,) = entrypoints
    argv = json.loads(entrypoint)  # exec form; shell form would not parse as JSON
    assert isinstance(argv, list)
    assert argv == ["/opt/shmctl/bin/shmctl"]
    venvs = [dest for _, dest, flags in copies(DOCKERFILE) if flags.get("from") == "build"]
    assert venvs == ["/opt/shmctl"]


def test_the_manifests_run_shmctl_by_a_name_the_image_has_on_its_path() -> None:
    env = [args for keyword, args in instructions(DOCKERFILE) if keyword == "ENV"]
    assert any(re.search(r"\bPATH=/opt/shmctl/bin:", args) for args in env), env
    for manifest in (DAEMONSET, PER_POD):
        assert manifest_container(manifest, "shmctl")["command"] == ["shmctl"]


def test_the_agent_image_runs_as_root_for_the_capabilities_kubernetes_adds() -> None:
    # Kubernetes sets no ambient capabilities: a non-root USER would lose LEASE and
    # DAC_READ_SEARCH at exec, and every other user's file would be `unknown`.
    assert [args for keyword, args in instructions(DOCKERFILE) if keyword == "USER"] == []


# ------------------------------------------------------------------ pinned


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_base_image_is_pinned_by_tag_and_digest(dockerfile: Path) -> None:
    base = args_default(dockerfile, "PYTHON_IMAGE")
    assert base is not None
    assert PINNED_BASE.match(base), base
    assert base == args_default(DOCKERFILE, "PYTHON_IMAGE"), "the two Dockerfiles build on different bases"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_stage_starts_from_a_pinned_argument_or_an_earlier_stage(dockerfile: Path) -> None:
    stages: list[str] = []
    for keyword, args in instructions(dockerfile):
        if keyword != "FROM":
            continue
        image, _, name = args.partition(" AS ")
        assert image in ("${PYTHON_IMAGE}", "${VLLM_IMAGE}") or image in stages, image
        stages.append(name.strip())
    # The vLLM base has no default: the release is the builder's choice, never a guess or :latest.
    if dockerfile == VLLM_DOCKERFILE:
        assert args_default(dockerfile, "VLLM_IMAGE") is None


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_pip_install_installs_hashed_pins_or_the_wheel_just_built(dockerfile: Path) -> None:
    runs = [args for keyword, args in instructions(dockerfile) if keyword == "RUN"]
    installs = [
        shlex.split(step)
        for args in runs
        for step in args.split("&&")
        if re.search(r"\bpip\b.*\binstall\b", step)
    ]
    assert installs
    for argv in installs:
        if "-r" in argv:
            assert "--require-hashes" in argv, argv
            assert argv[argv.index("-r") + 1] in (
                "deploy/docker/requirements.txt",
                "deploy/docker/build-requirements.txt",
            ), argv
        else:
            assert {"--no-deps", "--no-index"} <= set(argv), argv
            assert argv[-1] == "/wheels/shmctl-*.whl", argv


def pins(requirements: Path) -> dict[str, tuple[str, list[str]]]:
    """``{name: (version, [sha256, ...])}``, every requirement required to be ``name==version``."""
    text = requirements.read_text().replace("\\\n", " ")
    found: dict[str, tuple[str, list[str]]] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        requirement = Requirement(words[0])
        (spec,) = requirement.specifier
        assert spec.operator == "==", line
        hashes = [w.removeprefix("--hash=sha256:") for w in words[1:] if w.startswith("--hash=sha256:")]
        assert hashes, f"no hash: {line}"
        assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), line
        assert len(hashes) == len(words) - 1, f"an option other than --hash: {line}"
        found[canonicalize_name(requirement.name)] = (spec.version, hashes)
    return found


def dependency_closure(requirements: list[str]) -> set[str]:
    """The names ``requirements`` pull in, as installed here (no extras, markers evaluated)."""
    names: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name in names:
            continue
        names.add(name)
        todo += [Requirement(r) for r in metadata.requires(name) or []]
    return names


def test_the_image_pins_exactly_shmctls_core_dependencies_and_theirs() -> None:
    pinned = pins(REQUIREMENTS)
    assert set(pinned) == dependency_closure(PYPROJECT["project"]["dependencies"])
    assert not set(pinned) & TORCH_ONLY


@pytest.mark.parametrize(
    ("requirements", "wanted"),
    [
        (REQUIREMENTS, PYPROJECT["project"]["dependencies"]),
        (BUILD_REQUIREMENTS, PYPROJECT["build-system"]["requires"]),
    ],
    ids=["runtime", "build"],
)
def test_each_pin_satisfies_what_pyproject_asks_for(requirements: Path, wanted: list[str]) -> None:
    pinned = pins(requirements)
    for text in wanted:
        requirement = Requirement(text)
        version, _ = pinned[canonicalize_name(requirement.name)]
        assert requirement.specifier.contains(version), f"{requirement.name}=={version} is not {requirement}"


def test_no_image_reference_is_latest_or_untagged() -> None:
    images = [manifest_container(DAEMONSET, "shmctl")["image"]]
    images += [manifest_container(PER_POD, name)["image"] for name in ("vllm", "shmctl")]
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name, image
        assert "/" not in tag, f"{image} has no tag"
        assert tag not in ("", "latest"), image
    for dockerfile in DOCKERFILES:
        assert not re.search(r":latest\b", dockerfile.read_text()), dockerfile


# ------------------------------------------------------------------ make image


#: What ``make image`` reads; the tests run it without them in the environment.
MAKE_VARIABLES = {"IMAGE", "VLLM_IMAGE", "VLLM_WITH_SHMCTL", "CONTAINER_TOOL", "VERSION"}


def make() -> str:
    found = shutil.which("make")
    if found is None:
        pytest.skip("make is not installed")
    return found


def make_image_dry_run(*variables: str) -> str:
    """What ``make image`` would run, printed and not run (``make -n``)."""
    done = subprocess.run(
        [make(), "--no-print-directory", "-n", "image", *variables],
        cwd=REPO,
        # The Makefile's variables from the environment would change what it tags.
        env={k: v for k, v in os.environ.items() if not k.startswith("MAKE") and k not in MAKE_VARIABLES},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def built_tags(recipe: str) -> dict[str, str]:
    """``{Dockerfile: tag}`` of every build in the recipe."""
    return dict(re.findall(r'build --file (\S+)(?: --build-arg \S+)* --tag "([^"]+)"', recipe))


def test_make_image_tags_what_the_manifests_name() -> None:
    tags = built_tags(make_image_dry_run("VLLM_IMAGE=docker.io/vllm/vllm-openai:v0.0.0"))
    assert set(tags) == {"Dockerfile", "deploy/docker/vllm.Dockerfile"}
    assert tags["Dockerfile"] == f"shmctl:{PYPROJECT['project']['version']}"
    assert manifest_container(DAEMONSET, "shmctl")["image"] == tags["Dockerfile"]
    assert manifest_container(PER_POD, "shmctl")["image"] == tags["Dockerfile"]
    assert manifest_container(PER_POD, "vllm")["image"] == tags["deploy/docker/vllm.Dockerfile"]


def test_make_image_builds_the_vllm_image_only_on_a_vllm_base_given() -> None:
    recipe = make_image_dry_run()
    assert 'if [ -n "" ]' in recipe, recipe


def test_make_image_says_so_when_neither_docker_nor_podman_is_installed(tmp_path: Path) -> None:
    # A PATH with sed (the Makefile reads the version with it) and neither tool on it, so this
    # can never start a build whatever the machine has.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    sed = shutil.which("sed")
    assert sed is not None
    (bindir / "sed").symlink_to(sed)
    done = subprocess.run(
        [make(), "--no-print-directory", "image"],
        cwd=REPO,
        env={"PATH": str(bindir), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert done.stdout == ""
    assert "make image: neither docker nor podman is installed (fix: " in done.stderr, done.stderr


def test_make_image_says_so_in_one_line_when_docker_is_installed_but_no_daemon_answers(
    tmp_path: Path,
) -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client here")
    # The real client, pointed at a socket nobody listens on: no build can start, whatever
    # this machine runs. PATH holds it and sed only (no podman to fall back to); HOME is empty,
    # so no docker context of the machine's can point it elsewhere.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    sed = shutil.which("sed")
    assert sed is not None
    (bindir / "sed").symlink_to(sed)
    (bindir / "docker").symlink_to(docker)
    socket = tmp_path / "nobody-listens.sock"
    done = subprocess.run(
        [make(), "--no-print-directory", "image"],
        cwd=REPO,
        env={"PATH": str(bindir), "HOME": str(tmp_path), "DOCKER_HOST": f"unix://{socket}"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert done.stdout == ""
    # One line of ours; the other is make's own account of the failed recipe.
    ours, *rest = done.stderr.splitlines()
    assert [line for line in rest if not line.startswith("make: *** [")] == [], done.stderr
    assert ours.startswith("make image: docker is installed but its daemon does not answer ("), ours
    assert f"unix://{socket}" in ours, "the address it tried"
    assert ours.endswith(
        "); start it (systemctl start docker) or build elsewhere "
        f"(fix: any OCI builder on ./Dockerfile, tagged shmctl:{PYPROJECT['project']['version']})"
    ), ours
    assert "Is the docker daemon running" not in ours, "no echo of docker's own question"
    assert "build" not in done.stderr.replace(ours, ""), "no build was started"
