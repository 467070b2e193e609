"""``shmctl completion SHELL``: print the completion script for bash, zsh or fish.

The script is exactly the file the wheel installs for that shell (completions/ in a checkout),
so ``source <(shmctl completion bash)`` works from any venv or pipx, wherever its ``share`` is.
The texts are data (``shmctl.completion_scripts``); ``shmctl.launch`` prints them without
building this command, and this command is what ``--help``, a wrong shell name and the Tab of
``shmctl completion <Tab>`` meet.
"""

import sys
from typing import Annotated

import typer

from kvoffload.errors import ConfigError
from shmctl.completion_scripts import SCRIPTS, SHELLS


def _complete_shell(incomplete: str) -> list[str]:
    return [shell for shell in SHELLS if shell.startswith(incomplete)]


def completion(
    shell: Annotated[
        str,
        typer.Argument(
            metavar="SHELL",
            autocompletion=_complete_shell,
            show_default=False,
            help="bash, zsh or fish.",
        ),
    ],
) -> None:
    """Print the completion script for SHELL on stdout: the same file the wheel installs for it.

    Every Tab runs shmctl itself, so what it offers is live (engine ids in the root, fault
    points). Load it in bash with `source <(shmctl completion bash)` in ~/.bashrc; in zsh save it
    as _shmctl in a directory on $fpath before compinit (or source it after compinit); in fish
    pipe it to `source` in ~/.config/fish/config.fish.
    """
    script = SCRIPTS.get(shell)
    if script is None:
        choices = ", ".join(SHELLS)
        raise ConfigError(
            "completion",
            f"no script for the shell {shell!r}",
            fix=f"name one of {choices}: `shmctl completion bash`",
        )
    sys.stdout.write(script)


def register(app: typer.Typer) -> None:
    app.command("completion")(completion)
