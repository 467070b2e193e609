"""``shmctl watch``'s event stream: strict UTF-8 JSON whatever the names and the locale; the
metrics of a pass recorded before its ``pass`` event; and no trap left silent.

Pod volumes here are real directories on the /dev/shm tmpfs whose names hold bytes that are
not UTF-8, control characters and non-ASCII letters; the agent is ``python -m shmctl watch``
under ``LANG=C``, ``PYTHONIOENCODING=ascii`` and a strict UTF-8 stdout. Every line must
decode as strict UTF-8, parse as JSON, match ``watch-event.schema.json``, and give the
bytes of the names back (``os.fsencode``).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.errors import ConfigError
from kvoffload.liveness.events import Event, PassSummary, RootNoMatch
from kvoffload.liveness.roots import KUBELET_DIRECTORIES
from kvoffload.liveness.watch import WatchConfig, Watcher
from shmctl.render.watch import EventWriter
from shmctl.serve.state import WatchMetrics
from tests.support.hostile import shmctl
from tests.support.procs import REPO, region_path, write_file
from tests.support.schemas import validate
from tests.watch.test_watch import Agent

JSON = dict[str, Any]
EMPTY_DIR = b"volumes/kubernetes.io~empty-dir"
#: Pod UIDs and volume names no kubelet would make, but a directory may have.
POD_UIDS = (b"uid-plain", b"uid-\xff\xfe", b"uid-caf\xc3\xa9", b"uid-\xed\xa0\x80")
VOLUMES = (b"dshm", b"v-\x80", b"new\nline", b'q"uote\\back', b"tab\there-\x1b[31m")

ENCODINGS = {
    "LANG=C": {"LANG": "C", "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"},
    "PYTHONIOENCODING=ascii": {"PYTHONIOENCODING": "ascii"},
    "strict-utf-8": {"PYTHONIOENCODING": "utf-8:strict", "PYTHONUTF8": "1"},
}


def volumes_of(base: bytes) -> list[bytes]:
    return [b"/".join((base, b"pods", uid, EMPTY_DIR, volume)) for uid in POD_UIDS for volume in VOLUMES]


def run_agent(env: dict[str, str], *args: str | bytes) -> subprocess.CompletedProcess[bytes]:
    merged = {
        k: v for k, v in os.environ.items() if k not in ("LANG", "LC_ALL", "PYTHONIOENCODING", "PYTHONUTF8")
    }
    merged.update(env)
    return subprocess.run(
        [sys.executable, "-m", "shmctl", "watch", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        cwd=REPO,
        env=merged,
        timeout=120,
        check=False,
    )


def strict_lines(stdout: bytes) -> list[JSON]:
    """Every line of ``stdout`` as strict UTF-8 JSON that matches the event schema."""
    events = []
    for line in stdout.splitlines():
        event = json.loads(line.decode("utf-8", "strict"))
        validate(event, "watch-event")
        events.append(event)
    return events


@pytest.mark.parametrize("env", ENCODINGS.values(), ids=ENCODINGS.keys())
def test_every_event_line_is_strict_utf8_json_that_gives_the_names_bytes_back(
    root: Path, engine_id: str, env: dict[str, str]
) -> None:
    base = os.fsencode(root)
    volumes = volumes_of(base)
    for volume in volumes:
        os.makedirs(volume)
    # An orphan with a name that is not UTF-8 in one volume: told as removed in the second pass.
    odd_engine = os.fsencode(engine_id) + b"-\xff\xfe"
    write_file(region_path(Path(os.fsdecode(volumes[6])), os.fsdecode(odd_engine)), touch=1)
    empty = base + b"/empty-\xfe"
    os.mkdir(empty)
    unmatched = empty + b"/*"

    done = run_agent(
        env,
        "--root",
        os.fsdecode(base + b"/pods/*/" + EMPTY_DIR + b"/*"),
        "--root",
        os.fsdecode(unmatched),
        "--grace",
        "0s",
        "--reap",
        "--max-passes",
        "2",
        "--interval",
        "0.05s",
    )

    assert done.returncode == 0, done.stderr
    assert done.stderr == b""
    events = strict_lines(done.stdout)
    appeared = [e for e in events if e["event"] == "root_appeared"]
    assert {os.fsencode(e["root"]) for e in appeared} == set(volumes)
    assert {os.fsencode(e["pod_uid"]) for e in appeared} == set(POD_UIDS)
    assert [os.fsencode(e["engine_id"]) for e in events if e["event"] == "removed"] == [odd_engine]
    assert [os.fsencode(e["pattern"]) for e in events if e["event"] == "root_no_match"] == [unmatched] * 2
    assert [e["event"] for e in events].count("pass") == 2


def test_a_name_that_is_valid_utf8_is_written_as_itself(root: Path) -> None:
    os.mkdir(os.fsencode(root) + b"/caf\xc3\xa9")
    done = run_agent(ENCODINGS["PYTHONIOENCODING=ascii"], "--root", f"{root}/*", "--max-passes", "1")
    assert "café".encode() in done.stdout, (
        "one escaping for bytes that are not UTF-8, none for those that are"
    )
    assert [e["root"] for e in strict_lines(done.stdout) if e["event"] == "root_appeared"] == [f"{root}/café"]


def test_scan_json_escapes_a_name_as_the_events_do(root: Path, engine_id: str) -> None:
    name = os.fsencode(engine_id) + b"-\xff"
    path = write_file(region_path(root, os.fsdecode(name)))
    done = subprocess.run(
        [sys.executable, "-m", "shmctl", "scan", "--root", str(root), "--grace", "0", "--json"],
        capture_output=True,
        cwd=REPO,
        env={**os.environ, "PYTHONIOENCODING": "ascii"},
        timeout=60,
        check=False,
    )
    path.unlink()

    assert done.returncode == 1, done.stderr  # an orphan found
    assert b"\\udcff" in done.stdout
    doc = json.loads(done.stdout.decode("utf-8", "strict"))
    assert [os.fsencode(e["engine_id"]) for e in doc["entries"]] == [name]


def test_an_ascii_stream_gets_utf8_and_a_closed_one_ends_the_events_not_the_passes(tmp_path: Path) -> None:
    (tmp_path / "café").mkdir()
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii")
    writer = EventWriter(stream)
    w = Watcher(WatchConfig(roots=(f"{tmp_path}/*",), interval_s=0), on_event=writer)
    w.run_pass()
    events = strict_lines(raw.getvalue())
    stream.close()
    w.run_pass()

    assert [e["root"] for e in events if e["event"] == "root_appeared"] == [f"{tmp_path}/café"]
    assert writer.broken
    assert w.passes == 2


# --- the metrics of a pass come before its event ---------------------------------------------------


def passes_total(metrics: WatchMetrics) -> float:
    for family in text_string_to_metric_families(metrics.text().decode()):
        if family.name == "shmctl_watch_passes":
            return family.samples[0].value
    raise AssertionError("no shmctl_watch_passes_total")


def test_each_pass_is_in_the_metrics_when_its_event_is_emitted(tmp_path: Path) -> None:
    metrics = WatchMetrics(interval_s=1)
    seen: list[tuple[int, float]] = []

    def on_event(event: Event) -> None:
        if isinstance(event, PassSummary):
            seen.append((len(seen) + 1, passes_total(metrics)))

    w = Watcher(WatchConfig(roots=(str(tmp_path),), interval_s=0), on_event=on_event)
    assert w.run(max_passes=50, on_pass=metrics.record) == 50

    assert seen == [(n, float(n)) for n in range(1, 51)]


@pytest.mark.slow
def test_a_scrape_after_a_pass_event_shows_that_pass(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"r{i}").mkdir()
    agent = Agent("--root", f"{tmp_path}/r*", "--interval", "0.05s", "--listen", "127.0.0.1:0")
    try:
        agent.port()
        for n in range(1, 31):
            events = agent.wait_for(agent.passes_after(0, n))
            told = len([e for e in events if e["event"] == "pass"])
            got = {
                s.name: s.value
                for f in text_string_to_metric_families(agent.get("/metrics")[1])
                for s in f.samples
            }
            assert got["shmctl_watch_passes_total"] >= told, f"pass {told} told before it was recorded"
    finally:
        agent.kill()


# --- no silent traps --------------------------------------------------------------------------------


@pytest.mark.parametrize("one_pass", [("--once",), ("--max-passes", "1")], ids=["once", "max-passes-1"])
def test_reap_with_one_pass_is_refused_with_what_to_run_instead(
    root: Path, engine_id: str, one_pass: tuple[str, ...]
) -> None:
    orphan = write_file(region_path(root, engine_id))
    done = shmctl("watch", "--root", str(root), "--grace", "0s", "--reap", *one_pass)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith(f"shmctl: error: {one_pass[0]}: ")
    assert done.stderr.count("\n") == 1
    for said in ("two passes", "--max-passes 2", "shmctl reap"):
        assert said in done.stderr
    assert orphan.exists()
    orphan.unlink()


def test_a_glob_that_matches_nothing_is_told_every_pass_until_it_does(tmp_path: Path) -> None:
    pattern = f"{tmp_path}/pods/*/volumes/*"
    (tmp_path / "pods").mkdir()
    seen: list[Event] = []
    w = Watcher(WatchConfig(roots=(pattern, str(tmp_path)), interval_s=0), on_event=seen.append)
    told: list[list[tuple[str, object, object]]] = []
    for n in range(4):
        if n == 3:
            (tmp_path / "pods" / "p" / "volumes" / "v").mkdir(parents=True)
        seen.clear()
        w.run_pass()
        told.append([(e.pattern, e.root, e.pod_uid) for e in seen if isinstance(e, RootNoMatch)])

    assert told == [[(pattern, None, None)]] * 3 + [[]]
    assert tmp_path / "pods" / "p" / "volumes" / "v" in w.watched


def test_the_no_match_event_matches_its_schema(tmp_path: Path) -> None:
    stream = io.StringIO()
    Watcher(WatchConfig(roots=(f"{tmp_path}/*",), interval_s=0), on_event=EventWriter(stream)).run_pass()
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    for event in events:
        validate(event, "watch-event")
    assert events[0] == {
        "event": "root_no_match",
        "time": events[0]["time"],
        "root": None,
        "pod_uid": None,
        "pattern": f"{tmp_path}/*",
    }


def test_a_glob_whose_fixed_part_is_missing_is_refused_naming_the_kubelet_directories(
    tmp_path: Path, engine_id: str
) -> None:
    orphan = write_file(region_path(tmp_path, engine_id))
    glob = f"{tmp_path}/k0s/kubelet/pods/*/volumes/kubernetes.io~empty-dir/*"

    done = shmctl("watch", "--root", str(tmp_path), "--root", glob, "--reap", "--grace", "0s")

    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(
        f"shmctl: error: --root: '{glob}': {tmp_path}/k0s/kubelet/pods does not exist"
    )
    for directory, distribution in KUBELET_DIRECTORIES:
        assert f"{directory} ({distribution})" in done.stderr
    assert orphan.exists()


def test_a_missing_plain_root_is_still_a_root_and_a_file_as_fixed_part_is_refused(tmp_path: Path) -> None:
    Watcher(WatchConfig(roots=(str(tmp_path / "not-yet"),)))
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="is not a directory"):
        Watcher(WatchConfig(roots=(f"{tmp_path}/file/*",)))


def test_the_kubelet_directories_named_are_the_distributions_defaults() -> None:
    named = dict(KUBELET_DIRECTORIES)
    assert set(named) == {
        "/var/lib/kubelet",
        "/var/lib/k0s/kubelet",
        "/var/snap/microk8s/common/var/lib/kubelet",
        "/var/lib/rancher/k3s/agent/kubelet",
    }
    assert "k3s" in named["/var/lib/kubelet"], "k3s uses the default since v0.10 (k3s-io/k3s#840)"
