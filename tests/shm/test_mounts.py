"""kvoffload.shm.mounts: which mount holds a path, its huge= policy, and the advice when it is off.

The parsers read mount tables written here (the kernel's formats, escapes included); the
lookups run against this process's real /proc/self/mountinfo, and, as root, against a tmpfs
the test mounts itself.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.shm import mounts
from kvoffload.shm.mounts import MountInfo
from tests.support.mounts import mounted_tmpfs
from tests.support.procs import REPO

GIB = 1 << 30

MOUNTINFO = b"""\
22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
25 22 0:23 / /dev/shm rw,nosuid,nodev shared:2 - tmpfs tmpfs rw,size=24683584k,inode64
30 25 0:27 / /dev/shm rw,relatime - tmpfs shm rw,size=65536k,huge=within_size
41 22 0:40 / /mnt/kv\\040shm rw,relatime shared:7 master:3 - tmpfs tmpfs rw,size=2097152k,huge=advise
42 22 0:41 / /mnt/kv rw,relatime - tmpfs tmpfs rw,huge=always
43 22 0:42 / /mnt/back\\134slash rw - tmpfs tmpfs rw
garbage line without a separator
"""


def table() -> list[MountInfo]:
    return mounts.parse_mountinfo(MOUNTINFO)


def by_point(point: str) -> MountInfo:
    found = mounts.mount_of(point, table())
    assert found is not None
    return found


# ----------------------------------------------------------------- parsing


def test_mountinfo_lines_become_mounts_and_malformed_lines_are_skipped() -> None:
    assert [str(m.mount_point) for m in table()] == [
        "/",
        "/dev/shm",
        "/dev/shm",
        "/mnt/kv shm",
        "/mnt/kv",
        "/mnt/back\\slash",
    ]


def test_a_tmpfs_reports_its_size_and_huge_policy_with_never_as_the_default() -> None:
    top = by_point("/dev/shm")
    assert (top.fs_type, top.source, top.huge, top.size_bytes) == ("tmpfs", "shm", "within_size", 64 << 20)
    assert by_point("/mnt/back\\slash").huge == "never"
    assert by_point("/mnt/back\\slash").size_bytes is None  # no size=: unlimited


def test_other_filesystems_have_no_huge_policy() -> None:
    root = by_point("/")
    assert (root.fs_type, root.huge, root.size_bytes, root.is_tmpfs) == ("ext4", None, None, False)
    assert root.huge_pages == "never"


def test_octal_escapes_in_mount_points_are_decoded() -> None:
    assert by_point("/mnt/kv shm/region").huge == "advise"
    assert by_point("/mnt/back\\slash/x").mount_point == Path("/mnt/back\\slash")


def test_the_proc_mounts_format_is_read_too() -> None:
    text = b"tmpfs /dev/shm tmpfs rw,nosuid,size=65536k,huge=always 0 0\nshort line\n"
    [shm] = mounts.parse_mounts(text)
    assert (shm.mount_point, shm.huge, shm.size_bytes) == (Path("/dev/shm"), "always", 64 << 20)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("24683584k", 24683584 << 10), ("2g", 2 * GIB), ("4096", 4096), ("1M", 1 << 20), ("lots", None)],
)
def test_tmpfs_sizes_are_read_in_the_kernels_units(text: str, expected: int | None) -> None:
    assert mounts.parse_size(text) == expected


# ----------------------------------------------------------------- which mount holds a path


def test_the_longest_mount_point_that_is_a_prefix_holds_the_path() -> None:
    assert by_point("/mnt/kv/x/y").huge == "always"
    assert by_point("/mnt/kvx").mount_point == Path("/")  # a name that merely starts the same
    assert by_point("/etc").mount_point == Path("/")


def test_of_mounts_stacked_on_one_point_the_last_listed_is_the_one_on_top() -> None:
    assert by_point("/dev/shm/vllm_offload_x.mmap").source == "shm"


def test_the_real_root_mount_of_this_process_is_found(tmp_path: Path) -> None:
    info = mounts.root_mount(tmp_path)
    assert info is not None
    assert str(tmp_path).startswith(str(info.mount_point))
    assert info.shmem_enabled == mounts.read_shmem_enabled()


def test_without_any_mount_table_there_is_no_answer(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    assert mounts.root_mount("/dev/shm", mountinfo=missing, mounts=missing) is None


@pytest.mark.parametrize(
    "path", ["/", "/etc", "/dev/shm", "/dev/shm/x.mmap", "/mnt/kv shm/region", "/mnt/kv/x", "/mnt/kvx"]
)
def test_the_root_mount_is_the_one_the_whole_table_gives(tmp_path: Path, path: str) -> None:
    # root_mount parses only the lines whose point holds the path; the answer is the same.
    table_file = tmp_path / "mountinfo"
    table_file.write_bytes(MOUNTINFO)
    info = mounts.root_mount(path, mountinfo=table_file)
    whole = mounts.mount_of(path, table())
    assert info is not None
    assert whole is not None
    assert (info.mount_point, info.source, info.options) == (whole.mount_point, whole.source, whole.options)


def test_the_proc_mounts_table_is_the_fallback_when_mountinfo_is_missing(tmp_path: Path) -> None:
    table_file = tmp_path / "mounts"
    table_file.write_bytes(b"tmpfs /dev/shm tmpfs rw,huge=advise 0 0\n")
    info = mounts.root_mount("/dev/shm", mountinfo=tmp_path / "missing", mounts=table_file)
    assert info is not None
    assert info.huge == "advise"


# ----------------------------------------------------------------- the system setting


def sysfs(tmp_path: Path, text: str) -> Path:
    (tmp_path / "shmem_enabled").write_text(text)
    return tmp_path


@pytest.mark.parametrize("choice", ["always", "within_size", "advise", "never", "deny", "force"])
def test_shmem_enabled_is_the_bracketed_choice(tmp_path: Path, choice: str) -> None:
    words = ["always", "within_size", "advise", "never", "deny", "force"]
    text = " ".join(f"[{w}]" if w == choice else w for w in words) + "\n"
    assert mounts.read_shmem_enabled(sysfs(tmp_path, text)) == choice


def test_a_kernel_without_transparent_huge_pages_has_no_shmem_setting(tmp_path: Path) -> None:
    assert mounts.read_shmem_enabled(tmp_path) is None


@pytest.mark.parametrize(
    ("huge", "system", "effective"),
    [
        ("never", "never", "never"),
        ("within_size", "never", "within_size"),
        ("within_size", "deny", "never"),
        ("never", "force", "always"),
        ("advise", None, "advise"),
    ],
)
def test_deny_and_force_override_the_mounts_own_policy(huge: str, system: str | None, effective: str) -> None:
    info = MountInfo(Path("/dev/shm"), "tmpfs", "tmpfs", (), huge, None, system)
    assert info.huge_pages == effective


def test_the_huge_page_size_comes_from_sysfs_with_2_mib_as_the_fallback(tmp_path: Path) -> None:
    assert mounts.huge_page_size(tmp_path) == 2 << 20
    (tmp_path / "hpage_pmd_size").write_text("536870912\n")
    assert mounts.huge_page_size(tmp_path) == 512 << 20


# ----------------------------------------------------------------- advice


def shm(huge: str = "never", system: str | None = "never", point: str = "/dev/shm") -> MountInfo:
    return MountInfo(Path(point), "tmpfs", "tmpfs", (), huge, 8 * GIB, system)


def test_a_dev_shm_without_huge_pages_gets_the_remount_with_the_factor_and_the_docs_link() -> None:
    advice = mounts.huge_pages_advice(shm(), factor=12.5)
    assert advice == (
        "on the host: mount -o remount,huge=within_size /dev/shm: pre-faulting is about 12.5x faster "
        "(docs/doctor.md#huge-pages)"
    )


def test_the_docker_and_kubernetes_advice_is_the_docs_not_every_runs() -> None:
    # The advice once ran to 830 characters on every default tmpfs; the rest is under its anchor.
    doc = (REPO / "docs" / "doctor.md").read_text()
    assert "### `huge-pages`" in doc
    for words in (
        "--ipc=host",
        "echo force > /sys/kernel/mm/transparent_hugepage/shmem_enabled",
        "HugePages-2Mi",
    ):
        assert words in doc
    for info in (shm(), shm(huge="within_size", system="deny"), shm(point="/mnt/kv shm")):
        advice = mounts.huge_pages_advice(info)
        assert advice is not None
        assert len("fix: " + advice) <= 160, advice
        assert advice.endswith(f"({mounts.HUGE_PAGES_DOC})")


def test_another_mount_point_gets_its_own_quoted_remount() -> None:
    advice = mounts.huge_pages_advice(shm(point="/mnt/kv shm"))
    assert advice is not None
    assert f"mount -o remount,huge=within_size {shlex.quote('/mnt/kv shm')}" in advice


def test_a_system_that_denies_huge_pages_is_told_to_lift_the_deny_first() -> None:
    advice = mounts.huge_pages_advice(shm(huge="within_size", system="deny"))
    assert advice is not None
    assert advice.startswith("on the host: shmem_enabled deny to never, then mount -o remount,")


@pytest.mark.parametrize(
    ("region_bytes", "advised"), [(None, True), (mounts.HUGE_PAGES_PAY_OFF_BYTES, True), (64 << 20, False)]
)
def test_huge_pages_are_advised_for_regions_of_1_gib_and_up(region_bytes: int | None, advised: bool) -> None:
    assert mounts.huge_pages_pay_off(region_bytes) is advised


@pytest.mark.parametrize(
    "info",
    [
        None,
        shm(huge="within_size"),
        shm(huge="advise"),
        shm(system="force"),
        MountInfo(Path("/"), "ext4", "/dev/vda1", (), None, None, "never"),
    ],
    ids=["unknown", "within_size", "advise", "forced", "not-tmpfs"],
)
def test_no_advice_where_huge_pages_are_on_or_a_remount_would_not_help(info: MountInfo | None) -> None:
    assert mounts.huge_pages_advice(info) is None


# ----------------------------------------------------------------- a real mount (root)


@pytest.fixture
def huge_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs mounted with huge=within_size, a space in its name (needs root to mount)."""
    with mounted_tmpfs(tmp_path / "kv shm", "size=8m,huge=within_size") as point:
        yield point


@pytest.mark.root
def test_a_real_tmpfs_with_a_space_in_its_name_reports_its_huge_policy_and_size(huge_tmpfs: Path) -> None:
    (huge_tmpfs / "sub").mkdir()
    info = mounts.root_mount(huge_tmpfs / "sub")
    assert info is not None
    assert (info.mount_point, info.fs_type, info.huge, info.size_bytes) == (
        huge_tmpfs,
        "tmpfs",
        "within_size",
        8 << 20,
    )
