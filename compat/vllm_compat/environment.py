"""What the test runs need besides the sdist: a venv of their own, and an offline hub cache.

The venv holds torch's CPU build (``TORCH``), then the pins of ``compat/requirements.txt``
(checked against vLLM's ranges first: ``pins``); it is rebuilt when either changes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import SetupError
from .scope import COMPAT

TORCH = os.environ.get("TORCH", "torch==2.13.0")


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
