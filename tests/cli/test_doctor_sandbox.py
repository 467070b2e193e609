"""``shmctl doctor`` true to the capabilities the process really has, in lines that fit a screen.

Each doctor here is a real process with a real effective set: this root with every
capability, and bubblewrap (``bwrap``) sandboxes on the host's ``/proc``: root with
``--cap-drop ALL``, root with the DaemonSet's two (LEASE, DAC_READ_SEARCH), root with
SYS_PTRACE alone, and nobody with none. What they are refused is the kernel's answer: this
test's own process (root, every capability in its permitted set) cannot be read without
CAP_SYS_PTRACE, and a process of nobody's (its ``/proc/PID/fd`` mode 0500) cannot without
CAP_DAC_READ_SEARCH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvoffload.doctor import effective_capabilities
from kvoffload.doctor.checks import CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE
from tests.support.procs import REPO

NOBODY = 65534
SHM = Path("/dev/shm")
#: Two lines of an 80-column terminal.
LINE = 160
LINK = "(docs/doctor.md#processes)"
DAEMONSET = ("CAP_LEASE", "CAP_DAC_READ_SEARCH")


def bwrap() -> str:
    if os.geteuid() != 0:
        pytest.skip("the sandboxes drop capabilities from root and switch to nobody: needs root")
    found = shutil.which("bwrap")
    if found is None or shutil.which("setpriv") is None:
        pytest.skip("needs bubblewrap and setpriv (Debian: bubblewrap, util-linux)")
    probe = subprocess.run(
        [found, "--ro-bind", "/", "/", "--proc", "/proc", "--cap-drop", "ALL", "--", "true"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"bwrap cannot build a sandbox here: {probe.stderr.strip() or probe.returncode}")
    return found


def sandbox(caps: Sequence[str] = (), *, nobody: bool = False) -> list[str]:
    """The argv prefix of a process with exactly ``caps`` effective (as root), or of nobody with none."""
    argv = [bwrap(), "--die-with-parent", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    argv += ["--bind", str(SHM), str(SHM), "--chdir", str(REPO), "--cap-drop", "ALL"]
    if nobody:
        # An interpreter under root's 0700 home (pyenv) is out of nobody's reach: show it alone.
        # (the top directory under /root: bwrap makes the parents of a deeper bind 0700).
        prefix = Path(os.path.realpath(sys.base_prefix))
        if prefix.is_relative_to("/root") and prefix != Path("/root"):
            top = str(Path(*prefix.parts[:3]))
            argv += ["--tmpfs", "/root", "--ro-bind", top, top]
        # setuid from 0 clears the effective and permitted sets: nobody ends with none.
        caps = ("CAP_SETUID", "CAP_SETGID")
    argv += [arg for cap in caps for arg in ("--cap-add", cap)]
    argv += ["--"]
    if nobody:
        argv += ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all"]
    return argv


def doctor(prefix: Sequence[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "shmctl", "doctor", "--root", str(SHM), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "NO_COLOR": "1"},
        timeout=120,
        check=False,
    )


def checks(prefix: Sequence[str], *args: str) -> dict[str, dict[str, Any]]:
    done = doctor(prefix, "--json", *args)
    assert done.returncode in (0, 1), done.stderr
    return {c["name"]: c for c in json.loads(done.stdout)["checks"]}


@pytest.fixture
def nobodys_process() -> Iterator[int]:
    """A process of nobody's: its fd directory is nobody's, mode 0500."""
    child = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sleep", "300"]
    )
    try:
        yield child.pid
    finally:
        child.kill()
        child.wait()


# ----------------------------------------------------------------- capabilities


def test_root_with_both_capabilities_is_never_told_to_add_them() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    caps = effective_capabilities()
    assert caps is not None
    if not (caps >> CAP_SYS_PTRACE & 1 and caps >> CAP_DAC_READ_SEARCH & 1):
        pytest.skip("this root lacks CAP_SYS_PTRACE or CAP_DAC_READ_SEARCH")
    check = checks(())["processes"]
    refused = {r for r in check["data"]["reasons"] if r.startswith(("EACCES", "EPERM"))}
    if not refused:
        assert check["status"] == "ok" or "CAP_" not in (check["fix"] or ""), check
        return
    # Something refuses root with both (an LSM, a process above this user namespace): no
    # capability would help, and the fix says so instead of advising what is held.
    assert check["fix"] == (
        f"CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH are held: vouch with --assume-not-holding PID {LINK}"
    )


def test_root_without_capabilities_is_told_to_add_both() -> None:
    found = checks(sandbox())
    assert found["processes"]["status"] == "warn"
    assert found["processes"]["fix"] == f"add CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH {LINK}"
    assert found["cap-lease"]["status"] == "warn"
    assert found["cap-lease"]["data"]["cap_eff"] == "0000000000000000"
    assert found["cap-lease"]["fix"].startswith("add CAP_LEASE: ")


def test_the_daemonsets_capabilities_are_told_to_add_only_sys_ptrace() -> None:
    found = checks(sandbox(DAEMONSET))
    # This test's own process (root, every capability permitted) is out of reach without it.
    assert found["processes"]["fix"] == f"add CAP_SYS_PTRACE {LINK}"
    assert (found["cap-lease"]["status"], found["cap-lease"]["fix"]) == ("ok", None)


def test_sys_ptrace_alone_is_told_to_add_only_dac_read_search(nobodys_process: int) -> None:
    found = checks(sandbox(["CAP_SYS_PTRACE"]))
    assert found["processes"]["fix"] == f"add CAP_DAC_READ_SEARCH {LINK}"


def test_nobody_is_told_to_run_as_root_or_add_both() -> None:
    found = checks(sandbox(nobody=True))
    assert found["processes"]["fix"] == f"run as root, or add CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH {LINK}"
    assert found["cap-lease"]["fix"].startswith("run as root with CAP_LEASE: ")


# ----------------------------------------------------------------- every line fits a screen


def _region_that_fits() -> str:
    """A --need of 1 GiB (huge pages pay off for it) where /dev/shm has room: no capacity fix."""
    st = os.statvfs(SHM)
    if st.f_bavail * st.f_frsize < 2 << 30:
        pytest.skip("/dev/shm has less than 2 GiB free")
    return "1g"


SANDBOXES: dict[str, Callable[[], list[str]]] = {
    "this-process": lambda: [],
    "root-no-caps": sandbox,
    "daemonset-caps": lambda: sandbox(DAEMONSET),
    "nobody-no-caps": lambda: sandbox(nobody=True),
}


@pytest.mark.parametrize("planned", [False, True], ids=["nothing-planned", "need-1g"])
@pytest.mark.parametrize("where", list(SANDBOXES))
def test_every_line_of_doctor_fits_two_lines_of_a_terminal(where: str, planned: bool) -> None:
    if where == "this-process" and os.geteuid() != 0:
        pytest.skip("needs root (the other cases do)")
    args = ["--need", _region_that_fits()] if planned else []
    done = doctor(SANDBOXES[where](), *args)
    assert done.returncode in (0, 1), done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("8 checks: ")
    too_long = [f"{len(line)}: {line}" for line in lines if len(line) > LINE]
    assert not too_long, "\n".join(too_long)
    if planned:
        assert any(line.lstrip().startswith("huge-pages") for line in lines)


def test_the_space_fix_of_a_region_that_does_not_fit_fits_two_lines() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    st = os.statvfs(SHM)
    done = doctor((), "--need", str(st.f_bavail * st.f_frsize + (1 << 30)))
    assert done.returncode == 1, done.stderr
    [fix] = [line for line in done.stdout.splitlines() if "docs/doctor.md#space" in line]
    assert len(fix) <= LINE, fix
