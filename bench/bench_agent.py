"""The node agent's steady-state pass: ``shmctl watch`` over 100 pod volumes on a host of 2,000 processes.

Lays out ``--pods`` pod volumes as a kubelet does, in a private directory
``/dev/shm/shmctl-bench-agent-<uuid>/pods/<pod>/volumes/kubernetes.io~empty-dir/dshm``, each
its own small tmpfs where this process may mount one (as root; else plain directories of the
shm root, said on stderr), and in every volume a live region (a base file and three segments,
held by that pod's engine-like process: the base by fd and map, the segments by map only, as
vLLM holds them; its owner record written) and, in every other volume, an orphaned region (a
base and one segment, its owner record naming a process that has exited). Then it brings the
host up to ``--processes`` processes with sleeping children (those already running count).

The agent is what ``shmctl watch`` runs: a ``Watcher`` over the glob
``.../pods/*/volumes/kubernetes.io~empty-dir/*``, without ``--reap`` and with ``--grace 0s``
(orphans older than the grace, as on a node in its steady state), its events encoded as JSON
lines (to /dev/null) and each pass recorded in the metrics. Nothing changes between passes:
that is the steady state. After a first pass (checked: every held file live, every other
orphaned), passes are timed one by one in this process: CPU (``time.process_time``, the CPU
of any child the pass waited for, and that of the lease watchdog the agent spawned, from its
``/proc/PID/stat``) and wall time. Two agents run side by side, one pass of each per round:
the agent before issue #31, which walks ``/proc`` every pass (``--walk-every 1``), and the
lease-first agent (``--walk-every 10``, the default), whose steady passes rest on the write
leases and the last walk, and whose every tenth pass walks. The rounds are a whole number of
``--walk-every`` cycles, so the mean over them includes the periodic walks in their share.
The ``/proc`` walk on its own (``collect_holders`` for the pass's devices) is timed in the
same rounds, interleaved, to show its share.

Goal (issue #31): one steady-state pass <= 0.1 s of CPU. The cProfile of one more steady
lease-first pass (the top lines by own time) follows the table and is kept by ``make bench``,
so the next round starts from evidence. Every
holder and sleeper is ended and everything created unmounted and removed on the way out, also
on Ctrl-C or SIGTERM.

    .venv/bin/python bench/bench_agent.py [--quick] [--json FILE] [--pods N] [--processes N|+N]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from figures import (
    Row,
    compared,
    entry,
    interrupt_on_signals,
    plan_host,
    private_dir,
    profiled,
    report,
    signals_ignored,
)

from kvoffload.liveness import lease, watchdog
from kvoffload.liveness.events import PassReport
from kvoffload.liveness.holders import collect_holders
from kvoffload.liveness.scan import ScanOptions
from kvoffload.liveness.walks import DEFAULT_WALK_EVERY
from kvoffload.liveness.watch import WatchConfig, Watcher
from shmctl.render.watch import EventWriter
from shmctl.serve.state import WatchMetrics

BUDGET_S = 0.1
VOLUME = Path("volumes/kubernetes.io~empty-dir/dshm")
GLOB = "pods/*/volumes/kubernetes.io~empty-dir/*"
#: A live region: its base file and three segments; an orphaned one: a base and one segment.
LIVE_SEGMENTS = 3
ORPHAN_SEGMENTS = 1
#: Each pod volume's tmpfs (pages are allocated as written: one page a file here).
VOLUME_SIZE = "size=16m,mode=0700"

# One process (its own session) starts everything that runs during the bench, then blocks on
# stdin: EOF there (the bench closed it, or died) ends every child it forked, so none outlives
# the bench, even a SIGKILLed one. First a "crashed engine" creates the orphaned regions
# (owner record naming itself) and exits; then the sleepers fork, before anything is imported,
# each holding nothing and blocking on stdin; then one engine-like child per pod creates its
# live region, records itself as its owner, maps every file (libc mmap: Python's mmap would
# keep a dup of the fd), keeps the base's fd and closes the segments' fds.
_HOST = r"""# bench_agent host (in the command line of every process it starts)
import ctypes, gc, json, mmap, os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
plan = json.loads(sys.stdin.readline())
page = mmap.PAGESIZE
ready_r, ready_w = os.pipe()
children = []

def create(path, record):
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.write(fd, b"\0" * page)  # resident, as a region's pages are
    if record is not None:
        from kvoffload.shm.owner import write_owner
        write_owner(fd, record)
    return fd

def region(directory, engine, segments):
    from kvoffload.shm.owner import OwnerRecord
    record = OwnerRecord.for_current_process(engine)
    base = f"{directory}/vllm_offload_{engine}.mmap"
    paths = [base] + [f"{base}.{k}" for k in range(1, segments + 1)]
    return [create(path, record if path == base else None) for path in paths]

def fork(body):
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(ready_r)
            body()
            os.write(ready_w, b"r")
            while os.read(0, 4096):
                pass
            status = 0
        except BaseException as e:
            os.write(2, f"bench host child {os.getpid()}: {e}\n".encode())
            os.write(ready_w, b"e")
        finally:
            os._exit(status)
    children.append(pid)

crashed = os.fork()
if crashed == 0:
    try:
        for directory, engine in plan["orphans"]:
            for fd in region(directory, engine, plan["orphan_segments"]):
                os.close(fd)
    finally:
        os._exit(0)
if os.waitpid(crashed, 0)[1] != 0:
    print("failed", flush=True)
    sys.exit(1)
gc.freeze()  # the sleepers share the host's pages rather than copy them
for _ in range(plan["sleepers"]):
    fork(lambda: None)

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
c = ctypes
libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
failed = ctypes.c_void_p(-1).value
import kvoffload.shm.owner  # once, before the engines fork

def engine(directory, name):
    def hold():
        fds = region(directory, name, plan["live_segments"])
        for k, fd in enumerate(fds):
            rw = mmap.PROT_READ | mmap.PROT_WRITE
            if libc.mmap(None, page, rw, mmap.MAP_SHARED, fd, 0) in (None, failed):
                raise OSError(ctypes.get_errno(), "mmap")
            if k:
                os.close(fd)
    return hold

for directory, name in plan["engines"]:
    fork(engine(directory, name))
os.close(ready_w)
got = b""
while len(got) < len(children):
    chunk = os.read(ready_r, 65536)
    if not chunk:
        break
    got += chunk
print("ready" if got == b"r" * len(children) else "failed", flush=True)
while os.read(0, 4096):
    pass
for pid in children:
    os.waitpid(pid, 0)
"""


def host_processes() -> int:
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


def host(plan: dict[str, object]) -> contextlib.AbstractContextManager[None]:
    """The crashed engine's orphans, the sleepers and the engines of ``plan``, until exit."""
    return plan_host(_HOST, plan, "a sleeper or an engine could not start (see stderr)", wait_s=60)


@contextmanager
def volumes(work: Path, pods: int, mount: bool) -> Iterator[list[Path]]:
    """``pods`` kubelet emptyDir volumes below ``work``, each its own tmpfs when ``mount``."""
    made: list[Path] = []
    mounted: list[Path] = []
    try:
        for i in range(pods):
            volume = work / "pods" / f"{i:08x}-bench-pod" / VOLUME
            volume.mkdir(mode=0o700, parents=True)
            made.append(volume)
            if mount:
                done = subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", VOLUME_SIZE, "tmpfs", str(volume)],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if done.returncode != 0:
                    raise RuntimeError(f"cannot mount a tmpfs at {volume}: {done.stderr.strip()}")
                mounted.append(volume)
        yield made
    finally:
        with signals_ignored():
            for volume in mounted:
                if subprocess.run(["umount", str(volume)], check=False).returncode != 0:
                    subprocess.run(["umount", "-l", str(volume)], check=False)


def watcher(work: Path, walk_every: int) -> tuple[Watcher, Callable[[PassReport], None]]:
    """The agent ``shmctl watch --root GLOB --grace 0s --walk-every N`` runs, and its metrics' ``on_pass``."""
    config = WatchConfig(
        roots=(str(work / GLOB),), interval_s=60.0, scan=ScanOptions(grace_s=0.0), walk_every=walk_every
    )
    metrics = WatchMetrics(interval_s=config.interval_s, reaping=False)
    events = open(os.devnull, "w")  # noqa: SIM115 - open while the agent runs; closed with this process
    return Watcher(config, on_event=EventWriter(events)), metrics.record


def check(first: PassReport, pods: int, orphans: int) -> None:
    """The verdicts of the first pass, before any figure counts."""
    live = LIVE_SEGMENTS + 1
    dead = ORPHAN_SEGMENTS + 1
    roots = [r for r in first.roots if r.report is not None]
    summary = [r.report.summary for r in roots if r.report is not None]
    found = (len(roots), sum(s.live for s in summary), sum(s.orphaned for s in summary))
    expected = (pods, pods * live, orphans * dead)
    if found != expected:
        raise RuntimeError(
            f"the first pass saw {found[0]} roots, {found[1]} live and {found[2]} orphaned files; "
            f"expected {expected[0]}, {expected[1]} and {expected[2]}: the figures would time a wrong pass"
        )


def watchdog_cpu_s() -> float:
    """The lease watchdog's CPU so far (it polls all the time, a pass's leases or not)."""
    pid = watchdog.status().watchdog_pid
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_s() -> float:
    """This process's CPU, that of the children it waited for and the lease watchdog's, in seconds."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system + watchdog_cpu_s()


Agent = tuple[Watcher, Callable[[PassReport], None]]


def timed_pass(agent: Agent) -> tuple[float, float, PassReport]:
    """One pass: its CPU and wall time in ms, and its report."""
    cpu, wall = cpu_s(), time.perf_counter()
    done = agent[0].run_pass(on_pass=agent[1])
    return (cpu_s() - cpu) * 1e3, (time.perf_counter() - wall) * 1e3, done


def measure(before: Agent, lease_first: Agent, devices: set[int], rounds: int) -> dict[str, list[float]]:
    """``rounds`` rounds of a pass of each agent and one ``/proc`` walk alone, in ms.

    The lease-first agent's passes are sorted by whether they walked ``/proc``: ``steady`` (the
    leases decided) or ``walked``; ``all`` keeps every one of them, for the mean.
    """
    samples: dict[str, list[float]] = {
        k: [] for k in ("before", "before_wall", "steady", "steady_wall", "walked", "all", "walk", "share")
    }
    print(f"measuring: {rounds} rounds of a pass of each agent and a /proc walk alone", flush=True)
    walked = 0
    for _ in range(rounds):
        cpu, wall, _report = timed_pass(before)
        samples["before"].append(cpu)
        samples["before_wall"].append(wall)
        cpu, wall, report_ = timed_pass(lease_first)
        samples["all"].append(cpu)
        if report_.proc_walks:
            walked += 1
            samples["walked"].append(cpu)
        else:
            samples["steady"].append(cpu)
            samples["steady_wall"].append(wall)
        cpu = cpu_s()
        collect_holders(devices=devices)
        samples["walk"].append((cpu_s() - cpu) * 1e3)
    samples["share"] = [100.0 * walked / rounds]
    samples["mean"] = [sum(samples["all"]) / rounds]
    return samples


def rows(samples: dict[str, list[float]], pods: int, processes: int) -> list[Row]:
    budget_ms = BUDGET_S * 1e3
    setup = f"{pods:,} pod volumes, {processes:,} processes"
    every = DEFAULT_WALK_EVERY

    def against(figure: str, key: str, at_most: float | None) -> Row:
        return compared(
            figure,
            "ms",
            samples[key] or [math.nan],
            baseline=f"budget {BUDGET_S:g} s",
            base=budget_ms,
            at_most=at_most,
            goal=f"<= 1.0x budget ({BUDGET_S:g} s)" if at_most is not None else "",
            digits=1,
        )

    share = samples["share"]
    return [
        against(
            f"agent pass walking /proc every pass (before #31, --walk-every 1), {setup} (CPU)", "before", None
        ),
        against("agent pass walking /proc every pass (before #31) (wall)", "before_wall", None),
        against(f"agent steady-state pass, {setup} (CPU)", "steady", 1.0),
        against("agent steady-state pass (wall)", "steady_wall", None),
        against(f"agent pass that walks /proc (every {every}th, --walk-every {every}) (CPU)", "walked", None),
        against(f"agent mean pass over whole cycles of {every}, periodic walk included (CPU)", "mean", None),
        Row(
            "share of lease-first passes that walked /proc",
            "%",
            share[0],
            share[0],
            share[0],
            "",
            1.0,
            "",
            True,
        ),
        against(f"a /proc walk alone (collect_holders, {processes:,} processes) (CPU)", "walk", None),
    ]


def processes_wanted(text: str, running: int) -> int:
    """``--processes``: ``N`` on the host in all, or ``+N``, N more than ``running``."""
    try:
        n = int(text.removeprefix("+"))
    except ValueError:
        raise RuntimeError(f"--processes wants N or +N, not {text!r}") from None
    return running + n if text.startswith("+") else n


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="10 timed rounds instead of 20")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    parser.add_argument("--pods", type=int, default=100, help="pod volumes (default 100)")
    parser.add_argument(
        "--processes",
        default="2000",
        metavar="N|+N",
        help="processes on the host, those running included (default 2,000); +N: N more than now",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        help=f"timed rounds, a multiple of {DEFAULT_WALK_EVERY}; median shown (default 20; --quick 10)",
    )
    parser.add_argument("--no-mount", action="store_true", help="plain directories, not a tmpfs each")
    parser.add_argument("--profile-lines", type=int, default=10, help="cProfile lines in the profile (10)")
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="tmpfs to work in")
    args = parser.parse_args(argv)
    repeat = args.repeat or (10 if args.quick else 20)
    repeat = -(-repeat // DEFAULT_WALK_EVERY) * DEFAULT_WALK_EVERY  # whole cycles of walks
    mount = not args.no_mount and os.geteuid() == 0
    if not mount and not args.no_mount:
        print(
            "note: not root: the pod volumes are directories of one tmpfs, not a tmpfs each", file=sys.stderr
        )
    interrupt_on_signals()
    with ExitStack() as stack:
        work = stack.enter_context(private_dir(args.shm, "agent"))
        print(f"files in {work}", flush=True)
        pods = stack.enter_context(volumes(work, args.pods, mount))
        engines = [[str(v), f"pod{i:04d}-live"] for i, v in enumerate(pods)]
        orphans = [[str(v), f"pod{i:04d}-crashed"] for i, v in enumerate(pods) if i % 2 == 0]
        running = host_processes() + 2  # the host process and its crashed engine are not up yet
        sleepers = max(0, processes_wanted(args.processes, running) - running - len(engines))
        plan = {
            "orphans": orphans,
            "engines": engines,
            "sleepers": sleepers,
            "live_segments": LIVE_SEGMENTS,
            "orphan_segments": ORPHAN_SEGMENTS,
        }
        stack.enter_context(host(plan))
        processes = host_processes()
        before, lease_first = watcher(work, 1), watcher(work, DEFAULT_WALK_EVERY)
        with lease.sigio_ignored():  # as Watcher.run does, once for all its passes
            for agent, on_pass in (before, lease_first):
                check(agent.run_pass(on_pass=on_pass), len(pods), len(orphans))
            devices = {os.stat(v).st_dev for v in pods}
            samples = measure(before, lease_first, devices, repeat)
            # The next pass of the lease-first agent is a steady one (its walk was the last round's
            # or is rounds away): where the time of a pass that walks nothing goes.
            agent, on_pass = lease_first
            top = profiled(
                "cProfile of one steady pass (lease-first)",
                lambda: agent.run_pass(on_pass=on_pass),
                args.profile_lines,
            )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"{len(pods)} pod volumes ({'a tmpfs each' if mount else 'directories'}), {len(pods)} live regions "
        f"of {LIVE_SEGMENTS + 1} files, {len(orphans)} orphaned of {ORPHAN_SEGMENTS + 1}; {processes:,} "
        f"processes ({sleepers:,} sleepers); in-process passes, median of {repeat}; load average {load}"
    )
    return report(
        rows(samples, len(pods), processes),
        value="ms",
        digits=1,
        json_path=args.json,
        profile=top,
    )


if __name__ == "__main__":
    sys.exit(
        entry(main, "bench_agent", interrupted="its volumes are unmounted and removed, its processes ended")
    )
