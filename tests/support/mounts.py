"""A real tmpfs of the test's own, mounted with the options a test needs (root only)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(point: Path, options: str) -> Iterator[Path]:
    """``mount -t tmpfs -o OPTIONS`` on ``point`` (created), unmounted afterwards, whatever happens.

    Skips the test where it cannot mount: not root, or a sandbox that forbids it.
    """
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    point.mkdir(exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], check=False, capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"this environment does not allow mounting a tmpfs with {options}")
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)
