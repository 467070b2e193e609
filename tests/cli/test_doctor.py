"""``shmctl doctor``: one verdict per check, with exact figures and the fix, on the real node.

The verdicts are checked on this machine (a default tmpfs /dev/shm, leases on, root with
CAP_LEASE), on tmpfs mounts of the test's own (a size, huge=, read-only), on the disk
filesystem of ``tmp_path``, and, for what a node cannot be made to be without rebooting it
(leases off, no CAP_LEASE, a process that cannot be read), on a fake ``/proc`` tree.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload import doctor
from kvoffload.bringup.plan import check_capacity
from kvoffload.doctor import CheckStatus, LeaseFacts, PlannedRegion, RootFacts
from kvoffload.errors import ConfigError
from kvoffload.liveness.holders import collect_holders
from kvoffload.shm import mounts
from tests.support.hostile import shmctl
from tests.support.mounts import mounted_tmpfs
from tests.support.procs import REPO, fake_proc
from tests.support.schemas import validate
from tests.support.terminal import on_a_terminal

CHECKS = ["root", "space", "huge-pages", "leases", "cap-lease", "processes", "populate-write", "textfile"]
LEASES_ON = LeaseFacts(True, 45.0)
LEASES_OFF = LeaseFacts(False, 45.0)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs of the test's own: no other process changes its figures (root only)."""
    with mounted_tmpfs(tmp_path / "shm", "size=16m") as point:
        yield point


def sysctls(proc: Path, *, leases_enable: str = "1", break_time: str = "45") -> Path:
    (proc / "sys" / "fs").mkdir(parents=True, exist_ok=True)
    (proc / "sys" / "fs" / "leases-enable").write_text(leases_enable + "\n")
    (proc / "sys" / "fs" / "lease-break-time").write_text(break_time + "\n")
    return proc


def self_status(proc: Path, cap_eff: int) -> Path:
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "self" / "status").write_text(f"Name:\tshmctl\nCapEff:\t{cap_eff:016x}\n")
    return proc


def facts(*, free_bytes: int) -> RootFacts:
    """Root facts of a tmpfs with ``free_bytes`` free on a node with 8 GiB available."""
    return RootFacts(
        path=Path("/dev/shm"),
        mount_point=Path("/dev/shm"),
        fs_type="tmpfs",
        read_only=False,
        size_bytes=1 << 30,
        used_bytes=0,
        free_bytes=free_bytes,
        mem_total_bytes=16 << 30,
        mem_available_bytes=8 << 30,
        shmem_bytes=0,
    )


# ----------------------------------------------------------------- the real node


def test_the_report_has_every_check_in_order_and_counts_them(root: Path) -> None:
    report = doctor.diagnose(root)
    assert [c.name for c in report.checks] == CHECKS
    counts = {s: sum(c.status is s for c in report.checks) for s in CheckStatus}
    assert (report.summary.ok, report.summary.warn, report.summary.fail, report.summary.skip) == tuple(
        counts.values()
    )
    assert report.failed == (counts[CheckStatus.FAIL] > 0)
    assert all(c.fix is None for c in report.checks if c.status is CheckStatus.OK)


def test_a_tmpfs_root_is_in_memory_with_its_exact_size_use_and_free_bytes(small_tmpfs: Path) -> None:
    (small_tmpfs / "ballast").write_bytes(b"x" * (1 << 20))
    check = doctor.diagnose(small_tmpfs).check("root")
    vfs = os.statvfs(small_tmpfs)
    assert check.status is CheckStatus.OK, check.finding
    data = check.data
    assert isinstance(data, RootFacts)
    assert (data.fs_type, data.mount_point, data.read_only) == ("tmpfs", small_tmpfs, False)
    assert (data.size_bytes, data.used_bytes) == (16 << 20, 1 << 20)
    assert data.free_bytes == vfs.f_bavail * vfs.f_frsize == 15 << 20
    # A person's sizes in the finding; the exact bytes are the data's (--json).
    assert f"{small_tmpfs}: tmpfs, 16.0 MiB, 1.0 MiB used, 15.0 MiB free; node: MemTotal " in check.finding
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    assert data.mem_total_bytes == int(meminfo["MemTotal"].split()[0]) * 1024


def test_a_root_on_a_disk_filesystem_fails_with_the_fix(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if mounts.memory_filesystem(fd) is not None:
            pytest.skip("tmp_path is on a memory filesystem here")
    finally:
        os.close(fd)
    report = doctor.diagnose(tmp_path)
    root = report.check("root")
    assert root.status is CheckStatus.FAIL
    assert "not tmpfs or hugetlbfs" in root.finding
    assert root.fix is not None
    assert f"mount -t tmpfs -o size=BYTES,huge=within_size tmpfs {tmp_path}" in root.fix
    assert report.check("huge-pages").status is CheckStatus.SKIP
    assert report.failed


def test_a_read_only_root_fails(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as point:
        check = doctor.diagnose(point).check("root")
    assert check.status is CheckStatus.FAIL
    assert "read-only" in check.finding
    assert check.fix == f"mount -o remount,rw {point}"


def test_a_missing_root_raises_the_root_error_scan_raises(tmp_path: Path) -> None:
    from kvoffload.errors import RootError

    with pytest.raises(RootError, match="does not exist"):
        doctor.diagnose(tmp_path / "nowhere")


# ----------------------------------------------------------------- space


def test_no_plan_skips_the_space_check(root: Path) -> None:
    check = doctor.diagnose(root).check("space")
    assert (check.status, check.fix) == (CheckStatus.SKIP, None)


def test_planned_regions_that_do_not_fit_fail_with_the_plans_own_fix(small_tmpfs: Path) -> None:
    planned = [doctor.planned_bytes("12m"), doctor.planned_bytes("8m")]
    check = doctor.diagnose(small_tmpfs, planned=planned).check("space")
    assert check.status is CheckStatus.FAIL
    assert check.finding == (
        f"2 planned region(s) need 20.0 MiB; {small_tmpfs} has 16.0 MiB free: 4194304 bytes short, "
        "it does not fit"
    )
    assert check.fix is not None
    assert check.fix == check_capacity(small_tmpfs, 20 << 20, 0).fix
    assert f"mount -o remount,size=20M {small_tmpfs}" in check.fix


def test_planned_regions_that_fit_are_ok(small_tmpfs: Path) -> None:
    check = doctor.diagnose(small_tmpfs, planned=[doctor.planned_bytes("16m")]).check("space")
    assert check.status is CheckStatus.OK, check.finding


def test_a_region_that_fits_the_mount_but_not_the_available_memory_warns() -> None:
    check = doctor.check_space(facts(free_bytes=64 << 30), [PlannedRegion("--need", None, 9 << 30, 0)])
    assert check.status is CheckStatus.WARN
    assert "MemAvailable is 8.0 GiB" in check.finding


def test_a_plan_is_sized_as_init_dry_run_sizes_it(root: Path, tmp_path: Path) -> None:
    config = tmp_path / "engine.json"
    extra = {"cpu_bytes_to_use": 8 << 20}
    config.write_text(json.dumps({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}))
    geometry = ["--kv-bytes-per-block", "65536", "--world-size", "2"]
    plan = json.loads(
        shmctl("init", "--root", str(root), "--dry-run", "--json", "--config", str(config), *geometry).stdout
    )
    done = shmctl("doctor", "--root", str(root), "--json", "--plan", str(config), *geometry)
    space = next(c for c in json.loads(done.stdout)["checks"] if c["name"] == "space")
    assert space["status"] == "ok"
    [region] = space["data"]["regions"]
    assert region["source"] == str(config)
    assert (region["bytes"], region["chunk_bytes"]) == (
        plan["sizing"]["total_bytes"],
        plan["sizing"]["kv_bytes_per_chunk"],
    )


@pytest.mark.parametrize(
    ("text", "size"), [("512", 512), ("64k", 64 << 10), ("40g", 40 << 30), ("1T", 1 << 40)]
)
def test_need_takes_bytes_as_tmpfs_size_does(text: str, size: int) -> None:
    assert doctor.planned_bytes(text) == PlannedRegion("--need", None, size, 0)


@pytest.mark.parametrize("text", ["1.5g", "0", "-1", "lots", ""])
def test_need_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ConfigError, match="--need"):
        doctor.planned_bytes(text)


# ----------------------------------------------------------------- huge pages


def default_tmpfs(root: Path) -> mounts.MountInfo:
    info = mounts.root_mount(root)
    if info is None or info.huge_pages != "never":
        pytest.skip("this host's /dev/shm has huge pages")
    return info


def test_a_default_tmpfs_is_not_a_huge_page_warning_when_no_region_is_planned(root: Path) -> None:
    default_tmpfs(root)
    check = doctor.diagnose(root).check("huge-pages")
    assert (check.status, check.fix) == (CheckStatus.SKIP, None)
    assert "4 KiB pages; --plan or --need says whether a region needs huge pages" in check.finding
    assert isinstance(check.data, mounts.HugePages)
    assert check.data.fix is None


def test_a_small_planned_region_on_4_kib_pages_is_ok(root: Path) -> None:
    default_tmpfs(root)
    check = doctor.diagnose(root, planned=[doctor.planned_bytes("512m")]).check("huge-pages")
    assert (check.status, check.fix) == (CheckStatus.OK, None)
    assert "enough for a region of 512.0 MiB (huge pages pay off from 1.0 GiB)" in check.finding


def test_the_huge_page_fix_for_a_large_region_is_init_dry_runs_word_for_word(root: Path) -> None:
    info = default_tmpfs(root)
    done = shmctl("doctor", "--root", str(root), "--json", "--need", "2g")
    [check] = [c for c in json.loads(done.stdout)["checks"] if c["name"] == "huge-pages"]
    assert check["status"] == "warn"
    assert check["fix"] == mounts.huge_pages_advice(info)
    assert check["fix"].endswith("(docs/doctor.md#huge-pages)")
    plan = dry_run(root, cpu_bytes=2 << 30)
    assert plan.returncode == 0, plan.stderr
    assert f"fix: {check['fix']}\n" in plan.stdout


def test_init_dry_run_gives_no_huge_page_fix_for_a_small_region(root: Path) -> None:
    default_tmpfs(root)
    plan = dry_run(root, cpu_bytes=8 << 20)
    assert plan.returncode == 0, plan.stderr
    assert ": off: 4 KiB pages" in plan.stdout  # the fact stays; the advice does not apply
    assert "huge=within_size" not in plan.stdout


def test_a_tmpfs_with_huge_pages_is_ok(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "huge", "size=16m,huge=within_size") as point:
        if mounts.read_shmem_enabled() == "deny":
            pytest.skip("shmem_enabled=deny turns huge pages off on this host")
        check = doctor.diagnose(point).check("huge-pages")
    assert (check.status, check.fix) == (CheckStatus.OK, None)
    assert "huge=within_size" in check.finding


# ----------------------------------------------------------------- leases and capabilities


def test_the_lease_sysctls_of_this_node_are_read(root: Path) -> None:
    enabled = Path("/proc/sys/fs/leases-enable").read_text().strip() != "0"
    seconds = float(Path("/proc/sys/fs/lease-break-time").read_text())
    check = doctor.diagnose(root).check("leases")
    assert check.data == LeaseFacts(enabled, seconds)
    assert check.status is (CheckStatus.OK if enabled and seconds else CheckStatus.WARN)


def test_leases_disabled_warn_with_the_sysctl_to_set(tmp_path: Path) -> None:
    proc = sysctls(tmp_path / "proc", leases_enable="0")
    check = doctor.check_leases(doctor.lease_facts(proc))
    assert check.status is CheckStatus.WARN
    assert check.data == LeaseFacts(False, 45.0)
    assert "fs.leases-enable = 0" in check.finding
    assert check.fix is not None
    assert "sysctl -w fs.leases-enable=1" in check.fix


def test_a_lease_break_time_of_0_warns_that_a_break_never_times_out(tmp_path: Path) -> None:
    check = doctor.check_leases(doctor.lease_facts(sysctls(tmp_path / "proc", break_time="0")))
    assert check.status is CheckStatus.WARN
    assert "never times out" in check.finding
    assert check.fix is not None
    assert "fs.lease-break-time=5" in check.fix


def test_unreadable_lease_sysctls_warn(tmp_path: Path) -> None:
    check = doctor.check_leases(doctor.lease_facts(tmp_path))
    assert (check.status, check.data) == (CheckStatus.WARN, LeaseFacts(None, None))


def test_cap_lease_in_the_effective_set_is_ok_and_missing_warns(tmp_path: Path) -> None:
    with_it = doctor.check_cap_lease(LEASES_ON, proc_root=self_status(tmp_path / "a", 1 << doctor.CAP_LEASE))
    without = doctor.check_cap_lease(LEASES_ON, proc_root=self_status(tmp_path / "b", 0x1FF))
    assert with_it.status is CheckStatus.OK
    assert without.status is CheckStatus.WARN
    assert "CapEff 00000000000001ff" in without.finding
    assert without.fix is not None
    assert "--cap-add LEASE" in without.fix


def test_cap_lease_is_skipped_when_no_lease_is_taken(tmp_path: Path) -> None:
    check = doctor.check_cap_lease(LEASES_OFF, proc_root=self_status(tmp_path, 0))
    assert check.status is CheckStatus.SKIP


def test_root_here_has_cap_lease(root: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    check = doctor.diagnose(root).check("cap-lease")
    assert check.status is CheckStatus.OK, check.finding


# ----------------------------------------------------------------- processes


def test_a_process_that_cannot_be_read_warns_while_leases_prove_files_free(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, maps_readable=False)
    check = doctor.check_processes(LEASES_ON, proc_root=proc)
    assert check.status is CheckStatus.WARN
    assert check.data == doctor.ProcessFacts(
        0, 1, {"EISDIR on maps": 1}, ("pid 4242 (blind: EISDIR on maps)",), "pid:[4026531836]", True
    )
    assert check.finding == (
        "1 of 1 processes unreadable (1 EISDIR on maps; pid 4242 first); the lease still proves files free, "
        "but not who holds them"
    )


def test_a_process_that_cannot_be_read_fails_when_leases_are_off(tmp_path: Path) -> None:
    check = doctor.check_processes(LEASES_OFF, proc_root=fake_proc(tmp_path, maps_readable=False))
    assert check.status is CheckStatus.FAIL
    assert "leases are off: what they hold stays unknown, never reaped" in check.finding
    assert check.fix is not None
    assert check.fix.startswith("sysctl -w fs.leases-enable=1; ")
    assert check.fix.endswith("(docs/doctor.md#processes)")


def test_every_process_readable_is_ok(tmp_path: Path) -> None:
    check = doctor.check_processes(LEASES_OFF, proc_root=fake_proc(tmp_path, maps_readable=True))
    assert (check.status, check.fix) == (CheckStatus.OK, None)
    assert "all 1 processes are readable" in check.finding


def test_the_processes_this_node_hides_are_counted_as_scan_counts_them(root: Path) -> None:
    check = doctor.diagnose(root).check("processes")
    data = check.data
    assert isinstance(data, doctor.ProcessFacts)
    blind = collect_holders(inodes=(), deleted=False, locks=False).uninspected
    stable = {u.describe() for u in blind if u.pid == 1}  # init: neither exits nor changes here
    assert stable <= set(data.first)
    assert check.status is (CheckStatus.OK if data.uninspected == 0 and data.complete else CheckStatus.WARN)


# ----------------------------------------------------------------- kernel


def test_this_kernel_pre_faults_with_madv_populate_write() -> None:
    major, minor = (int(part) for part in os.uname().release.split(".")[:2])
    if (major, minor) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE arrived in Linux 5.14")
    check = doctor.check_populate_write()
    assert check.status is CheckStatus.OK
    assert check.data == doctor.PopulateFacts(os.uname().release, True, None)


# ----------------------------------------------------------------- textfile


def test_a_missing_default_textfile_directory_is_skipped(tmp_path: Path) -> None:
    check = doctor.check_textfile(None, default=tmp_path / "node-exporter")
    assert (check.status, check.fix) == (CheckStatus.SKIP, None)


def test_a_missing_textfile_directory_that_was_asked_for_fails(tmp_path: Path) -> None:
    check = doctor.check_textfile(tmp_path / "node-exporter")
    assert check.status is CheckStatus.FAIL
    assert check.fix is not None
    assert check.fix.startswith(f"mkdir -p {tmp_path / 'node-exporter'}")


def test_a_textfile_directory_that_is_a_file_fails(tmp_path: Path) -> None:
    (tmp_path / "node-exporter").write_text("")
    for asked in (tmp_path / "node-exporter", None):
        check = doctor.check_textfile(asked, default=tmp_path / "node-exporter")
        assert (check.status, check.finding) == (
            CheckStatus.FAIL,
            f"{tmp_path / 'node-exporter'} is not a directory",
        )


def test_a_writable_textfile_directory_is_ok_and_left_as_found(tmp_path: Path) -> None:
    check = doctor.check_textfile(tmp_path)
    assert check.status is CheckStatus.OK
    assert "no shmctl.prom yet" in check.finding
    assert os.listdir(tmp_path) == []
    (tmp_path / "shmctl.prom").write_text("")
    again = doctor.check_textfile(tmp_path)
    assert isinstance(again.data, doctor.TextfileFacts)
    assert again.data.prom_age_s is not None
    assert "shmctl.prom written" in again.finding
    assert os.listdir(tmp_path) == ["shmctl.prom"]


def test_a_read_only_textfile_directory_fails(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as point:
        check = doctor.check_textfile(point)
    assert check.status is CheckStatus.FAIL
    assert isinstance(check.data, doctor.TextfileFacts)
    assert (check.data.writable, check.data.error) == (False, "EROFS: Read-only file system")


# ----------------------------------------------------------------- the CLI


def test_the_table_has_a_row_per_check_then_a_summary_and_exits_0_without_a_failure(root: Path) -> None:
    done = shmctl("doctor", "--root", str(root), env={"NO_COLOR": "1"})
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["CHECK", "STATUS", "FINDING"]
    rows = [line.split()[:2] for line in lines[1:-1] if not line.startswith(" ")]
    assert [name for name, _ in rows] == CHECKS
    failed = any(status == "fail" for _, status in rows)
    assert done.returncode == (1 if failed else 0)
    assert lines[-1].startswith("8 checks: ")
    assert done.stderr == ""


def test_a_fix_sits_under_the_finding_it_answers(tmp_path: Path) -> None:
    done = shmctl(
        "doctor", "--root", str(tmp_path), "--textfile", str(tmp_path / "none"), env={"NO_COLOR": "1"}
    )
    assert done.returncode == 1  # the root (a disk filesystem) and the textfile fail
    lines = done.stdout.splitlines()
    column = lines[0].index("FINDING")
    for row, following in itertools.pairwise(lines):
        _name, status = row.split()[:2]
        if status in ("fail", "warn") and following.lstrip().startswith("fix: "):
            assert following.index("fix: ") == column, following
    assert f"                  fix: mkdir -p {tmp_path / 'none'}" in done.stdout


def test_a_terminal_gets_the_same_rows_as_a_pipe(root: Path) -> None:
    seen = on_a_terminal("doctor", "--root", str(root), env={"NO_COLOR": "1"})
    piped = shmctl("doctor", "--root", str(root), env={"NO_COLOR": "1"})

    def shape(text: str) -> list[list[str]]:
        # The figures move between two runs (MemAvailable, process counts); rows and columns do not.
        return [line.split()[:2] for line in text.splitlines()[:-1]]

    assert seen.code == piped.returncode
    assert shape(seen.plain) == shape(piped.stdout)


def test_the_json_validates_and_its_exit_status_is_its_failures(root: Path) -> None:
    done = shmctl("doctor", "--root", str(root), "--json", "--need", "1k")
    document = json.loads(done.stdout)
    validate(document, "doctor")
    assert [c["name"] for c in document["checks"]] == CHECKS
    assert done.returncode == (1 if document["summary"]["fail"] else 0)
    assert done.stderr == ""


def test_a_failing_node_exits_1_and_its_json_validates(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    done = shmctl("doctor", "--root", str(tmp_path), "--json", "--textfile", str(tmp_path / "file"))
    document = json.loads(done.stdout)
    validate(document, "doctor")
    textfile = document["checks"][-1]
    assert (textfile["status"], textfile["data"]["error"]) == ("fail", "ENOTDIR")
    assert done.returncode == 1


@pytest.mark.parametrize(
    ("root_arg", "code", "message"),
    [
        (
            "/nonexistent/kvtest-root",
            3,
            "shmctl: error: --root /nonexistent/kvtest-root: does not exist (fix: ",
        ),
        (sys.executable, 3, f"shmctl: error: --root {sys.executable}: is not a directory (fix: "),
        ("", 2, "shmctl: error: Invalid value for '--root'"),
    ],
    ids=["missing", "a-file", "empty"],
)
def test_a_bad_root_is_one_line_with_the_exit_status_of_every_command(
    root_arg: str, code: int, message: str
) -> None:
    done = shmctl("doctor", "--root", root_arg)
    assert (done.returncode, done.stdout) == (code, "")
    assert done.stderr.startswith(message)
    assert done.stderr.count("\n") == 1


def test_a_bad_need_is_a_usage_error(root: Path) -> None:
    done = shmctl("doctor", "--root", str(root), "--need", "lots")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "shmctl: error: --need: 'lots' is not a size in bytes "
        "(fix: bytes, or a number with k, m, g or t (powers of 1024): --need 40g)\n"
    )


def test_a_plan_that_cannot_be_read_names_the_plan_option(root: Path, tmp_path: Path) -> None:
    done = shmctl(
        "doctor", "--root", str(root), "--plan", str(tmp_path / "none.json"), "--model", "llama-3-8b"
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(f"shmctl: error: --plan: {tmp_path / 'none.json'} does not exist (fix: ")


def test_loading_the_cli_imports_no_part_of_doctor() -> None:
    # `shmctl --help` and every Tab press import each command module's top level.
    code = (
        "import sys, shmctl.app; "
        "print(sorted(m for m in sys.modules if m.startswith(('kvoffload.doctor', 'psutil'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout == "[]\n"


def dry_run(root: Path, *, cpu_bytes: int) -> subprocess.CompletedProcess[str]:
    """``init --dry-run`` of a CPU region of ``cpu_bytes`` in ``root``."""
    extra = {"cpu_bytes_to_use": cpu_bytes}
    config = json.dumps({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra})
    return shmctl(
        "init",
        "--root",
        str(root),
        "--dry-run",
        "--kv-bytes-per-block",
        "65536",
        "--kv-transfer-config",
        config,
    )
