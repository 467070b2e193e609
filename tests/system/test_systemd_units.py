"""The systemd units pass systemd's own checks and keep what the verdicts need.

``systemd-analyze verify`` must accept them where shmctl is installed on systemd's search path
(as shipped) and anywhere else once ``scripts/install-units.sh`` has written the path in;
``systemd-analyze security --offline=yes`` must rate each service below 4.0. What systemd would
do to the process is checked for real where it can be without running systemd: the timers'
capability bounding set, run through ``setpriv``, still leases, names holders and opens other
users' files, and each capability in it is needed; the watch agent's ExecStart, run with its own
(the DaemonSet's two), reaps another user's orphan and keeps their live region, and fails to
reap without either; the reaper's ExecStart, run as journald would (stdout a pipe), prints one
line of JSON. The tools are used where present and the tests skip, saying which, where they are
not.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import REPO, Child, leave_orphan, region_path, write_file

UNITS = REPO / "deploy" / "systemd"
SERVICES = sorted(UNITS.glob("*.service"))
#: The node agent, a long-running service; the others are the oneshots the timers start.
WATCH = UNITS / "shmctl-watch.service"
METRICS = UNITS / "shmctl-metrics.service"
ONESHOTS = [unit for unit in SERVICES if unit != WATCH]
#: The services that remove files: only they need --all-users (to remove other users' orphans).
REMOVERS = [UNITS / "shmctl-reap.service", WATCH]
DAEMONSET = REPO / "deploy" / "kubernetes" / "daemonset.yaml"
INSTALL_UNITS = REPO / "scripts" / "install-units.sh"
SHMCTL = Path(sys.executable).parent / "shmctl"
#: systemd's fixed search path for a bare ExecStart name; tests mount a private copy over one.
SEARCH_DIR = "/usr/local/sbin"
NOBODY_UID = 65534
MAX_EXPOSURE = 4.0


def directives(unit: Path, key: str) -> list[str]:
    """Every value of ``key`` in the unit, in order (comments and sections ignored)."""
    values = []
    for line in unit.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.lstrip().startswith(("#", ";")) and name.strip() == key:
            values.append(value.strip())
    return values


def exec_start(unit: Path) -> list[str]:
    (command,) = directives(unit, "ExecStart")
    return shlex.split(command)


def require_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    return tool


def require_root(*tools: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool}(1)")


def render(dest: Path, shmctl: Path = SHMCTL) -> list[Path]:
    done = subprocess.run(
        ["sh", str(INSTALL_UNITS), "--shmctl", str(shmctl), "--dest", str(dest)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return sorted(dest.iterdir())


def verify(*units: Path, man_dir: Path, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    # MANPATH: verify looks up Documentation=man:shmctl(1), which is this checkout's page.
    return subprocess.run(
        [*prefix, require_analyze(), "verify", *map(str, units)],
        env={**os.environ, "MANPATH": str(man_dir)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def man_dir(tmp_path: Path) -> Path:
    (tmp_path / "man" / "man1").mkdir(parents=True)
    shutil.copy(REPO / "man" / "shmctl.1", tmp_path / "man" / "man1" / "shmctl.1")
    return tmp_path / "man"


# ------------------------------------------------------------------ what the files say


@pytest.mark.parametrize("unit", SERVICES, ids=lambda p: p.name)
def test_execstart_names_shmctl_for_systemd_to_resolve_not_a_hard_coded_path(unit: Path) -> None:
    assert exec_start(unit)[0] == "shmctl"


@pytest.mark.parametrize("unit", SERVICES, ids=lambda p: p.name)
def test_every_service_runs_as_root_which_judges_every_users_files(unit: Path) -> None:
    assert directives(unit, "User") in ([], ["root"])


@pytest.mark.parametrize("unit", REMOVERS, ids=lambda p: p.name)
def test_a_service_that_removes_passes_all_users_to_remove_other_users_orphans(unit: Path) -> None:
    assert "--all-users" in exec_start(unit)


def test_the_metrics_service_passes_no_all_users_as_root_counts_every_users_files() -> None:
    assert "--all-users" not in exec_start(METRICS)


@pytest.mark.parametrize("unit", SERVICES, ids=lambda p: p.name)
def test_read_write_paths_are_optional(unit: Path) -> None:
    paths = [p for value in directives(unit, "ReadWritePaths") for p in value.split()]
    assert paths
    assert all(p.startswith("-") for p in paths), paths


@pytest.mark.parametrize("unit", SERVICES, ids=lambda p: p.name)
def test_no_service_hides_proc_from_itself(unit: Path) -> None:
    # The verdicts read other processes' /proc/PID and /proc/sys/kernel/random/boot_id.
    assert directives(unit, "ProtectProc") in ([], ["default"])
    assert directives(unit, "ProcSubset") in ([], ["all"])
    assert directives(unit, "PrivateUsers") in ([], ["no"])


# ------------------------------------------------------------------ systemd-analyze


def test_verify_accepts_the_units_as_shipped_where_shmctl_is_on_systemds_search_path(man_dir: Path) -> None:
    require_analyze()
    require_root("unshare")
    # A private mount namespace where SEARCH_DIR holds a link to this venv's shmctl: what a
    # system-wide `pip install .` gives, without touching the host's directories.
    script = f'mount --bind "$1" {SEARCH_DIR} && shift && exec "$@"'
    bindir = man_dir.parent / "bin"
    bindir.mkdir()
    (bindir / "shmctl").symlink_to(SHMCTL)
    units = sorted(UNITS.iterdir())
    prefix = ("unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(bindir))
    done = verify(*units, man_dir=man_dir, prefix=prefix)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr


def test_verify_accepts_the_units_install_units_renders_for_shmctl_anywhere(
    tmp_path: Path, man_dir: Path
) -> None:
    units = render(tmp_path / "units")
    assert [u.name for u in units] == sorted(u.name for u in UNITS.iterdir())
    for unit in units:
        if unit.suffix == ".service":
            assert exec_start(unit)[0] == str(SHMCTL)
    done = verify(*units, man_dir=man_dir)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr


def test_verify_fails_a_unit_whose_shmctl_is_gone(tmp_path: Path, man_dir: Path) -> None:
    # The check above can fail: verify does look at ExecStart's binary.
    gone = tmp_path / "bin" / "shmctl"
    gone.parent.mkdir()
    shutil.copy(SHMCTL, gone)
    units = render(tmp_path / "units", gone)
    gone.unlink()
    done = verify(*units, man_dir=man_dir)
    assert done.returncode != 0
    assert f"Command {gone} is not executable" in done.stderr


@pytest.mark.parametrize("unit", SERVICES, ids=lambda p: p.name)
def test_the_security_exposure_of_each_service_is_below_4(unit: Path) -> None:
    done = subprocess.run(
        [require_analyze(), "security", "--offline=yes", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    found = re.search(rf"Overall exposure level for {re.escape(unit.name)}: (\d+\.\d+)", done.stdout)
    assert found, done.stdout + done.stderr
    assert float(found.group(1)) < MAX_EXPOSURE, done.stdout


# ------------------------------------------------------------------ the capability set


def bounding_set(unit: Path) -> list[str]:
    """The unit's CapabilityBoundingSet as setpriv names them (``lease``, ``sys_ptrace``)."""
    (value,) = directives(unit, "CapabilityBoundingSet")
    return [cap.removeprefix("CAP_").lower() for cap in value.split()]


def test_the_timers_services_keep_the_same_capabilities() -> None:
    assert len({tuple(bounding_set(unit)) for unit in ONESHOTS}) == 1


def test_the_watch_unit_keeps_the_daemonsets_capabilities_and_no_other() -> None:
    # The same agent as the DaemonSet, with the same evidence: not CAP_SYS_PTRACE, which only
    # names other users' holders, for a long-running process with an open port.
    (daemonset,) = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d and d["kind"] == "DaemonSet"]
    (agent,) = daemonset["spec"]["template"]["spec"]["containers"]
    added = agent["securityContext"]["capabilities"]["add"]
    assert sorted(bounding_set(WATCH)) == sorted(cap.lower() for cap in added)


@contextmanager
def another_users_files(root: Path, engine_id: str) -> Iterator[tuple[Path, Path, Child]]:
    """In a sticky root like /dev/shm: nobody's 0600 file mapped by nobody's process, and an orphan."""
    root.chmod(0o1777)
    held = write_file(region_path(root, engine_id + "-held"))
    orphan = write_file(region_path(root, engine_id + "-dead"))
    for path in (held, orphan):
        os.chown(path, NOBODY_UID, NOBODY_UID)
        path.chmod(0o600)
    as_nobody = ("setpriv", f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups")
    with Child("map-only", held, prefix=as_nobody) as holder:
        yield held, orphan, holder


def scan_with(caps: list[str], root: Path) -> dict[str, Any]:
    done = subprocess.run(
        [
            "setpriv",
            f"--bounding-set=-all,{','.join('+' + c for c in caps)}",
            *(sys.executable, "-m", "shmctl", "scan", "--root", str(root), "--grace", "0s"),
            *("--all-users", "--json"),
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def evidence(report: dict[str, Any], held: Path, orphan: Path, holder: Child) -> dict[str, bool]:
    entries = {e["name"]: e for e in report["entries"]}
    return {
        "orphan proven dead by the lease": entries[orphan.name]["status"] == "orphaned"
        and entries[orphan.name]["decided_by"] == "lease",
        "holder named": holder.pid in [h["pid"] for h in entries[held.name]["holders"]],
        "holder inspected": holder.pid not in [u["pid"] for u in report["uninspected"]],
    }


def test_with_the_units_capabilities_root_leases_names_and_inspects_other_users(
    root: Path, engine_id: str
) -> None:
    require_root("setpriv")
    with another_users_files(root, engine_id) as (held, orphan, holder):
        report = scan_with(bounding_set(ONESHOTS[0]), root)
        assert all(evidence(report, held, orphan, holder).values()), report


@pytest.mark.parametrize("dropped", bounding_set(ONESHOTS[0]))
def test_each_capability_the_units_keep_is_needed(root: Path, engine_id: str, dropped: str) -> None:
    require_root("setpriv")
    caps = [c for c in bounding_set(ONESHOTS[0]) if c != dropped]
    with another_users_files(root, engine_id) as (held, orphan, holder):
        report = scan_with(caps, root)
        assert not all(evidence(report, held, orphan, holder).values()), report


# ------------------------------------------------------------------ running ExecStart


def run_exec_start(unit: Path, root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The unit's command line with this venv's shmctl, on ``root``, stdout a pipe as under journald."""
    argv = [str(SHMCTL), *exec_start(unit)[1:], *extra]
    umask = int((directives(unit, "UMask") or ["0022"])[0], 8)
    return subprocess.run(
        argv,
        env={**os.environ, "SHMCTL_ROOT": str(root)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        umask=umask,
    )


def test_the_reapers_json_is_one_line_so_journald_records_one_event(root: Path, engine_id: str) -> None:
    dead = leave_orphan(root, engine_id)
    # A later --grace wins over the unit's 10m, so the orphan just made is reaped.
    done = run_exec_start(UNITS / "shmctl-reap.service", root, "--grace", "0s")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    report = json.loads(lines[0])
    assert [e["name"] for e in report["removed"]] == [dead.name]
    assert not dead.exists()


def test_the_metrics_textfile_is_the_directory_debians_node_exporter_reads() -> None:
    # prometheus-node-exporter (Debian, Ubuntu): --collector.textfile.directory's default.
    argv = exec_start(METRICS)
    assert argv[argv.index("--textfile") + 1] == "/var/lib/prometheus/node-exporter"


def test_the_metrics_textfile_stays_readable_by_node_exporter(root: Path, tmp_path: Path) -> None:
    unit = METRICS
    argv = exec_start(unit)
    textfile = argv[argv.index("--textfile") + 1]
    assert f"-{textfile}" in directives(unit, "ReadWritePaths")
    done = run_exec_start(unit, root, "--textfile", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "shmctl.prom").stat().st_mode & 0o004


def test_the_metrics_unit_counts_another_users_orphan_and_live_region_without_all_users(
    root: Path, engine_id: str, tmp_path: Path
) -> None:
    require_root("setpriv")
    with another_users_files(root, engine_id) as (_, orphan, _):
        # A later --grace wins over the default 30s, so the orphan just made is orphaned.
        done = run_exec_start(METRICS, root, "--textfile", str(tmp_path), "--grace", "0s")
        resident = orphan.stat().st_blocks * 512
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "shmctl.prom").read_text()
    values = {
        (sample.name, sample.labels.get("status")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert values[("shmctl_orphan_bytes", None)] == resident
    assert values[("shmctl_regions", "orphaned")] == 1
    assert values[("shmctl_regions", "live")] == 1
    assert values[("shmctl_regions", "skipped")] == 0


# ------------------------------------------------------------------ the watch agent


def test_the_watch_unit_runs_the_agent_on_the_hosts_dev_shm_and_restarts_it_on_failure() -> None:
    argv = exec_start(WATCH)
    assert argv[1] == "watch"
    assert [argv[i + 1] for i, word in enumerate(argv) if word == "--root"] == ["/dev/shm"]
    assert "--reap" in argv
    assert "-/dev/shm" in directives(WATCH, "ReadWritePaths")
    assert directives(WATCH, "Type") == ["exec"]
    assert directives(WATCH, "Restart") == ["on-failure"]
    assert directives(WATCH, "WantedBy") == ["multi-user.target"]


def test_the_watch_unit_listens_on_loopback_and_its_firewall_admits_loopback_alone() -> None:
    argv = exec_start(WATCH)
    host, _, port = argv[argv.index("--listen") + 1].rpartition(":")
    assert ipaddress.ip_address(host.strip("[]")).is_loopback
    assert int(port) > 0
    assert directives(WATCH, "IPAddressDeny") == ["any"]
    assert directives(WATCH, "IPAddressAllow") == ["localhost"]
    # A private network namespace has a loopback of its own that nothing on the host can reach.
    assert directives(WATCH, "PrivateNetwork") in ([], ["no"])
    families = {f for value in directives(WATCH, "RestrictAddressFamilies") for f in value.split()}
    assert families == {"AF_UNIX", "AF_INET", "AF_INET6"}


def run_watch_exec_start(caps: list[str], root: Path) -> subprocess.CompletedProcess[str]:
    """The watch unit's command line with this venv's shmctl and its root pointed at ``root``,
    under the bounding set ``caps`` and the unit's umask, stdout a pipe as under journald: two
    passes (removal needs two), no grace, any free loopback port."""
    argv = [str(SHMCTL), *exec_start(WATCH)[1:]]
    argv[argv.index("--root") + 1] = str(root)
    argv += ["--interval", "100ms", "--max-passes", "2", "--grace", "0s", "--listen", "127.0.0.1:0"]
    return subprocess.run(
        ["setpriv", f"--bounding-set=-all,{','.join('+' + c for c in caps)}", *argv],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        umask=int(directives(WATCH, "UMask")[0], 8),
    )


def test_with_the_watch_units_capabilities_it_reaps_another_users_orphan_and_keeps_their_live_region(
    root: Path, engine_id: str
) -> None:
    require_root("setpriv")
    with another_users_files(root, engine_id) as (held, orphan, _):
        done = run_watch_exec_start(bounding_set(WATCH), root)
        assert done.returncode == 0, done.stderr
        assert not orphan.exists()
        assert held.exists()
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["engine_id"] for e in events if e["event"] == "removed"] == [engine_id + "-dead"]


@pytest.mark.parametrize("dropped", bounding_set(WATCH))
def test_each_capability_the_watch_unit_keeps_is_needed_to_reap_another_users_orphan(
    root: Path, engine_id: str, dropped: str
) -> None:
    require_root("setpriv")
    caps = [c for c in bounding_set(WATCH) if c != dropped]
    with another_users_files(root, engine_id) as (held, orphan, _):
        done = run_watch_exec_start(caps, root)
        assert done.returncode == 0, done.stderr
        assert orphan.exists(), f"reaped without {dropped}"
        assert held.exists()
