"""What the harness runs: vLLM's version, its sdist, the test files of ``SCOPES`` in it.

Test files are named relative to ``TESTS`` (``kv_offload/cpu/test_manager.py``) everywhere: in
``--only``, in the table and in ``compat/differences.toml``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from pathlib import Path

from .errors import SetupError

#: The repository (the package is ``compat/vllm_compat/``) and its ``compat`` folder.
REPO = Path(__file__).resolve().parents[2]
COMPAT = REPO / "compat"
PROJECT = "vllm"
VERSION = "0.33.0"
SDIST = f"{PROJECT}-{VERSION}.tar.gz"
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
