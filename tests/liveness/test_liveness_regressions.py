"""Reap-safety defects an adversarial run found; each test failed before its fix."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.errors import ConfigError
from kvoffload.liveness.reap import reap
from kvoffload.liveness.scan import Evidence, Status, open_root, scan
from kvoffload.shm.owner import XATTR_NAME
from tests.support.hostile import shmctl
from tests.support.procs import (
    NOBODY,
    REPO,
    Child,
    entry,
    fake_proc,
    leave_orphan,
    region_path,
    vouch_args,
    write_file,
)

MALFORMED_RECORDS = {
    "a pid of 1e400": b'{"pid": 1e400, "start_ticks": 1, "uid": 0, "engine_id": "e", "created_at": 1}',
    "NaN created_at": b'{"pid": 2, "start_ticks": 1, "uid": 0, "engine_id": "e", "created_at": NaN}',
    "Infinity created_at": b'{"pid": 2, "start_ticks": 1, "uid": 0, "created_at": Infinity}',
    "1,500 levels of nesting": b"[" * 1500 + b"]" * 1500,
    "a 4000-digit pid": b'{"pid": ' + b"9" * 4000 + b"}",
    "a boolean uid": b'{"pid": 2, "start_ticks": 1, "uid": true, "engine_id": "e", "created_at": 1}',
    "not UTF-8": b'{"pid": "\xff"}',
}


def strict_json(text: str) -> object:
    def refuse(name: str) -> object:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("record", sorted(MALFORMED_RECORDS))
def test_a_malformed_owner_record_is_ignored_with_the_reason_and_never_blocks_a_reap(
    root: Path, engine_id: str, record: str
) -> None:
    path = leave_orphan(root, engine_id)
    other = leave_orphan(root, engine_id + "-other")
    os.setxattr(path, XATTR_NAME, MALFORMED_RECORDS[record])
    e = entry(scan(root, grace_s=0), path.name)
    assert e.status is Status.ORPHANED
    assert e.owner is None
    assert "owner record ignored: " in e.reason
    result = shmctl("scan", "--root", str(root), "--grace", "0s", "--json")
    assert result.returncode == 1, result.stderr
    assert strict_json(result.stdout)
    assert sorted(x.name for x in reap(root, grace_s=0).removed) == sorted([path.name, other.name])


@pytest.mark.system_wide  # sums every deleted region mapped on the /dev/shm tmpfs, by any process
def test_a_region_mapped_but_deleted_on_another_filesystem_is_not_this_roots(
    root: Path, engine_id: str
) -> None:
    elsewhere = Path(tempfile.gettempdir())
    if os.stat(elsewhere).st_dev == os.stat(root).st_dev:
        pytest.skip("the temporary directory is on the shm root's filesystem here")
    other_fs = elsewhere / f"vllm_offload_{engine_id}-elsewhere.mmap"
    here = region_path(root, engine_id)
    with Child("vllm", other_fs) as far, Child("vllm", here) as near:
        other_fs.unlink()
        here.unlink()
        report = scan(root, grace_s=0)
        result = shmctl("metrics", "--root", str(root))
    pids = {d.pid for d in report.deleted}
    assert near.pid in pids
    assert far.pid not in pids
    mapped = next(
        line for line in result.stdout.splitlines() if line.startswith("shmctl_unlinked_mapped_bytes{")
    )
    assert float(mapped.rsplit(" ", 1)[1]) == 1 << 20, mapped


@pytest.mark.parametrize("command", ["scan", "reap", "metrics"])
def test_an_empty_root_is_a_usage_error_not_the_current_directory(tmp_path: Path, command: str) -> None:
    orphan = write_file(tmp_path / "vllm_offload_cwd.mmap")
    extra = ("--yes", "--grace", "0s") if command == "reap" else ()
    # (An empty SHMCTL_ROOT counts as unset, as click reads every environment variable: /dev/shm.)
    for args, env in ((("--root", ""), None), (("--root", " "), None)):
        result = subprocess.run(
            [sys.executable, "-m", "shmctl", command, *args, *extra],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        )
        assert result.returncode == 2, (args, env, result.stdout, result.stderr)
        assert result.stderr.startswith("shmctl: error: Invalid value for '--root'"), result.stderr
        assert "is empty (it would mean the current directory)" in result.stderr
        assert result.stderr.count("\n") == 1
        assert orphan.exists()
    with pytest.raises(ConfigError, match="--root"), open_root(""):
        pass


def test_a_future_mtime_does_not_keep_a_file_starting_forever(root: Path, engine_id: str) -> None:
    path = leave_orphan(root, engine_id)
    future = time.time() + 10 * 365 * 86400
    os.utime(path, (future, future))  # `touch -d 2036`: ctime stays what the kernel set
    e = entry(scan(root, grace_s=30, now=time.time() + 60), path.name)
    assert (e.status, e.reason) == (Status.ORPHANED, NOBODY)


@pytest.mark.system_wide  # an audit of the /dev/shm tmpfs: another test's regions would be leaks
def test_the_reap_command_audit_prints_works_as_printed(root: Path, engine_id: str) -> None:
    path = region_path(root, engine_id)
    make = "import os,sys; fd=os.open(sys.argv[1], os.O_CREAT|os.O_RDWR, 0o600); os.ftruncate(fd, 4096)"
    result = shmctl("audit", "--root", str(root), "--", sys.executable, "-c", make, str(path))
    assert result.returncode == 1, result.stderr
    printed = next(line for line in result.stderr.splitlines() if "remove orphans with: " in line)
    command = printed.split("remove orphans with: ", 1)[1]
    assert shlex.split(command)[:2] == ["shmctl", "reap"]
    bin_dir = Path(sys.executable).parent
    ran = subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
    )
    assert ran.returncode == 0, ran.stderr
    assert not path.exists()


def test_metrics_counts_an_orphan_without_vouching_and_takes_scans_options(
    root: Path, engine_id: str
) -> None:
    path = leave_orphan(root, engine_id)
    resident = os.stat(path).st_blocks * 512
    plain = shmctl("metrics", "--root", str(root), "--grace", "0s")
    unleased = shmctl("metrics", "--root", str(root), "--grace", "0s", "--no-lease", *vouch_args())
    everyone = shmctl("metrics", "--root", str(root), "--grace", "0s", "--all-users")
    for result in (plain, unleased, everyone):
        assert result.returncode == 0, result.stderr

    def orphan_bytes(text: str) -> int:
        line = next(x for x in text.splitlines() if x.startswith("shmctl_orphan_bytes{"))
        return int(float(line.rsplit(" ", 1)[1]))

    assert orphan_bytes(plain.stdout) == resident
    assert orphan_bytes(everyone.stdout) == resident
    assert orphan_bytes(unleased.stdout) == resident  # without a lease, only with every blind spot vouched


@contextlib.contextmanager
def leases_disabled() -> Iterator[None]:
    """``fs.leases-enable = 0``: the kernel refuses every lease, as some filesystems do."""
    knob = Path("/proc/sys/fs/leases-enable")
    if os.geteuid() != 0 or not knob.exists():
        pytest.skip("needs root and /proc/sys/fs/leases-enable")
    before = knob.read_text()
    knob.write_text("0")
    try:
        yield
    finally:
        knob.write_text(before)


@pytest.mark.root
@pytest.mark.system_wide  # fs.leases-enable = 0 refuses every other test's leases too
def test_where_the_kernel_refuses_leases_the_verdict_falls_back_with_the_reason(
    root: Path, engine_id: str, tmp_path: Path
) -> None:
    path = leave_orphan(root, engine_id)
    with leases_disabled():
        blind = entry(scan(root, grace_s=0, proc_root=fake_proc(tmp_path, maps_readable=False)), path.name)
    assert (blind.status, blind.lease) == (Status.UNKNOWN, None)
    assert blind.lease_error == "the filesystem refuses leases (or fs.leases-enable is 0)"
    assert "no write lease (the filesystem refuses leases" in blind.reason
    shutil.rmtree(tmp_path / "proc")
    with leases_disabled():
        seen = entry(scan(root, grace_s=0, proc_root=fake_proc(tmp_path, maps_readable=True)), path.name)
    assert (seen.status, seen.decided_by) == (Status.ORPHANED, Evidence.PROC)
    assert seen.reason.startswith("no process maps or opens it (every process inspected; no write lease: ")
