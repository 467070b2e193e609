"""``shmctl init``: rehearse an engine's CPU KV-offload bring-up with vLLM's own config.

``--engine vllm`` runs the same rehearsal with a real vLLM engine (``vllm.LLM`` with
kvoffload's spec) as its participants, instead of kvoffload's own processes.

Three modes, one library call each: ``--dry-run`` (the plan and a capacity pre-flight;
nothing is allocated), a real bring-up in world-size worker processes and a scheduler
process (optionally with a fault at a chosen stage), and ``--matrix`` (every stage x
every mode, each cell a fresh bring-up).

Exit status: 0 the contract held (or: it fits, every matrix cell passed); 1 residue left
behind, a crash left orphans, it does not fit, a matrix cell leaked (a crash cell's files
the reap kept included); 2 usage or configuration error; 3 init failed for a reason that
was not injected, a real bring-up whose root cannot hold the region (refused before any
process starts, by the dry run's rule), a matrix cell failed, the matrix stopped early or
its root cannot hold one cell; 130 Ctrl-C.
"""

from pathlib import Path
from typing import Annotated

import typer

from kvoffload.shm.names import DEFAULT_ROOT
from shmctl.options import (
    AssumeOption,
    GpuBlockSizeOption,
    JsonOption,
    KvBytesPerBlockOption,
    ModelOption,
    RootOption,
    WorldSizeOption,
)


def _complete_points(incomplete: str) -> list[str]:
    from kvoffload import faults

    return [name for name in faults.names() if name.startswith(incomplete)]


def _complete_modes(incomplete: str) -> list[str]:
    modes = ("raise", "oserror:EFAULT", "oserror:ENOSPC", "oserror:EIO", "crash", "cleanup-raise")
    return [mode for mode in modes if mode.startswith(incomplete)]


def complete_lifetimes(incomplete: str) -> list[str]:
    return [name for name in ("kvoffload", "vllm") if name.startswith(incomplete)]


def _complete_ranks(ctx: typer.Context, incomplete: str) -> list[str]:
    """``scheduler`` and the worker ranks of the ``--world-size`` typed so far."""
    world = ctx.params.get("world_size") or 1
    ranks = ["scheduler", *(str(r) for r in range(min(int(world), 1024)))]
    return [rank for rank in ranks if rank.startswith(incomplete)]


ENGINES = ("kvoffload", "vllm")


def complete_engines(incomplete: str) -> list[str]:
    return [name for name in ENGINES if name.startswith(incomplete)]


def init(
    kv_transfer_config: Annotated[
        str | None,
        typer.Option("--kv-transfer-config", metavar="JSON", help="vLLM's --kv-transfer-config, verbatim."),
    ] = None,
    config_file: Annotated[
        Path | None,
        typer.Option(
            "--config", metavar="FILE", help="The same JSON in a file, or TOML with the same keys (*.toml)."
        ),
    ] = None,
    world_size: WorldSizeOption = 1,
    kv_bytes_per_block: KvBytesPerBlockOption = None,
    model: ModelOption = None,
    gpu_block_size: GpuBlockSizeOption = 16,
    replicated_layout: Annotated[
        bool | None,
        typer.Option(
            "--replicated-layout/--no-replicated-layout",
            help="One copy per row for all workers (MLA). Default: from --model, else off.",
        ),
    ] = None,
    root: RootOption = DEFAULT_ROOT,
    lifetime: Annotated[
        str,
        typer.Option(
            "--lifetime",
            metavar="kvoffload|vllm",
            autocompletion=complete_lifetimes,
            help="kvoffload: unlinked once everyone mapped it. "
            "vllm: vLLM 0.33's tiering lifetime, kept while the engine lives.",
        ),
    ] = "kvoffload",
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", "-n", help="Allocate nothing: print the plan and the capacity pre-flight."),
    ] = False,
    roundtrip: Annotated[
        bool, typer.Option("--roundtrip/--no-roundtrip", help="Store and load one chunk per worker.")
    ] = True,
    hold: Annotated[bool, typer.Option("--hold", help="Keep the engine up until Ctrl-C.")] = False,
    fail_at: Annotated[
        list[str] | None,
        typer.Option(
            "--fail-at",
            metavar="STAGE",
            help="Inject a fault at this stage (see `shmctl faults`; secondary.N allowed). Repeatable.",
            autocompletion=_complete_points,
        ),
    ] = None,
    fail_mode: Annotated[
        list[str] | None,
        typer.Option(
            "--fail-mode",
            metavar="MODE",
            autocompletion=_complete_modes,
            help="raise | oserror:ERRNO | crash | cleanup-raise, optionally P% first. "
            "Repeatable with --matrix.",
        ),
    ] = None,
    rank: Annotated[
        str | None,
        typer.Option(
            "--rank",
            metavar="R|scheduler",
            autocompletion=_complete_ranks,
            help="Aim the fault at worker R or the scheduler only.",
        ),
    ] = None,
    seed: Annotated[
        int | None, typer.Option("--seed", metavar="N", help="Seed for P% modes (printed when chosen).")
    ] = None,
    matrix: Annotated[
        bool, typer.Option("--matrix", help="Every stage x every raise-type mode, a fresh bring-up per cell.")
    ] = False,
    include_crash: Annotated[
        bool, typer.Option("--include-crash", help="With --matrix: crash cells too, then scan and reap.")
    ] = False,
    assume_not_holding: AssumeOption = None,
    timeout: Annotated[
        str,
        typer.Option(
            "--timeout", metavar="DURATION", help="Kill a participant silent for this long (60s, 5m)."
        ),
    ] = "60s",
    engine_kind: Annotated[
        str,
        typer.Option(
            "--engine",
            metavar="kvoffload|vllm",
            autocompletion=complete_engines,
            help="Who runs the stages: kvoffload's own worker and scheduler processes, "
            "or a real vLLM engine (vllm.LLM) loaded with kvoffload's spec.",
        ),
    ] = "kvoffload",
    start_timeout: Annotated[
        str,
        typer.Option(
            "--start-timeout",
            metavar="DURATION",
            help="With --engine vllm: kill an engine not up after this long (5m, 300s).",
        ),
    ] = "300s",
    json_output: JsonOption = False,
) -> None:
    """Plan, bring up and tear down CPU KV offload the way vLLM does, with faults at any stage."""
    from kvoffload import bringup
    from kvoffload.bringup.inputs import load_config
    from kvoffload.bringup.plan import check_world_size
    from kvoffload.durations import parse_duration
    from kvoffload.errors import ConfigError
    from shmctl.exit import ExitStatus
    from shmctl.render import init as render

    if lifetime not in ("kvoffload", "vllm"):
        raise ConfigError("--lifetime", f"{lifetime!r} is neither 'kvoffload' nor 'vllm'")
    if engine_kind not in ENGINES:
        raise ConfigError("--engine", f"{engine_kind!r} is neither 'kvoffload' nor 'vllm'")
    check_world_size(world_size)
    model_dir: str | None = None
    if engine_kind == "vllm":
        from kvoffload.bringup.vllm_inputs import model_kv_bytes_per_block, vllm_usage

        vllm_usage(model=model, kv_bytes_per_block=kv_bytes_per_block, matrix=matrix)
        model_dir, model = model, None
        kv_bytes_per_block = model_kv_bytes_per_block(model_dir or "", gpu_block_size, world_size)
    config = load_config(
        kv_transfer_config=kv_transfer_config,
        config_file=config_file,
        kv_bytes_per_block=kv_bytes_per_block,
        model=model,
        world_size=world_size,
        gpu_block_size=gpu_block_size,
        replicated_layout=replicated_layout,
        root=root,
        lifetime="vllm" if lifetime == "vllm" else "kvoffload",
    )
    target = bringup.parse_target(rank)
    modes = fail_mode or []
    if not matrix and len(modes) > 1:
        raise ConfigError("--fail-mode", "give one mode (several only with --matrix)")
    if (modes or target is not None) and not (fail_at or matrix):
        raise ConfigError("--fail-at", "--fail-mode and --rank aim a fault, so they need --fail-at")
    if include_crash and not matrix:
        raise ConfigError("--include-crash", "only with --matrix (for one crash: --fail-mode crash)")
    if matrix and (dry_run or hold):
        raise ConfigError("--matrix", "cannot be combined with --dry-run or --hold")
    idle_timeout_s = parse_duration(timeout, option="--timeout")
    start_timeout_s = parse_duration(start_timeout, option="--start-timeout")
    if not json_output:
        render.warnings(config.warnings)

    if dry_run:
        the_plan = bringup.plan(config)
        bringup.build_fault_plan(the_plan, fail_at or (), modes[0] if modes else "raise", target, seed)
        if fail_at:
            render.dry_run_injects_nothing(fail_at)
        render.plan(the_plan, json_output=json_output)
        raise typer.Exit(ExitStatus.OK if the_plan.capacity.fits else ExitStatus.FINDINGS)

    if matrix:
        with render.matrix_progress(json_output=json_output) as on_cell:
            report = bringup.run_matrix(
                config,
                stages=fail_at or None,
                modes=modes or bringup.DEFAULT_MODES,
                include_crash=include_crash,
                target_rank=target,
                seed=seed,
                idle_timeout_s=idle_timeout_s,
                on_cell=on_cell,
                assume_not_holding=frozenset(assume_not_holding or ()),
            )
        render.matrix(report, json_output=json_output)
        if report.leaked:
            raise typer.Exit(ExitStatus.FINDINGS)
        raise typer.Exit(ExitStatus.RUNTIME if report.failed or report.stopped else ExitStatus.OK)

    # The same rehearsal, whoever its participants are: kvoffload's processes or a vLLM engine.
    if model_dir is None:
        starting = f"starting {world_size} worker(s) and the scheduler for engine {config.engine_id}"
    else:
        starting = f"starting vLLM ({model_dir}) with kvoffload's spec for engine {config.engine_id}"
    request = bringup.BringUpRequest(
        config,
        fail_at=fail_at or (),
        fail_mode=modes[0] if modes else "raise",
        target_rank=target,
        seed=seed,
        roundtrip=roundtrip,
        hold=render.announce_hold if hold else None,
        idle_timeout_s=idle_timeout_s,
    )
    with render.progress(json_output=json_output, starting=starting) as on_progress:
        if model_dir is None:
            result = bringup.bring_up(request, progress=on_progress)
        else:
            result = bringup.bring_up_vllm(request, model=model_dir, start_timeout_s=start_timeout_s)
    render.init_report(result, json_output=json_output)
    raise typer.Exit(EXIT_STATUS[str(result.verdict)])


#: Verdict -> exit status: leaks and orphans are findings; an uninjected failure is a runtime error.
EXIT_STATUS = {
    "ok": 0,
    "contract-held": 0,
    "not-fired": 0,
    "leaked": 1,
    "orphaned": 1,
    "failed": 3,
}


def register(app: typer.Typer) -> None:
    app.command("init")(init)
