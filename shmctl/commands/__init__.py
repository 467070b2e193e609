"""One module per command; each exposes ``register(app)``. Keep imports here cheap: the
command table is read without typer (``shmctl.launch``).

A command is built only when it is asked for (``build``): ``shmctl scan`` imports and builds
``scan`` alone, and a Tab completion of ``shmctl sc`` builds only the commands it names. Only
``shmctl --help`` (and the man page) builds all ten. Typer turns a command's signature
into click options when it builds it, so each command not built saves that and its imports.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Every command, in the order ``shmctl --help`` lists them, and the module declaring it.
MODULES = {
    "scan": "scan",
    "reap": "reap",
    "init": "init",
    "faults": "faults_cmd",
    "audit": "audit",
    "metrics": "metrics",
    "watch": "watch",
    "doctor": "doctor",
    "completion": "completion",
    "man": "man",
}


def build(name: str, *, rich_markup_mode: Any) -> Any:
    """The click command ``name`` (one of ``MODULES``), built as typer builds a group's commands.

    Through typer's public ``get_command`` on an app of that one command, so no private
    builder of typer's is relied on (shmctl runs under typer 0.26 to 0.29).
    """
    import typer

    from shmctl import helptext

    module = importlib.import_module(f"shmctl.commands.{MODULES[name]}")
    single = typer.Typer(rich_markup_mode=rich_markup_mode, pretty_exceptions_enable=False)
    module.register(single)
    single.callback()(_group)  # a group even with one command: its command is the one we want
    (info,) = single.registered_commands
    # Summaries and examples live in one table (shmctl.helptext), which --help, the man page and
    # the tests read; the commands' docstrings keep the longer description.
    info.short_help = info.short_help or helptext.SUMMARIES.get(name)
    examples = helptext.EXAMPLES.get(name)
    if examples and info.epilog is None:
        info.epilog = helptext.epilog(examples)
    group: Any = typer.main.get_command(single)
    return group.commands[name]


def _group() -> None:
    """Never run: makes typer build a group around the one command."""
