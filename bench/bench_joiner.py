"""A vLLM joiner racing a reap of its region: how often it gets ENOENT, or a removed file.

vLLM 0.33 opens its region as ``O_CREAT|O_EXCL`` and, on ``EEXIST``, as a joiner with
``O_RDWR``. A reap that takes the name away between those two calls makes the joiner fail
with ``FileNotFoundError``; one that unlinks the file after the joiner resolved the name
hands it a file with no name (its peers will make a new one). Each race here:

1. a dead one-file region is made in the root and scanned (its write lease granted);
2. a joiner process, waiting on a pipe, is told an instant drawn uniformly from a fixed
   window (``--window-us``, the same for both protocols, longer than either removal) after
   the start, and runs vLLM's two opens there, busy-waiting for it on CLOCK_MONOTONIC;
3. this process starts ``remove_regions`` (the library's removal) at the start instant.

Two protocols, races interleaved (one of each per round), in one run:

* **park** (now): the park directory made first, the file moved into it under its lease,
  proven, then unlinked there; a joiner seen in time gets the file back under its name;
* **in place** (the protocol before the park directory existed, which is also the fallback
  on a root out of inodes): the file unlinked at its name under its lease. It is run on a
  tmpfs of the bench's own with ``nr_inodes`` just used up (root only), so the park
  directory cannot be made and the library takes that path itself.

Rows: joiners that got ENOENT per 1,000 races (goal: park <= in place, compared as
(count + 1) / (count + 1), so that none against none reads 1.0), and joiners left holding
a removed file (context: what the park directory's give-back saves).

    .venv/bin/python bench/bench_joiner.py [--quick] [--json FILE] [--races N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from figures import SHM_PREFIX, TAG_ENV, Row, entry, interrupt_on_signals, private_dir, reference, report

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvoffload.liveness import lease  # noqa: E402
from kvoffload.liveness.removal import remove_regions  # noqa: E402
from kvoffload.liveness.scan import ScanOptions, scan  # noqa: E402

#: vLLM's two opens, at an instant it is told; answers what it got.
JOINER = r"""
import errno, os, sys, time
for line in sys.stdin:
    at, path = line.split(" ", 1)
    path = path.rstrip("\n")
    at = int(at)
    while time.monotonic_ns() < at:
        pass
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        outcome = "created"
        os.close(fd)
        os.unlink(path)
    except FileExistsError:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            outcome = "enoent"
        except OSError as e:
            outcome = errno.errorcode.get(e.errno, "error")
        else:
            outcome = "removed-file" if os.fstat(fd).st_nlink == 0 else "joined"
            os.close(fd)
    except OSError as e:
        outcome = errno.errorcode.get(e.errno, "error")
    print(outcome, flush=True)
"""

PAGE = os.sysconf("SC_PAGE_SIZE")
#: The joiner's pipe and wake-up take a few hundred microseconds: both sides start this late.
LEAD_NS = 2_000_000


class Joiner:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", JOINER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def race(self, path: Path, at_ns: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{at_ns} {path}\n")
        self.proc.stdin.flush()

    def outcome(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"the joiner exited (status {self.proc.wait(10)})")
        return line

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self.proc.wait(10)


@contextlib.contextmanager
def inode_full_tmpfs(what: str) -> Iterator[Path | None]:
    """A tmpfs with room for its root, the region and one inode more: the park directory fits,
    its mark does not, so the library removes in place (and a joiner may still create)."""
    if os.geteuid() != 0:
        yield None
        return
    point = (
        Path(tempfile.gettempdir())
        / f"{SHM_PREFIX}{os.environ.get(TAG_ENV, '')}{what}-{uuid.uuid4().hex[:8]}"
    )
    point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=3,mode=0755", "tmpfs", str(point)],
        capture_output=True,
        check=False,
    )
    try:
        yield point if done.returncode == 0 else None
    finally:
        if done.returncode == 0:
            subprocess.run(["umount", str(point)], check=False)
        point.rmdir()


def one_race(root: Path, joiner: Joiner, window_ns: int, rng: random.Random) -> tuple[str, str]:
    """One region made, scanned and removed while the joiner opens it: (its outcome, the reap's)."""
    path = root / f"vllm_offload_joiner-{uuid.uuid4().hex[:8]}.mmap"
    for stale in root.iterdir():  # what a joiner that won O_EXCL or a kept region left
        if not stale.name.startswith("."):
            stale.unlink()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, b"\1" * PAGE)
    finally:
        os.close(fd)
    (found,) = scan(root, ScanOptions(grace_s=0)).entries
    start = time.monotonic_ns() + LEAD_NS
    joiner.race(path, start + rng.randrange(window_ns))
    while time.monotonic_ns() < start:
        pass
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with lease.sigio_ignored():
            done = remove_regions(dir_fd, [[found]], Path("/proc"), frozenset())
    finally:
        os.close(dir_fd)
    outcome = joiner.outcome()
    return outcome, "removed" if done.removed else "kept"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--races", type=int, help="races per protocol (default 1,500; --quick 200)")
    parser.add_argument("--window-us", type=int, default=3000, help="the window the joiner fires in")
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"))
    args = parser.parse_args(argv)
    interrupt_on_signals()
    races = args.races or (200 if args.quick else 1500)
    rounds = 10
    rng = random.Random(2026)
    counts: dict[str, list[dict[str, int]]] = {"park": [], "in place": []}
    joiner = Joiner()
    try:
        with private_dir(args.shm, "joiner") as parked, inode_full_tmpfs("joiner") as full:
            roots = {"park": parked, "in place": full}
            for r in range(rounds):
                tally: dict[str, dict[str, int]] = {k: {} for k in roots}
                for _ in range(races // rounds):
                    for mode, root in roots.items():
                        if root is None:
                            continue
                        outcome, _ = one_race(root, joiner, args.window_us * 1000, rng)
                        tally[mode][outcome] = tally[mode].get(outcome, 0) + 1
                for mode in roots:
                    counts[mode].append(tally[mode])
                print(f"round {r + 1}/{rounds}: {json.dumps(tally)}", file=sys.stderr)
            for root in roots.values():
                if root is not None:
                    for stale in root.iterdir():
                        stale.unlink()
    finally:
        joiner.close()
    return _rows(counts, races, args)


def _rows(counts: dict[str, list[dict[str, int]]], races: int, args: argparse.Namespace) -> int:
    per = races // 10

    def rate(mode: str, outcome: str) -> list[float]:
        return [1000 * t.get(outcome, 0) / per for t in counts[mode]]

    def total(mode: str, outcome: str) -> int:
        return sum(t.get(outcome, 0) for t in counts[mode])

    rows: list[Row] = []
    have_in_place = bool(counts["in place"]) and any(counts["in place"])
    label = f"joiner ENOENT per 1,000 races, {args.window_us} us window"
    for mode in ("in place", "park"):
        if not have_in_place and mode == "in place":
            continue
        samples = rate(mode, "enoent")
        ratio, baseline, goal = 1.0, "", ""
        if mode == "park" and have_in_place:
            ratio = (total("park", "enoent") + 1) / (total("in place", "enoent") + 1)
            baseline, goal = f"{label}, in place", "<= 1.0x"
        rows.append(
            Row(
                figure=f"{label}, {mode} ({total(mode, 'enoent')} of {races})",
                unit="/1000",
                median=round(sorted(samples)[len(samples) // 2], 2),
                min=round(min(samples), 2),
                max=round(max(samples), 2),
                baseline=baseline,
                ratio=round(ratio, 3),
                goal=goal,
                met=ratio <= 1.0 if goal else True,
            )
        )
    for mode in ("in place", "park"):
        if not have_in_place and mode == "in place":
            continue
        samples = rate(mode, "removed-file")
        rows.append(
            reference(
                f"joiner left holding a removed file, {mode} ({total(mode, 'removed-file')} of {races})",
                "/1000",
                samples,
                digits=2,
            )
        )
    if not have_in_place:
        print("in place: not measured (needs root to mount a tmpfs with no inode to spare)", file=sys.stderr)
    report(rows, json_path=args.json, value="/1000", digits=2)
    return 0


if __name__ == "__main__":
    sys.exit(entry(main, "bench_joiner"))
