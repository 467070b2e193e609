"""The other files a killed engine leaves, as families: recognised exactly, judged by the same
evidence and grace as the offload regions, and removed only when a scan asks for them.

Every test runs over ``FAMILIES`` (the registry), with real files in a private root and real
processes holding them the way their makers do: Python's ``SharedMemory`` for ``psm``, glibc's
``sem_open`` through ``_multiprocessing.SemLock`` for ``sem``, a shared mapping for ``nccl`` and
``torch``. A family added to the registry fails ``test_every_family_has_a_maker_here`` until
it is covered here.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from pathlib import Path

import pytest

from kvoffload.errors import ConfigError
from kvoffload.liveness.reap import reap
from kvoffload.liveness.scan import ScanOptions, Status, scan
from kvoffload.shm import families
from kvoffload.shm.families import FAMILIES, FAMILY_NAMES, OFFLOAD
from tests.support.procs import NOBODY, Child, entry, write_file
from tests.support.schemas import SCHEMAS

OTHERS = tuple(name for name in FAMILY_NAMES if name != OFFLOAD)


def _sem_suffix() -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits + "_") for _ in range(8))


#: A fresh name of each family, shaped as its maker shapes it.
MAKERS: dict[str, Callable[[], str]] = {
    OFFLOAD: lambda: f"vllm_offload_{secrets.token_hex(6)}.mmap",
    "psm": lambda: f"psm_{secrets.token_hex(4)}",
    "sem": lambda: f"sem.mp-{_sem_suffix()}",
    "nccl": lambda: "nccl-" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(6)),
    "torch": lambda: (
        f"torch_{secrets.randbelow(1 << 22)}_{secrets.randbelow(1 << 32)}_{secrets.randbelow(9)}"
    ),
}

#: Names that look like a family's and are not: never listed, whatever the families.
LOOK_ALIKES = (
    "psm_0123abc",  # 7 hex digits: not token_hex(4)
    "psm_0123abcde",
    "psm_0123ABCD",  # token_hex is lowercase
    "psm_0123abcd.tmp",
    "vllm_ec_0123.mmap",  # vLLM's encoder cache: another subsystem
    "sem.mp-abc",
    "sem.mp-ABCDEFGH",
    "sem.foo",
    "nccl-abc",
    "nccl-abcdefg",
    "nccl-abc-ef",
    "torch_1_2",
    "torch_a_2_3",
    "torch-shm-dir-abc",
    "xpsm_0123abcd",
)

#: A real process holding a file of the family the way its maker does, then ``ready``. The
#: named object is made where its maker makes it (/dev/shm) and renamed into the test's root,
#: on the same tmpfs: the holder keeps the very inode.
_HOLDER = r"""
import mmap, os, sys
family, path = sys.argv[1], sys.argv[2]
name = os.path.basename(path)
keep = []
if family == "psm":
    from multiprocessing import resource_tracker
    from multiprocessing.shared_memory import SharedMemory
    shm = SharedMemory(name=name, create=True, size=4096)
    resource_tracker.unregister(shm._name, "shared_memory")  # it will not be at /dev/shm to unlink
    shm.buf[0] = 1
    keep.append(shm)
    os.rename(f"/dev/shm/{name}", path)
elif family == "sem":
    import _multiprocessing
    # multiprocessing's own call with unlink=False: the name stays, as when a process dies
    # between sem_open and sem_unlink. glibc maps it and closes the fd.
    keep.append(_multiprocessing.SemLock(1, 1, 1, "/" + name[len("sem."):], False))
    os.rename(f"/dev/shm/{name}", path)
else:
    with open(path, "r+b") as f:
        keep.append(mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED))
print("ready", flush=True)
sys.stdin.read()
"""


def hold(family: str, path: Path) -> Child:
    if family in ("nccl", "torch"):
        write_file(path, 4096)
    return Child(family, path, script=_HOLDER)


def judged(*chosen: str, grace_s: float = 0.0) -> ScanOptions:
    return ScanOptions(grace_s=grace_s, families=frozenset(chosen))


def test_every_family_has_a_maker_here() -> None:
    assert set(MAKERS) == set(FAMILY_NAMES)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_name_of_a_family_is_of_that_family_alone(family: str) -> None:
    name = MAKERS[family]()
    found = families.parse(name)
    assert found is not None
    assert found[0] == family
    assert [f.name for f in FAMILIES if f.parse(name) is not None] == [family]


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_a_look_alike_belongs_to_no_family(name: str) -> None:
    assert families.parse(name) is None


def test_the_json_schema_knows_every_family_and_no_other() -> None:
    scan_schema = json.loads((SCHEMAS / "scan.schema.json").read_text())
    assert scan_schema["$defs"]["entry"]["properties"]["family"]["enum"] == list(FAMILY_NAMES)


def test_all_is_every_family_and_nothing_given_is_offload() -> None:
    assert families.select(["all"]) == frozenset(FAMILY_NAMES)
    assert families.select([]) == frozenset({OFFLOAD})
    assert families.select(["psm", "psm"]) == frozenset({"psm"})


def test_an_unknown_family_is_refused_with_the_names_to_use() -> None:
    with pytest.raises(ConfigError) as caught:
        families.select(["foo"])
    assert "unknown family 'foo'" in str(caught.value)
    assert caught.value.fix is not None
    assert all(name in caught.value.fix for name in (*FAMILY_NAMES, "all"))
    with pytest.raises(ConfigError):
        ScanOptions(families=frozenset({"foo"}))


@pytest.mark.parametrize("family", OTHERS)
def test_a_dead_file_is_orphaned_only_when_its_family_is_asked_for(root: Path, family: str) -> None:
    dead = write_file(root / MAKERS[family](), 4096)
    assert scan(root, ScanOptions(grace_s=0.0)).entries == ()
    found = entry(scan(root, judged(family)), dead.name)
    assert (found.status, found.reason, found.family) == (Status.ORPHANED, NOBODY, family)
    assert (found.engine_id, found.segment) == (dead.name, 0)


@pytest.mark.parametrize("family", OTHERS)
def test_a_dead_file_is_reaped_only_with_its_family(root: Path, family: str) -> None:
    dead = write_file(root / MAKERS[family](), 4096)
    assert reap(root, ScanOptions(grace_s=0.0)).removed == ()
    assert dead.exists()
    done = reap(root, judged(family))
    assert [e.name for e in done.removed] == [dead.name]
    assert done.families == (family,)
    assert not dead.exists()


@pytest.mark.parametrize("family", OTHERS)
def test_a_file_its_maker_holds_is_live_and_never_reaped(root: Path, family: str) -> None:
    path = root / MAKERS[family]()
    with hold(family, path) as holder:
        found = entry(scan(root, judged(family)), path.name)
        assert found.status is Status.LIVE
        assert holder.pid in {h.pid for h in found.holders}
        done = reap(root, judged(family))
        assert done.removed == ()
        assert path.exists()
    path.unlink()


@pytest.mark.parametrize("family", OTHERS)
def test_a_file_inside_the_grace_period_is_starting(root: Path, family: str) -> None:
    young = write_file(root / MAKERS[family](), 4096)
    found = entry(scan(root, judged(family, grace_s=3600.0)), young.name)
    assert found.status is Status.STARTING
    assert reap(root, judged(family, grace_s=3600.0)).removed == ()
    assert young.exists()


def test_look_alikes_are_never_listed_even_with_every_family(root: Path) -> None:
    for name in LOOK_ALIKES:
        write_file(root / name, 4096)
    every = ScanOptions(grace_s=0.0, families=frozenset(FAMILY_NAMES))
    assert scan(root, every).entries == ()
    assert reap(root, every).removed == ()
    assert sorted(p.name for p in root.iterdir()) == sorted(LOOK_ALIKES)


def test_every_family_is_judged_at_once_and_each_file_alone(root: Path) -> None:
    dead = {family: write_file(root / MAKERS[family](), 4096) for family in FAMILY_NAMES}
    report = scan(root, ScanOptions(grace_s=0.0, families=frozenset(FAMILY_NAMES)))
    assert report.families == FAMILY_NAMES
    assert {e.name: e.family for e in report.entries} == {p.name: f for f, p in dead.items()}
    assert report.summary.orphaned == len(FAMILY_NAMES)


def test_a_file_named_like_an_engine_id_never_shares_that_regions_verdict(root: Path) -> None:
    # A pinned engine id may spell a psm name: the region and the psm file are two units.
    name = MAKERS["psm"]()
    region = write_file(root / f"vllm_offload_{name}.mmap", 4096)
    psm = root / name
    with hold("psm", psm):
        report = scan(root, ScanOptions(grace_s=0.0, families=frozenset({OFFLOAD, "psm"})))
        assert entry(report, region.name).status is Status.ORPHANED
        assert entry(report, psm.name).status is Status.LIVE
        done = reap(root, ScanOptions(grace_s=0.0, families=frozenset({OFFLOAD, "psm"})))
        assert [e.name for e in done.removed] == [region.name]
        assert psm.exists()
    psm.unlink()
