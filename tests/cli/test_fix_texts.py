"""Every "fix:" is true to the error it follows: the errno decides the fix, and a full disk,
a privileged port or a loop of links never gets the fix of a permission problem."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.tiering.fs.manager import _namespace_fix
from tests.support.procs import REPO

NOBODY = 65534


def test_a_config_that_is_a_loop_of_links_is_named_as_one(tmp_path: Path) -> None:
    (tmp_path / "a.json").symlink_to(tmp_path / "b.json")
    (tmp_path / "b.json").symlink_to(tmp_path / "a.json")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmctl",
            "init",
            "--dry-run",
            "--model",
            "llama-3-8b",
            "--config",
            str(tmp_path / "a.json"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "loop of symbolic links" in done.stderr
    assert "this user can read" not in done.stderr
    assert done.stderr.count("\n") == 1


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_a_privileged_port_asks_for_the_capability_not_another_address(tmp_path: Path) -> None:
    if int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text()) <= 80:
        pytest.skip("this host lets any user bind port 80 (net.ipv4.ip_unprivileged_port_start)")
    root = tmp_path / "root"
    root.mkdir()
    os.chown(root, NOBODY, NOBODY)
    done = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
         sys.executable, "-m", "shmctl", "watch", "--once", "--root", str(root), "--listen", "127.0.0.1:80"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "HOME": str(tmp_path)},
        timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "CAP_NET_BIND_SERVICE" in done.stderr
    assert "local address" not in done.stderr


@pytest.mark.parametrize(
    ("code", "says", "never"),
    [
        (errno.ENOSPC, "free space", "write access"),
        (errno.EDQUOT, "free space", "write access"),
        (errno.EROFS, "read-only mount", "free space"),
        (errno.EACCES, "write access", "free space"),
        (errno.EIO, "dmesg", "write access"),
        (errno.ENOTDIR, "is a file", "free space"),
    ],
    ids=lambda v: errno.errorcode.get(v, str(v)) if isinstance(v, int) else v,
)
def test_the_fs_tiers_namespace_fix_follows_the_errno(code: int, says: str, never: str) -> None:
    fix = _namespace_fix(code, "/mnt/kv")
    assert says in fix
    assert never not in fix
