"""The ``shmctl`` console script: one Tab and the completion scripts answered without a CLI
framework, the rest by shmctl.app.

Shell completion runs shmctl on every Tab. Completing the command word under bash
(``shmctl sc<Tab>``) needs only the command names, and importing typer alone takes about
75 ms of the 100 ms such an answer may cost (on a busy machine, all of it). That case is
answered here from ``shmctl.commands.MODULES``, in typer's own bash format (one name per
line, no help text); tests compare it with typer's answer for every prefix. Anything else
(another shell, an option, a later word, a quoted word) goes to ``shmctl.app.main``, as before.

``shmctl completion bash`` (or zsh, fish) prints a static text (``shmctl.completion_scripts``),
and a shell's rc file runs it at every start (``source <(shmctl completion bash)``): it is
answered here too, with the same bytes as the ``completion`` command. Anything else about it
(``--help``, a shell it does not know, a write that fails) goes to ``shmctl.app.main``.
"""

from __future__ import annotations

import os
import sys

#: typer's completion variable for a program named shmctl, and its bash instruction.
_COMPLETE_VAR = "_SHMCTL_COMPLETE"
_BASH = "complete_bash"


def command_word_completions(environ: os._Environ[str] | dict[str, str]) -> list[str] | None:
    """The commands a bash completion of the command word offers, or None if it is not one."""
    if environ.get(_COMPLETE_VAR) != _BASH or environ.get("COMP_CWORD") != "1":
        return None
    line = environ.get("COMP_WORDS", "")
    if any(c in line for c in "\"'\\"):
        return None  # quoting: typer splits it as a shell would
    words = line.split()
    incomplete = words[1] if len(words) > 1 else ""
    if len(words) > 2 or (incomplete and not incomplete[0].isalnum()):
        return None  # the root's options (``-``) are typer's to list
    from shmctl.commands import MODULES

    return [name for name in MODULES if name.startswith(incomplete)]


def completion_script(argv: list[str], environ: os._Environ[str] | dict[str, str]) -> str | None:
    """What ``shmctl completion SHELL`` prints, or None if ``argv`` asks for anything else."""
    if len(argv) != 2 or argv[0] != "completion" or _COMPLETE_VAR in environ:
        return None
    from shmctl.completion_scripts import SCRIPTS

    return SCRIPTS.get(argv[1])


def _write_stdout(data: bytes) -> bool:
    """Write all of ``data`` to fd 1 unbuffered; False if that failed (nothing is left queued)."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(1, view) :]
    except BrokenPipeError:
        return True  # the reader has what it wanted: a quiet 0, as shmctl.app answers it
    except OSError:
        return False
    return True


def main() -> int:
    script = completion_script(sys.argv[1:], os.environ)
    if script is not None and _write_stdout(script.encode()):
        return 0
    # A write that failed (a full disk, a read-only fd) goes to shmctl.app, which meets the same
    # error and says so in its one line with the fix.
    names = command_word_completions(os.environ)
    if names is not None:
        if sys.stdout is not None:  # None: fd 1 closed, nobody to tell
            try:
                sys.stdout.write("\n".join(names) + "\n")
                sys.stdout.flush()
            except OSError:  # the shell went away
                pass
        return 0
    from shmctl.app import main as app_main

    return app_main()


def run() -> None:
    sys.exit(main())
