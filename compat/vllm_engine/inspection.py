"""What a scenario looks at besides its engine: the regions in /dev/shm, and shmctl's answers.

``/dev/shm`` is the scenario's private tmpfs, so every ``vllm_offload_*`` file in it is its
engines' (or its bystander's). shmctl runs as the operator would run it, as a command whose
JSON is parsed (None when there is none).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from .engine import ENGINE_TIMEOUT_S


def regions(root: Path = Path("/dev/shm")) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("vllm_offload_"))


def shmctl(python: str, *args: str) -> tuple[int, Any, str]:
    done = subprocess.run(
        [python, "-m", "shmctl", *args], capture_output=True, text=True, check=False, timeout=ENGINE_TIMEOUT_S
    )
    try:
        doc = json.loads(done.stdout) if done.stdout.strip() else None
    except json.JSONDecodeError:
        doc = None
    return done.returncode, doc, done.stderr
