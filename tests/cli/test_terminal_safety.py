"""Names cannot attack a terminal: no output carries a control character of a name as itself.

Any user can create ``/dev/shm/vllm_offload_<anything>.mmap``, so a region's name may hold an
ESC sequence (``ESC[2J`` clears the screen; OSC 52 writes the clipboard), a C1 control (U+009B
is CSI on its own), a line or paragraph separator, a bidi override that shows another name, or
bytes that are not UTF-8. Every command is run on such names, in a pipe and on a real
terminal: what it writes decodes as strict UTF-8 and holds no character of
``shmctl.render.CONTROLS`` but the newline (and, on a terminal, shmctl's own colour); the
names are escapes (``\\x1b``, ``\\u202e``, ``\\udcff``) and JSON gives them back exactly. One
exception, in a pipe only: the Prometheus exposition of ``shmctl metrics`` carries label values
exactly, as a parser needs them (issue #32; tests/cli/test_metrics.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.cpu.shared_offload_region import PAGESIZE
from kvoffload.liveness.scan import scan
from kvoffload.shm import names
from shmctl.render import CONTROLS, json_text, printable
from shmctl.render.metrics import label_text
from tests.support.procs import REPO, write_file
from tests.support.terminal import on_a_terminal

#: What a name may hold to drive a terminal or hide itself, by what it does.
HOSTILE = {
    "clear-screen": b"\x1b[2J",
    "osc52-clipboard": b"\x1b]52;c;ZXZpbA==\x07",
    "c1-csi": "\u009b31m".encode(),
    "c1-nel": "\u0085".encode(),
    "line-separator": "\u2028".encode(),
    "paragraph-separator": "\u2029".encode(),
    "bidi-override": "\u202etxt.exe".encode(),
    "bidi-marks": "\u200e\u200f\u2066\u2069\u061c".encode(),
    "del-tab-cr": b"\x7f\t\r",
    "not-utf-8": b"\xff\xfe",
    "raw-c1-byte": b"\x9b2J",  # not UTF-8: a lone 0x9b is CSI to an 8-bit terminal
}
#: The directory the regions live in is hostile too: roots are printed, labelled and escaped.
ROOT_NAME = b"root-\x1b[2J-\xc2\x9b-\xe2\x80\xae-\xff"
#: What shmctl itself writes to a terminal: colour (SGR, ``shmctl.render.styled``), and the
#: cursor moves of init's progress display (rich: hide and show the cursor, go up a line,
#: erase it). ``ESC[2J``, OSC and C1 are none of these.
OWN_CONTROLS = re.compile(r"\x1b\[[0-9;]*m|\x1b\[\?25[lh]|\x1b\[[0-9]*A|\x1b\[2K|\r(?=\x1b\[)")
#: One of ``CONTROLS``.
CONTROL = re.compile(f"[{CONTROLS}]")
STRICT = {"PYTHONIOENCODING": "utf-8", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


@dataclass(frozen=True, slots=True)
class Hostile:
    root: Path
    #: The region files' names, as bytes.
    planted: frozenset[bytes]

    @property
    def arg(self) -> str:
        """The root as an argument (its bytes come back through ``os.fsencode``)."""
        return str(self.root)


@pytest.fixture
def hostile(root: Path, engine_id: str) -> Hostile:
    """Region files named with every ``HOSTILE`` sequence, in a directory with a hostile name."""
    where = Path(os.fsdecode(os.fsencode(root) + b"/" + ROOT_NAME))
    where.mkdir()
    planted = set()
    for what, sequence in HOSTILE.items():
        name = b"vllm_offload_" + f"{engine_id}-{what}-".encode() + sequence + b".mmap"
        write_file(Path(os.fsdecode(os.fsencode(where) + b"/" + name)), 4096)
        planted.add(name)
    return Hostile(where, frozenset(planted))  # the root fixture removes them


def offenders(text: str, *, terminal: bool = False) -> list[str]:
    """Every character of ``CONTROLS`` in ``text`` but the newline (and, on a terminal,
    ``OWN_CONTROLS``)."""
    if terminal:
        text = OWN_CONTROLS.sub("", text.replace("\r\n", "\n"))
    return sorted({f"U+{ord(c):04X}" for c in CONTROL.findall(text) if c != "\n"})


def strict(data: bytes) -> str:
    """``data`` as UTF-8, strictly: a raw byte of a name (0x9b, 0xff) fails here."""
    return data.decode("utf-8", "strict")


def run_piped(*argv: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "NO_COLOR": "1", **STRICT}
    env.pop("SHMCTL_ROOT", None)
    return subprocess.run(
        [sys.executable, "-m", "shmctl", *argv],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        cwd=REPO,
        env=env,
        timeout=120,
        check=False,
    )


def make_file_command(path: Path) -> list[str]:
    """A command that leaves ``path`` behind, for ``audit``."""
    make = "import os, sys; os.close(os.open(os.fsencode(sys.argv[1]), os.O_CREAT | os.O_WRONLY, 0o600))"
    return [sys.executable, "-c", make, str(path)]


def commands(h: Hostile, engine_id: str) -> dict[str, tuple[list[str], int]]:
    """Each command that shows names, and its exit status here (1: orphans are findings)."""
    leak = Path(
        os.fsdecode(
            os.fsencode(h.root) + b"/vllm_offload_" + engine_id.encode() + b"-\x1b]52;c;eA==\x07.mmap"
        )
    )
    missing = os.fsdecode(os.fsencode(h.root) + b"/missing-\x1b[2J\xc2\x9b")
    return {
        "scan": (["scan", "--root", h.arg, "--grace", "0"], 1),
        "scan --deleted": (["scan", "--root", h.arg, "--grace", "0", "--deleted"], 1),
        "reap --dry-run": (["reap", "--root", h.arg, "--grace", "0", "--dry-run"], 0),
        "reap --dry-run --engine": (
            ["reap", "--root", h.arg, "--grace", "0", "--dry-run", "--engine", f"{engine_id}-clear*"],
            0,
        ),
        "reap --dry-run --engine nothing": (
            ["reap", "--root", h.arg, "--grace", "0", "--dry-run", "--engine", "none-\x1b[2J\u202e"],
            0,
        ),
        "metrics": (["metrics", "--root", h.arg, "--grace", "0"], 0),
        "watch --once": (["watch", "--root", f"{h.root.parent}/*", "--once", "--grace", "0"], 0),
        "audit": (["audit", "--root", h.arg, "--", *make_file_command(leak)], 1),
        "error line": (["scan", "--root", missing], 3),
        "init --dry-run": (["init", *init_args(h, engine_id), "--dry-run"], 0),
        "init": (["init", *init_args(h, engine_id)], 0),
    }


#: An engine id for ``init``: anything but '/' and NUL, so markup and controls too.
def init_engine_id(engine_id: str) -> str:
    return f"{engine_id}[bold]-\x1b[2J\u009b\t\u202e"


def init_args(h: Hostile, engine_id: str) -> list[str]:
    config = {
        "kv_connector": "OffloadingConnector",
        "engine_id": init_engine_id(engine_id),
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 1 << 22,
            "secondary_tiers": [{"type": "example"}],
        },
    }
    return [
        "--kv-transfer-config",
        json.dumps(config),
        "--kv-bytes-per-block",
        str(4 * PAGESIZE),
        "--root",
        h.arg,
    ]


COMMANDS = [
    "scan",
    "scan --deleted",
    "reap --dry-run",
    "reap --dry-run --engine",
    "reap --dry-run --engine nothing",
    "metrics",
    "watch --once",
    "audit",
    "error line",
    "init --dry-run",
    "init",
]
#: In a pipe, ``metrics`` writes its labels exactly (a parser reads them): not escaped.
PIPED = [command for command in COMMANDS if command != "metrics"]


def cleanup_audit_leak(h: Hostile) -> None:
    for name in os.listdir(os.fsencode(h.root)):
        if name not in h.planted:
            os.unlink(os.fsencode(h.root) + b"/" + name)


@pytest.mark.parametrize("command", PIPED)
def test_a_command_in_a_pipe_writes_no_control_character_of_a_name(
    command: str, hostile: Hostile, engine_id: str
) -> None:
    argv, status = commands(hostile, engine_id)[command]
    done = run_piped(*argv)
    cleanup_audit_leak(hostile)

    out, err = strict(done.stdout), strict(done.stderr)
    assert done.returncode == status, err
    assert offenders(out) == [], out
    assert offenders(err) == [], err
    assert sorted(os.listdir(os.fsencode(hostile.root))) == sorted(hostile.planted), (
        "a dry run removes nothing"
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_on_a_terminal_writes_no_control_character_of_a_name(
    command: str, hostile: Hostile, engine_id: str
) -> None:
    argv, status = commands(hostile, engine_id)[command]
    shown = on_a_terminal(*argv, on=("stdout", "stderr"), env=STRICT, columns=200)
    cleanup_audit_leak(hostile)

    text = strict(shown.raw)
    assert shown.code == status, text
    assert offenders(text, terminal=True) == [], text
    assert "\\x1b[2J" in text or command == "watch --once", "the name is shown, escaped"


def test_init_progress_shows_an_engine_id_as_text_never_as_markup(hostile: Hostile, engine_id: str) -> None:
    shown = on_a_terminal("init", *init_args(hostile, engine_id), on=("stderr",), env=STRICT, columns=300)
    assert shown.code == 0, shown.err
    # The progress line (stderr, a terminal): "[bold]" is the id's own text, not a style.
    assert f"for engine {printable(init_engine_id(engine_id), escape_backslash=False)}" in shown.plain


def test_a_table_shows_each_name_as_its_escapes(hostile: Hostile, engine_id: str) -> None:
    done = run_piped("scan", "--root", hostile.arg, "--grace", "0", "--no-headers")
    engines = sorted(line.split()[1] for line in strict(done.stdout).splitlines())
    assert engines == sorted(
        printable(os.fsdecode(name)[len(names.PREFIX) : -len(".mmap")]) for name in hostile.planted
    )
    assert f"{engine_id}-c1-csi-\\x9b31m" in engines
    assert f"{engine_id}-not-utf-8-\\udcff\\udcfe" in engines


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
@pytest.mark.parametrize("command", ["scan", "reap"])
def test_json_gives_back_every_name_byte_for_byte(command: str, terminal: bool, hostile: Hostile) -> None:
    argv = [command, "--root", hostile.arg, "--grace", "0", "--json"] + (
        ["--dry-run"] if command == "reap" else []
    )
    if terminal:
        shown = on_a_terminal(*argv, env=STRICT)
        text = strict(shown.raw).replace("\r\n", "\n")
        assert "\n  " in text, "indented on a terminal"
    else:
        text = strict(run_piped(*argv).stdout)
        assert text.count("\n") == 1, "one line in a pipe"

    assert offenders(text) == []
    document = json.loads(text)
    entries = document["entries"] if command == "scan" else document["removed"]
    assert {os.fsencode(e["name"]) for e in entries} == hostile.planted
    assert {os.fsencode(e["path"]) for e in entries} == {
        os.fsencode(hostile.root) + b"/" + n for n in hostile.planted
    }
    assert os.fsencode(document["root"]) == os.fsencode(hostile.root)


def test_metrics_label_values_are_the_names_exactly_and_parse_back(hostile: Hostile, tmp_path: Path) -> None:
    done = run_piped("metrics", "--root", hostile.arg, "--grace", "0", "--top-engines", "100")
    textfile = run_piped(
        "metrics", "--root", hostile.arg, "--grace", "0", "--top-engines", "100", "--textfile", str(tmp_path)
    )
    assert (done.returncode, textfile.returncode) == (0, 0), done.stderr + textfile.stderr

    written = (tmp_path / "shmctl.prom").read_bytes()
    for exposition in (done.stdout, written):
        engines = {
            sample.labels["engine_id"]
            for family in text_string_to_metric_families(strict(exposition))
            for sample in family.samples
            if sample.name == "shmctl_orphan_engine_bytes"
        }
        exact = {label_text(os.fsdecode(n)[len(names.PREFIX) : -len(".mmap")]) for n in hostile.planted}
        assert engines == exact | {"other"}


def test_the_audit_report_keeps_the_exact_name_with_no_control_in_its_text(
    hostile: Hostile, engine_id: str, tmp_path: Path
) -> None:
    raw = (
        os.fsencode(hostile.root)
        + b"/vllm_offload_"
        + engine_id.encode()
        + b"-\x1b[2J\xc2\x85\xe2\x80\xa8\xff.mmap"
    )
    report = tmp_path / "audit.json"
    done = run_piped(
        "audit",
        "--root",
        hostile.arg,
        "--report",
        str(report),
        "--",
        *make_file_command(Path(os.fsdecode(raw))),
    )
    os.unlink(raw)

    assert done.returncode == 1, done.stderr
    text = strict(report.read_bytes())
    assert offenders(text) == []
    (leaked,) = json.loads(text)["leaked"]
    assert os.fsencode(leaked["path"]) == raw


# ------------------------------------------------------------------------- the escapings


def test_printable_escapes_every_control_character() -> None:
    controls = [chr(c) for c in range(0x110000) if CONTROL.match(chr(c))]
    assert (
        len(controls) == 32 + 33 + 1 + 2 + 7 + 4 + 2048
    )  # C0, DEL+C1, ALM, LRM/RLM, 2028-202E, isolates, surrogates
    assert all(printable(c) != c and printable(c).isascii() and printable(c).isprintable() for c in controls)


def test_json_text_writes_every_control_character_as_its_escape() -> None:
    for c in (chr(c) for c in range(0x110000) if CONTROL.match(chr(c))):
        for pretty in (False, True):
            text = json_text({"name": c}, pretty=pretty)
            assert f"\\u{ord(c):04x}" in text or c in "\b\t\n\f\r", (hex(ord(c)), text)
            assert offenders(text) == []
            assert json.loads(text) == {"name": c}


def test_json_text_leaves_every_other_character_as_itself() -> None:
    text = "café 🚀 ünïcødé … ‐ € \u00a0"
    assert json_text([text]) == json.dumps([text], ensure_ascii=False, separators=(",", ":"))


BYTE_NAMES = st.binary(min_size=1, max_size=names.NAME_MAX - len(names.PREFIX) - len(".mmap")).filter(
    lambda b: b"/" not in b and b"\0" not in b
)


@settings(max_examples=500, derandomize=True, deadline=None, database=None)
@given(raw=BYTE_NAMES, pretty=st.booleans())
@example(raw=b"\x1b]52;c;ZXZpbA==\x07", pretty=False)
@example(raw="\u2028\u202e\x85".encode() + b"\xff\x9b\xed\xa0\x80", pretty=True)
def test_any_bytes_go_through_json_and_come_back(raw: bytes, pretty: bool) -> None:
    name = os.fsdecode(raw)
    text = json_text({"name": name, "names": [name, name]}, pretty=pretty)
    text.encode("utf-8", "strict")
    assert offenders(text) == []
    document = json.loads(text)
    assert os.fsencode(document["name"]) == raw
    assert [os.fsencode(n) for n in document["names"]] == [raw, raw]


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(raw=BYTE_NAMES)
def test_any_bytes_are_one_line_of_visible_text_for_a_person_and_exact_in_a_label(raw: bytes) -> None:
    name = os.fsdecode(raw)
    assert printable(name).isprintable()
    # A sink escapes a line that holds escaped names already: they stay as they are.
    assert printable(printable(name), escape_backslash=False) == printable(name)
    # A label is the name itself, but an undecodable byte: the text of its JSON escape.
    label = label_text(name)
    label.encode("utf-8", "strict")
    assert label == "".join(f"\\u{ord(c):04x}" if 0xDC80 <= ord(c) <= 0xDCFF else c for c in name)


@settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # one root; each example empties it
)
@given(raw=BYTE_NAMES.map(lambda b: b[:200]))
@example(raw=b"-\x1b[2J\xc2\x9b\xff")
def test_a_real_file_of_any_byte_name_is_scanned_to_json_and_back(root: Path, raw: bytes) -> None:
    name = b"vllm_offload_" + raw + b".mmap"
    path = os.fsencode(root) + b"/" + name
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    try:
        report = scan(root, grace_s=0)
    finally:
        os.unlink(path)
    text = json_text(report)
    assert offenders(text) == []
    (entry,) = json.loads(text.encode("utf-8").decode("utf-8", "strict"))["entries"]
    assert os.fsencode(entry["name"]) == name
