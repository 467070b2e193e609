"""The options more than one command takes, declared once: each flag, its help, its completion.

A command names an option by its type (``root: RootOption = DEFAULT_ROOT``); Typer reads the
flag from the ``Annotated`` metadata when it builds the command. Where two commands share a
flag but say different things about it (``init`` sizes its own engine, ``doctor --plan`` a
planned one), both declarations are here, side by side, built by one function so that the
flag, its bounds and its completion cannot drift apart.

The scan's flags become the library's ``ScanOptions`` in ``scan_options``: a new scan
setting is a field of ``ScanOptions``, an option here and a keyword of ``scan_options``.
Keep imports cheap: every command imports this module when it is built (a Tab press builds
the commands it completes).
"""

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvoffload.presets import PRESETS
from kvoffload.shm.families import ALL_WORD, FAMILY_NAMES

if TYPE_CHECKING:
    from kvoffload.liveness.scan import ScanOptions


def _root_path(text: str | Path) -> Path:
    # Path("") is ".": an empty --root (or SHMCTL_ROOT='') would judge the current directory.
    if isinstance(text, str) and not text.strip():
        raise typer.BadParameter("is empty (it would mean the current directory); pass --root /dev/shm")
    return Path(text)


#: Where ``ctx.meta`` keeps the root a command was given and where it came from: the app
#: names the root in an error the way the operator gave it (``SHMCTL_ROOT=/nope``, ``--root``).
ROOT_ORIGIN = "shmctl.root_origin"


def _note_root_origin(ctx: typer.Context, param: typer.CallbackParam, value: Path | None) -> Path | None:
    source = ctx.get_parameter_source(param.name) if param.name else None
    if value is not None and source is not None:
        ctx.meta[ROOT_ORIGIN] = (source.name, value)  # meta is shared with the root's context
    return value


def root_origin_label(meta: dict[str, Any], root: Path) -> tuple[str, str] | None:
    """How the operator gave ``root``: ``("SHMCTL_ROOT=/nope", "environment")`` or
    ``("--root /nope", "option")``; None for the default, or for another path."""
    origin = meta.get(ROOT_ORIGIN)
    if origin is None or Path(origin[1]) != Path(root):
        return None
    source, value = origin
    if source == "ENVIRONMENT":
        return f"SHMCTL_ROOT={value}", "environment"
    if source == "COMMANDLINE":
        return f"--root {value}", "option"
    return None


RootOption = Annotated[
    Path,
    typer.Option(
        "--root",
        envvar="SHMCTL_ROOT",
        metavar="PATH",
        help="Directory holding the region files.",
        show_default=True,
        # The library reports an unreadable root (exit 3, with a fix); click's own path check
        # would make it a usage error (exit 2) without one.
        parser=_root_path,
        callback=_note_root_origin,
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]

# -- the scan's settings (scan, reap, metrics, watch) -------------------------------------------

GraceOption = Annotated[
    str,
    typer.Option(
        "--grace",
        metavar="DURATION",
        help="Files changed more recently than this are 'starting', never orphaned (30s, 5m, 1h30m).",
    ),
]
AllUsersOption = Annotated[
    bool,
    typer.Option(
        "--all-users",
        help="Judge every user's files: root's default, so a no-op for root; refused to other users.",
    ),
]
#: ``reap`` and ``watch``: root judges every user's files anyway; the flag is what removes them.
RemoveAllUsersOption = Annotated[
    bool,
    typer.Option(
        "--all-users",
        help=(
            "Also remove other users' orphaned files (root only). Without it root judges them "
            "and leaves them, saying so."
        ),
    ),
]
OwnOnlyOption = Annotated[
    bool,
    typer.Option("--own-only", help="Judge only your own files, even as root (others' are skipped)."),
]
AssumeOption = Annotated[
    list[int] | None,
    typer.Option(
        "--assume-not-holding",
        metavar="PID",
        help=(
            "Vouch that PID maps no region although it cannot be inspected. Repeatable. Needed only "
            "where no write lease can be taken (--no-lease, another uid's files without root)."
        ),
    ),
]
NoLeaseOption = Annotated[
    bool,
    typer.Option(
        "--no-lease",
        envvar="SHMCTL_NO_LEASE",
        help=(
            "Do not take write leases: judge from /proc, locks and owner records alone "
            "(fail-closed: what they cannot prove stays unknown)."
        ),
    ),
]


def complete_families(incomplete: str) -> list[str]:
    return [name for name in (*FAMILY_NAMES, ALL_WORD) if name.startswith(incomplete)]


FamilyOption = Annotated[
    list[str] | None,
    typer.Option(
        "--family",
        metavar="NAME",
        help=(
            f"Judge the files of family NAME: {' | '.join(FAMILY_NAMES)} | {ALL_WORD}. Repeatable. "
            "Default: offload (vLLM's region files) only. See docs/families.md."
        ),
        autocompletion=complete_families,
    ),
]


def whose_files(all_users: bool, own_only: bool) -> bool | None:
    """``--all-users`` and ``--own-only`` as the library's ``all_users``: True, False, or None
    (the default: every user's files as root, your own otherwise)."""
    import os

    from kvoffload.errors import ConfigError

    if all_users and own_only:
        raise ConfigError(
            "--own-only", "cannot be combined with --all-users", fix="pass one of them, or neither"
        )
    if all_users and os.geteuid() != 0:
        # Said here with the flag's name: the library's own refusal names its parameter.
        raise ConfigError(
            "--all-users", "only root may judge other users' files", fix="run as root, or drop --all-users"
        )
    return True if all_users else False if own_only else None


def scan_options(
    grace_s: float,
    *,
    all_users: bool,
    own_only: bool,
    assume_not_holding: list[int] | None,
    no_lease: bool,
    family: list[str] | None = None,
) -> "ScanOptions":
    """The scan flags (``--grace`` parsed, ``--family`` checked) as the library's ``ScanOptions``."""
    from kvoffload.liveness.scan import ScanOptions
    from kvoffload.shm.families import select

    return ScanOptions(
        grace_s=grace_s,
        all_users=whose_files(all_users, own_only),
        assume_not_holding=frozenset(assume_not_holding or ()),
        use_lease=not no_lease,
        families=select(family or ()),
    )


# -- tables (scan, reap) -----------------------------------------------------------------------

BytesOption = Annotated[
    bool, typer.Option("--bytes", help="Print sizes as exact integers of bytes, not KiB/MiB/GiB.")
]
NoHeadersOption = Annotated[
    bool, typer.Option("--no-headers", help="Print rows only: no header line (the summary is on stderr).")
]

# -- sizing an engine: init's own, doctor's planned ones (--plan) ------------------------------


def complete_presets(incomplete: str) -> list[str]:
    return [name for name in PRESETS if name.startswith(incomplete)]


def _kv_bytes_per_block(help: str) -> Any:
    return typer.Option("--kv-bytes-per-block", min=1, metavar="BYTES", help=help)


def _model(metavar: str, help: str) -> Any:
    return typer.Option("--model", metavar=metavar, help=help, autocompletion=complete_presets)


def _world_size(help: str) -> Any:
    return typer.Option("--world-size", min=1, metavar="N", help=help)


def _gpu_block_size(help: str) -> Any:
    return typer.Option("--gpu-block-size", min=1, metavar="TOKENS", help=help)


KvBytesPerBlockOption = Annotated[
    int | None,
    _kv_bytes_per_block(
        "KV bytes one worker holds per GPU block, all layers (vLLM's worker_kv_bytes_per_block)."
    ),
]
ModelOption = Annotated[
    str | None,
    _model(
        "MODEL",
        f"Compute --kv-bytes-per-block for a well-known model: {' | '.join(PRESETS)}. "
        "With --engine vllm: the local Hugging Face model directory the engine loads.",
    ),
]
WorldSizeOption = Annotated[int, _world_size("Workers (tensor x pipeline parallel size).")]
GpuBlockSizeOption = Annotated[int, _gpu_block_size("Tokens per GPU block (vLLM --block-size).")]

PlanKvBytesPerBlockOption = Annotated[
    int | None, _kv_bytes_per_block("With --plan: KV bytes one worker holds per GPU block, all layers.")
]
PlanModelOption = Annotated[
    str | None,
    _model("PRESET", f"With --plan: the bytes per block of a well-known model: {' | '.join(PRESETS)}."),
]
PlanWorldSizeOption = Annotated[int, _world_size("With --plan: workers per engine.")]
PlanGpuBlockSizeOption = Annotated[int, _gpu_block_size("With --plan: tokens per GPU block.")]
