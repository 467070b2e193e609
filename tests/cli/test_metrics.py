"""shmctl metrics: the scan as Prometheus series, on stdout or as a node_exporter textfile.

Every expectation is parsed back with prometheus-client's own parser and compared exactly,
series by series, against the scan, the filesystem (``os.statvfs``, ``st_blocks``) or the
clock the test controls. Roots are private directories (``tmp_path`` or a private tmpfs),
so a test's files never meet another test's; engine ids carry ``TEST_TAG``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from importlib.metadata import version
from pathlib import Path
from typing import NamedTuple

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.liveness import lease
from kvoffload.liveness.reap import reap
from kvoffload.liveness.report import ScanReport
from kvoffload.liveness.scan import Status, scan
from shmctl.render import printable
from shmctl.render.fixes import unwritable_fix
from shmctl.render.metrics import OTHER_ENGINES, Exposition, ReapCounters
from tests.support.hostile import small_tmpfs
from tests.support.procs import REPO, Child, leave_orphan, region_path, write_file
from tests.support.terminal import on_a_terminal
from tests.watch.test_watch import Agent

Series = tuple[str, frozenset[tuple[str, str]]]
PAGE = 4096
TIMES = ("shmctl_last_run_timestamp_seconds", "shmctl_last_success_timestamp_seconds")


def shmctl(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        [sys.executable, "-m", "shmctl", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
        **kwargs,
    )


def shmctl_raw(*args: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr as strict UTF-8, every byte kept (no newline translation:
    a CR in a label stays a CR)."""
    done = subprocess.run(
        [sys.executable, "-m", "shmctl", *args], capture_output=True, timeout=60, check=False, cwd=REPO
    )
    return done.returncode, done.stdout.decode("utf-8", "strict"), done.stderr.decode("utf-8", "strict")


def series(name: str, **labels: str) -> Series:
    return (name, frozenset(labels.items()))


def parse(text: str) -> dict[Series, float]:
    """Every sample of an exposition, by name and label set; a repeated series fails."""
    found: dict[Series, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = series(sample.name, **sample.labels)
            assert key not in found, f"series exported twice: {key}"
            found[key] = sample.value
    return found


def resident(paths: Iterable[Path]) -> int:
    return sum(os.stat(p, follow_symlinks=False).st_blocks * 512 for p in paths)


def expected_scan(report: ScanReport, *, size: int, free: int, top: int = 10) -> dict[Series, float]:
    """The series one scanned root must have (its timestamps and duration left to the caller)."""
    root = str(report.root)
    expected: dict[Series, float] = {
        series("shmctl_build_info", version=version("shmctl")): 1,
        series("shmctl_scan_success", root=root): 1,
        series("shmctl_orphan_bytes", root=root): resident(
            e.path for e in report.entries if e.status is Status.ORPHANED
        ),
        series("shmctl_unlinked_mapped_bytes", root=root): sum(d.mapped_bytes for d in report.deleted),
        series("shmctl_uninspected_processes", root=root): len(report.uninspected),
        series("shmctl_root_size_bytes", root=root): size,
        series("shmctl_root_free_bytes", root=root): free,
    }
    for status in Status:
        mine = [e for e in report.entries if e.status is status]
        # A region is an engine's files under one verdict: a row of scan's table.
        expected[series("shmctl_regions", root=root, status=status.value)] = len({e.engine_id for e in mine})
        expected[series("shmctl_region_files", root=root, status=status.value)] = len(mine)
        regular = [e.path for e in mine if e.kind == "file"]
        expected[series("shmctl_region_resident_bytes", root=root, status=status.value)] = resident(regular)
    per_engine: dict[str, int] = {}
    for e in report.entries:
        if e.status is Status.ORPHANED:
            per_engine[e.engine_id] = per_engine.get(e.engine_id, 0) + resident([e.path])
    other = per_engine.pop(OTHER_ENGINES, 0)
    largest = sorted(per_engine, key=lambda engine: (-per_engine[engine], engine))
    for engine in largest[:top]:
        expected[series("shmctl_orphan_engine_bytes", root=root, engine_id=engine)] = per_engine[engine]
    other += sum(per_engine[engine] for engine in largest[top:])
    expected[series("shmctl_orphan_engine_bytes", root=root, engine_id=OTHER_ENGINES)] = other
    return expected


class Usage(NamedTuple):
    """Size and unprivileged free bytes, from statvfs itself (what shutil.disk_usage reads)."""

    total: int
    free: int

    @classmethod
    def of(cls, root: Path) -> Usage:
        st = os.statvfs(root)
        return cls(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


def test_every_value_is_exactly_the_scans_and_the_clocks(tmp_path: Path, engine_id: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    for pages in (1, 3):
        write_file(region_path(root, f"{engine_id}-{pages}"), touch=pages)
    write_file(region_path(root, f"{engine_id}-3", 1), touch=2)  # a segment counts for its engine
    (root / f"vllm_offload_{engine_id}-link.mmap").symlink_to(tmp_path)
    # 1796107918.1234567: the :g formatting wrote 1.79611e+09, 58 minutes off.
    now = float(int(time.time()) + 2) + 0.1234567
    assert len(repr(now).replace(".", "")) > 7
    with Child("vllm", region_path(root, f"{engine_id}-live")):
        report = scan(root, grace_s=0, now=now)
    usage = Usage.of(root)
    exposition = Exposition()
    exposition.add_scan(report, usage, scan_seconds=0.012345678901234)
    text = exposition.text().decode()

    assert {e.status for e in report.entries} == {Status.LIVE, Status.ORPHANED, Status.SKIPPED}
    assert len(report.with_status(Status.ORPHANED)) == 3  # two regions: the segment is its base's
    expected = expected_scan(report, size=usage.total, free=usage.free)
    expected |= {series(name, root=str(root)): now for name in TIMES}
    expected[series("shmctl_scan_duration_seconds", root=str(root))] = 0.012345678901234
    assert parse(text) == expected
    assert f'shmctl_last_run_timestamp_seconds{{root="{root}"}} {now:g}\n' not in text


@pytest.mark.root
def test_the_command_exports_the_scan_of_a_private_tmpfs_exactly(tmp_path: Path, engine_id: str) -> None:
    with small_tmpfs(tmp_path, "8m") as mnt, Child("vllm", region_path(mnt, f"{engine_id}-live")):
        leave_orphan(mnt, f"{engine_id}-dead")
        before = time.time()
        result = shmctl("metrics", "--root", str(mnt), "--grace", "0s")
        after = time.time()
        report = scan(mnt, grace_s=0)
        usage = Usage.of(mnt)
        expected = expected_scan(report, size=usage.total, free=usage.free)
        expected[series("shmctl_lease_break_time_seconds")] = lease.break_time_s() or 0.0

    assert (result.returncode, result.stderr) == (0, "")
    got = parse(result.stdout)
    ran = {got.pop(series(name, root=str(mnt))) for name in TIMES}
    assert len(ran) == 1
    assert before <= ran.pop() <= after
    assert 0 < got.pop(series("shmctl_scan_duration_seconds", root=str(mnt))) < after - before
    assert got == expected
    assert report.summary.live == report.summary.orphaned == 1


#: What an engine id may hold that the exposition must carry exactly: every escape the text
#: format has (backslash, quote, newline) and what a terminal acts on (tab, ESC, CR, C1 CSI,
#: a bidi override). The root is hostile too, but without glob characters (``watch --root``).
EXACT_ID = 'tab\tesc\x1b[31m back\\slash "quote" new\nline cr\r c1\u009b2J bidi\u202e'
EXACT_ROOT = "root\ttab\x1besc\u202e"


def plant_exact_names(parent: Path, engine_id: str) -> Path:
    """A root named ``EXACT_ROOT`` in ``parent`` holding two orphans: one named with
    ``EXACT_ID``, one whose name has a byte that is not UTF-8."""
    root = parent / EXACT_ROOT
    root.mkdir()
    write_file(region_path(root, f"{engine_id}-{EXACT_ID}"))
    undecodable = os.fsencode(root) + b"/vllm_offload_" + os.fsencode(engine_id) + b"-\xff.mmap"
    os.close(os.open(undecodable, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    return root


def labels_of(text: str, name: str, label: str) -> set[str]:
    return {
        sample.labels[label]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def scan_json(root: Path) -> tuple[set[str], str]:
    """The engine ids and the root as ``scan --json`` reports them (after ``json.loads``),
    as labels: a lone surrogate (an undecodable byte) as the text of its JSON escape."""
    code, out, err = shmctl_raw("scan", "--root", str(root), "--grace", "0s", "--json")
    assert code == 1, err  # orphans are findings
    document = json.loads(out)

    def as_label(text: str) -> str:
        return "".join(f"\\u{ord(c):04x}" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)

    return {as_label(e["engine_id"]) for e in document["entries"]}, as_label(document["root"])


@pytest.mark.root
def test_labels_are_the_ids_scan_json_reports_exactly_in_a_pipe_and_in_the_textfile(
    tmp_path: Path, engine_id: str
) -> None:
    with small_tmpfs(tmp_path, "8m") as mnt:
        root = plant_exact_names(mnt, engine_id)
        piped = shmctl_raw("metrics", "--root", str(root), "--grace", "0s")
        textfile = tmp_path / "textfile"
        textfile.mkdir()
        written = shmctl_raw("metrics", "--root", str(root), "--grace", "0s", "--textfile", str(textfile))
        engines, root_label = scan_json(root)
        for path in root.iterdir():
            path.unlink()

    assert (piped[0], piped[2], written[0], written[2]) == (0, "", 0, "")
    assert f"{engine_id}-{EXACT_ID}" in engines
    assert f"{engine_id}-\\udcff" in engines, "an undecodable byte: the text of scan --json's escape"
    exposition = (textfile / "shmctl.prom").read_bytes().decode("utf-8", "strict")
    for text in (piped[1], exposition):
        assert labels_of(text, "shmctl_orphan_engine_bytes", "engine_id") == engines | {OTHER_ENGINES}
        assert labels_of(text, "shmctl_scan_success", "root") == {root_label}
        # Raw, as the format carries them: only backslash, quote and newline are escaped.
        assert 'tab\tesc\x1b[31m back\\\\slash \\"quote\\" new\\nline cr\r c1\u009b2J' in text


def test_on_a_terminal_the_labels_show_their_control_characters_escaped(
    tmp_path: Path, engine_id: str
) -> None:
    root = plant_exact_names(tmp_path, engine_id)
    code, piped, _ = shmctl_raw("metrics", "--root", str(root), "--grace", "0s")
    shown = on_a_terminal("metrics", "--root", str(root), "--grace", "0s", columns=300)

    assert (code, shown.code) == (0, 0), shown.text
    on_terminal = shown.raw.decode("utf-8", "strict").replace("\r\n", "\n")
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e]", on_terminal), on_terminal
    # The same lines as in a pipe (the numbers of these series are the files'), escaped.
    engine_lines = [line for line in piped.split("\n") if line.startswith("shmctl_orphan_engine_")]
    assert len(engine_lines) == 3
    for line in engine_lines:
        assert printable(line, escape_backslash=False) in on_terminal.split("\n")
    assert "tab\\tesc\\x1b[31m" in on_terminal


def test_the_agents_metrics_carry_the_labels_exactly_over_http(tmp_path: Path, engine_id: str) -> None:
    root = plant_exact_names(tmp_path, engine_id)
    engines, root_label = scan_json(root)
    agent = Agent("--root", str(root), "--interval", "0.2s", "--grace", "0s", "--listen", "127.0.0.1:0")
    try:
        agent.wait_for(lambda events: any(e["event"] == "pass" for e in events))
        url = f"http://127.0.0.1:{agent.port()}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            text = answer.read().decode("utf-8", "strict")
        accept = {"Accept": "application/openmetrics-text; version=1.0.0"}
        with urllib.request.urlopen(urllib.request.Request(url, headers=accept), timeout=10) as answer:
            openmetrics = answer.read().decode("utf-8", "strict")
    finally:
        agent.kill()

    assert labels_of(text, "shmctl_orphan_engine_bytes", "engine_id") == engines | {OTHER_ENGINES}
    assert labels_of(text, "shmctl_scan_success", "root") == {root_label}
    engine_samples = {
        sample.labels["engine_id"]
        for family in openmetrics_families(openmetrics)  # type: ignore[no-untyped-call]
        for sample in family.samples
        if sample.name == "shmctl_orphan_engine_bytes"
    }
    assert engine_samples == engines | {OTHER_ENGINES}


@pytest.mark.parametrize("top", [0, 2, 10])
def test_top_engines_exports_the_largest_and_sums_the_rest_as_other(
    tmp_path: Path, engine_id: str, top: int
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    sizes = {f"{engine_id}-{pages}": pages for pages in (1, 2, 3, 4)}
    for engine, pages in sizes.items():
        write_file(region_path(root, engine), touch=pages)
    # A real engine named "other" (the largest) must not be a second series of that label.
    # The name carries no TEST_TAG: it lives only in this test's private directory.
    write_file(region_path(root, OTHER_ENGINES), touch=5)

    result = shmctl("metrics", "--root", str(root), "--grace", "0s", "--top-engines", str(top))

    assert (result.returncode, result.stderr) == (0, "")
    got = {
        dict(labels)["engine_id"]: value
        for (name, labels), value in parse(result.stdout).items()
        if name == "shmctl_orphan_engine_bytes"
    }
    largest = sorted(sizes, key=lambda engine: -sizes[engine])
    named = {engine: resident([region_path(root, engine)]) for engine in largest[:top]}
    rest = resident(region_path(root, engine) for engine in [*largest[top:], OTHER_ENGINES])
    assert got == {**named, OTHER_ENGINES: rest}
    assert sum(got.values()) == parse(result.stdout)[series("shmctl_orphan_bytes", root=str(root))]


@pytest.mark.parametrize(
    ("where", "problem"), [("missing", "does not exist"), ("file", "is not a directory")]
)
def test_a_root_that_cannot_be_read_exports_scan_success_0_and_exits_3(
    tmp_path: Path, where: str, problem: str
) -> None:
    root = tmp_path / "root"
    if where == "file":
        root.write_text("")
    before = time.time()
    result = shmctl("metrics", "--root", str(root))
    after = time.time()

    assert result.returncode == 3
    assert result.stderr.startswith(f"shmctl: error: --root {root}: {problem} (fix: ")
    assert result.stderr.count("\n") == 1
    got = parse(result.stdout)
    ran = got.pop(series("shmctl_last_run_timestamp_seconds", root=str(root)))
    assert before <= ran <= after
    assert got == {
        series("shmctl_build_info", version=version("shmctl")): 1,
        series("shmctl_scan_success", root=str(root)): 0,
        series("shmctl_scan_error_info", root=str(root), error=problem): 1,
        series("shmctl_lease_break_time_seconds"): lease.break_time_s(),
    }


def test_a_failed_run_replaces_the_textfile_and_carries_the_last_success_over(
    tmp_path: Path, engine_id: str
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    out_dir = tmp_path / "textfile"
    out_dir.mkdir()
    good = shmctl("metrics", "--root", str(root), "--textfile", str(out_dir))
    assert (good.returncode, good.stdout, good.stderr) == (0, "", "")
    first = parse((out_dir / "shmctl.prom").read_text())
    succeeded = first[series("shmctl_last_success_timestamp_seconds", root=str(root))]
    root.rmdir()

    failed = shmctl("metrics", "--root", str(root), "--textfile", str(out_dir))

    assert (failed.returncode, failed.stdout) == (3, "")
    assert failed.stderr.startswith(f"shmctl: error: --root {root}: does not exist")
    assert os.listdir(out_dir) == ["shmctl.prom"]
    now = parse((out_dir / "shmctl.prom").read_text())
    assert now[series("shmctl_scan_success", root=str(root))] == 0
    assert now[series("shmctl_last_success_timestamp_seconds", root=str(root))] == succeeded
    assert now[series("shmctl_last_run_timestamp_seconds", root=str(root))] > succeeded
    assert not [name for name, _ in now if name in {"shmctl_regions", "shmctl_orphan_bytes"}]


def test_the_textfile_is_replaced_atomically_by_a_file_written_beside_it(tmp_path: Path, root: Path) -> None:
    # The target is on /dev/shm and TMPDIR elsewhere: a temporary file made in TMPDIR could
    # not be renamed into place (EXDEV).
    if os.stat(tmp_path).st_dev == os.stat(root).st_dev:
        pytest.skip("the temporary directory is on /dev/shm's filesystem here")
    scanned = tmp_path / "scanned"
    scanned.mkdir()
    target = root / "shmctl.prom"
    target.write_text("# the previous run's file\n")
    with open(target) as old:
        result = shmctl(
            "metrics",
            "--root",
            str(scanned),
            "--textfile",
            str(root),
            env={**os.environ, "TMPDIR": str(tmp_path)},
            umask=0o077,
        )
        assert old.read() == "# the previous run's file\n"  # a reader keeps a whole file
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert os.listdir(root) == ["shmctl.prom"]
    assert os.stat(target).st_mode & 0o777 == 0o644  # node_exporter may read it, whatever the umask
    assert parse(target.read_text())[series("shmctl_scan_success", root=str(scanned))] == 1


@pytest.mark.parametrize("where", ["missing", "file"])
def test_metrics_textfile_must_be_a_directory(tmp_path: Path, where: str) -> None:
    target = tmp_path / "out"
    if where == "file":
        target.write_text("")
    result = shmctl("metrics", "--root", str(tmp_path), "--textfile", str(target))
    assert (result.returncode, result.stdout) == (3, "")
    assert result.stderr == (
        f"shmctl: error: {target}: is not a directory (fix: create the textfile collector directory first)\n"
    )
    assert target.is_file() if where == "file" else not target.exists()


def test_regions_are_the_rows_of_scans_table_and_files_are_counted_apart(
    tmp_path: Path, engine_id: str
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    for segment in (0, 1, 2):  # one region: a base file and two segments
        write_file(region_path(root, f"{engine_id}-a", segment))
    write_file(region_path(root, f"{engine_id}-b"))

    metrics = shmctl("metrics", "--root", str(root), "--grace", "0s")
    table = shmctl("scan", "--root", str(root), "--grace", "0s", "--no-headers")

    assert (metrics.returncode, metrics.stderr) == (0, "")
    got = parse(metrics.stdout)
    regions = {s: got[series("shmctl_regions", root=str(root), status=s.value)] for s in Status}
    files = {s: got[series("shmctl_region_files", root=str(root), status=s.value)] for s in Status}
    rows = table.stdout.splitlines()
    assert [row.split()[:3] for row in rows] == [
        ["orphaned", f"{engine_id}-a", "3"],
        ["orphaned", f"{engine_id}-b", "1"],
    ]
    assert regions == {**dict.fromkeys(Status, 0), Status.ORPHANED: len(rows)}
    assert files == {**dict.fromkeys(Status, 0), Status.ORPHANED: 4}


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (errno.ENOSPC, "free space on the filesystem that holds"),
        (errno.EDQUOT, "quota"),
        (errno.EROFS, "read-only mount: remount it read-write"),
        (errno.EACCES, "give this user write access to"),
        (errno.EPERM, "another user's file in a sticky directory"),
        (errno.ENOENT, "was removed while shmctl ran"),
        (errno.ENOTDIR, "is not a directory"),
        (errno.EISDIR, "is a directory: remove it"),
        (errno.ELOOP, "loop of symbolic links"),
        (errno.EMFILE, "ulimit -n"),
        (errno.ENFILE, "fs.file-max"),
        (errno.EFBIG, "ulimit -f"),
        (errno.EIO, "dmesg"),
        (errno.ENXIO, "start its reader first"),
        (errno.EPIPE, "keep it reading"),
        (errno.EINVAL, None),  # no fix of its own: only the way around it
    ],
    ids=lambda v: errno.errorcode.get(v, "") if isinstance(v, int) else "",
)
def test_each_errno_gets_its_own_fix_and_only_enospc_says_free_space(
    tmp_path: Path, code: int, says: str | None
) -> None:
    error = OSError(code, os.strerror(code), str(tmp_path / "shmctl.prom"))
    fix = unwritable_fix(error, tmp_path, instead="pass another --textfile")
    if says is None:
        assert fix == "pass another --textfile"
    else:
        assert says in fix
    assert ("free space" in fix) == (code in (errno.ENOSPC, errno.EDQUOT))


def test_no_two_errnos_share_a_fix(tmp_path: Path) -> None:
    codes = [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EIO]
    fixes = {unwritable_fix(OSError(c, os.strerror(c)), tmp_path, instead="x") for c in codes}
    assert len(fixes) == len(codes)


@pytest.mark.parametrize(
    ("directory", "errno_text", "kind"),
    [("/proc", os.strerror(errno.ENOENT), "proc"), ("/sys", os.strerror(errno.EACCES), "sysfs")],
)
def test_a_textfile_directory_on_a_pseudo_filesystem_is_named_as_one(
    tmp_path: Path, directory: str, errno_text: str, kind: str
) -> None:
    result = shmctl("metrics", "--root", str(tmp_path), "--textfile", directory)
    assert (result.returncode, result.stdout) == (3, "")
    assert result.stderr == (
        f"shmctl: error: {directory}: cannot write shmctl.prom: {errno_text} (fix: {directory} is on "
        f"{kind}, a pseudo-filesystem that takes no files: pass another --textfile on a real one)\n"
    )


@pytest.mark.parametrize("args", [("--help",), ("metrics", "--help")])
def test_help_does_not_import_prometheus_client(args: tuple[str, ...]) -> None:
    result = _importtime(*args)
    assert result.returncode == 0, result.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()}
    assert "shmctl.launch" in imported  # the import log is there (help needs no typer: shmctl.answers)
    assert not {m for m in imported if m.split(".")[0] == "prometheus_client"}


def _importtime(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "shmctl", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )


def test_reap_counters_count_what_reap_removed_across_passes(root: Path, engine_id: str) -> None:
    files = [
        write_file(region_path(root, engine_id), touch=2),
        write_file(region_path(root, engine_id, 1), touch=1),
        write_file(region_path(root, f"{engine_id}-b"), touch=3),
    ]
    pinned = resident(files)
    counters = ReapCounters()

    counters.record(reap(root, grace_s=0, dry_run=True))
    at_start = counted(counters)
    counters.record(reap(root, grace_s=0))
    after_reap = counted(counters)
    counters.record(reap(root, grace_s=0))  # nothing left: the counters stay

    assert at_start == {
        "shmctl_reaped_files_total": 0,
        "shmctl_reaped_bytes_total": 0,
        "shmctl_reap_conflicts_total": 0,
    }
    assert after_reap == {
        "shmctl_reaped_files_total": 3,
        "shmctl_reaped_bytes_total": pinned,
        "shmctl_reap_conflicts_total": 0,
    }
    assert counted(counters) == after_reap
    assert not any(p.exists() for p in files)


def counted(counters: ReapCounters) -> dict[str, float]:
    exposition = Exposition()
    exposition.add_reaps(counters)
    got = parse(exposition.text().decode())
    return {name: value for (name, _), value in got.items() if name.startswith("shmctl_reap")}


def test_the_one_shot_command_exports_no_reap_counters(tmp_path: Path) -> None:
    result = shmctl("metrics", "--root", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert not [name for name, _ in parse(result.stdout) if name.startswith("shmctl_reap")]


def test_several_roots_share_one_exposition(tmp_path: Path, engine_id: str) -> None:
    roots = [tmp_path / "a", tmp_path / "b"]
    for i, root in enumerate(roots):
        root.mkdir()
        write_file(region_path(root, f"{engine_id}-{i}"), touch=i + 1)
    now = time.time() + 1
    exposition = Exposition()
    reports = [scan(root, grace_s=0, now=now) for root in roots]
    for report in reports:
        exposition.add_scan(report, Usage.of(report.root), scan_seconds=0.5)

    got = parse(exposition.text().decode())

    for report in reports:
        label = str(report.root)
        assert got[series("shmctl_orphan_bytes", root=label)] == resident(e.path for e in report.entries)
        assert got[series("shmctl_scan_success", root=label)] == 1
    assert len([name for name, _ in got if name == "shmctl_build_info"]) == 1


def test_lease_break_time_is_the_nodes_sysctl_exactly() -> None:
    seconds = lease.break_time_s()
    assert seconds == float(Path("/proc/sys/fs/lease-break-time").read_text())
    exposition = Exposition()
    exposition.add_lease_break_time(seconds)

    got = parse(exposition.text().decode())

    assert got[series("shmctl_lease_break_time_seconds")] == seconds


def test_lease_break_time_is_absent_when_it_cannot_be_read(tmp_path: Path) -> None:
    exposition = Exposition()
    exposition.add_lease_break_time(lease.break_time_s(proc_root=tmp_path))

    text = exposition.text().decode()

    assert "shmctl_lease_break_time_seconds" not in text
