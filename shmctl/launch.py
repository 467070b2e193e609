"""The ``shmctl`` console script: help, the fixed Tab completions and the completion scripts
answered without a CLI framework, the rest by shmctl.app.

Shell completion runs shmctl on every Tab. Completing the command word under bash
(``shmctl sc<Tab>``) needs only the command names, and importing typer alone takes about
75 ms of the 100 ms such an answer may cost (on a busy machine, all of it). That case is
answered here from ``shmctl.commands.MODULES``, in typer's own bash format (one name per
line, no help text); tests compare it with typer's answer for every prefix. Another shell, a
quoted word, or a Tab the answers below do not cover goes to ``shmctl.app.main``, as before.

``shmctl completion bash`` (or zsh, fish) prints a static text (``shmctl.completion_scripts``),
and a shell's rc file runs it at every start (``source <(shmctl completion bash)``): it is
answered here too, with the same bytes as the ``completion`` command. Anything else about it
(``--help``, a shell it does not know, a write that fails) goes to ``shmctl.app.main``.

``shmctl --help``, ``shmctl CMD --help`` (``-h``, or a bare ``shmctl``), a Tab that lists a
command's options (``shmctl scan --<Tab>``) and one that completes an option's value from a
fixed list (``--family``, ``--color``) or from nothing (``--root``, ``--grace``) print what
typer rendered for them, kept in ``shmctl.answers`` by ``shmctl.prerender``: typer's import and
the command's build are most of such a run (issue #31). They are printed only while the
answers' fingerprint matches the sources they were rendered from, and help only at the width
click renders at 80 columns or more; anything else is typer's to answer, as before.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing's own costs 2 ms of a 26 ms answer
if TYPE_CHECKING:
    from typing import Any

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


_HELP_FLAGS = ("--help", "-h")


def _columns(environ: os._Environ[str] | dict[str, str]) -> int:
    """The terminal's columns as click's help formatter reads them (``shutil.get_terminal_size``,
    whose import alone would cost 4 ms of the answer): COLUMNS if a positive number, else stdout's
    terminal, else 80."""
    try:
        columns = int(environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 80
        columns = columns or 80
    return columns


def _typer_init() -> str:
    """The ``typer/__init__.py`` that importing typer would load (the first on sys.path)."""
    for entry in sys.path:
        path = os.path.join(entry or os.curdir, "typer", "__init__.py")
        if os.path.isfile(path):
            return path
    return os.devnull  # no typer: shmctl.app will say so; no answer matches this


def _answers() -> Any:
    """``shmctl.answers`` if it is current (rendered from these very sources, by the typer that
    would be imported), else None."""
    import zlib

    try:
        from shmctl import answers
    except ImportError:  # a build that left it out: typer answers everything
        return None
    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    crc = 0
    try:
        for path in (*(os.path.join(top, source) for source in answers.SOURCES), _typer_init()):
            with open(path, "rb") as f:
                crc = zlib.crc32(f.read(), crc)
    except OSError:  # sources not installed (bytecode only): nothing to check them against
        return None
    return answers if crc == answers.FINGERPRINT else None


def prerendered_help(argv: list[str], environ: os._Environ[str] | dict[str, str]) -> str | None:
    """What ``shmctl --help`` (or ``CMD --help``, ``-h``, a bare ``shmctl``) prints, if kept."""
    if _COMPLETE_VAR in environ:
        return None
    if not argv or (len(argv) == 1 and argv[0] in _HELP_FLAGS):
        path: tuple[str, ...] = ()
    elif len(argv) == 2 and argv[1] in _HELP_FLAGS and argv[0] not in _HELP_FLAGS:
        path = (argv[0],)
    else:
        return None
    # click wraps help at min(columns, 80) - 2: below 80 columns it is another text.
    if _columns(environ) < 80:
        return None
    answers = _answers()
    return None if answers is None else answers.HELP.get(path)


def prerendered_completions(environ: os._Environ[str] | dict[str, str]) -> list[str] | None:
    """A bash completion's answer if it is a kept one: a command's (or the root's) options,
    ``shmctl scan --json --<Tab>``, or an option's value from a fixed list (or none),
    ``shmctl scan --family <Tab>``; None for anything else (typer's to answer).
    """
    if environ.get(_COMPLETE_VAR) != _BASH:
        return None
    line = environ.get("COMP_WORDS", "")
    if any(c in line for c in "\"'\\"):
        return None  # quoting: typer splits it as a shell would
    try:
        cword = int(environ.get("COMP_CWORD", ""))
    except ValueError:
        return None
    words = line.split()
    if cword < 1 or len(words) > cword + 1:
        return None  # words after the cursor: typer's to weigh
    args = tuple(words[1:cword])
    incomplete = words[cword] if cword < len(words) else ""
    option = incomplete.startswith("-")
    if option and "=" in incomplete:
        return None  # ``--color=al``: click completes the value inside the word
    answers = _answers()
    if answers is None:
        return None
    if args and args[0] in answers.GIVEN:
        resolved = _given(args[1:], answers.GIVEN[args[0]])
        if resolved is None:
            return None
        typing_value_of, used, values = resolved
        engines = answers.ENGINES.get((args[0], typing_value_of))
        if engines is not None and not option:
            # The engine ids of the root these words name, listed as the command's completion does.
            from kvoffload.shm.names import engine_ids

            root_opts, envvar, default = engines
            given_root = next((value for o, value in reversed(values) if o in root_opts), None)
            return engine_ids(given_root or environ.get(envvar) or default, incomplete)
        if option:
            if typing_value_of is not None:
                return None  # click lists options here, from a parse that stopped short of it
            # click offers an option given already only if it may be repeated
            given = answers.GIVEN[args[0]]
            kept = [o for o in answers.OPTIONS[args[:1]] if given[o][2] or given[o][0] not in used]
        else:
            kept = answers.VALUES.get(args[:1] if typing_value_of is None else (args[0], typing_value_of))
    elif len(args) <= 1:  # the root's options, or the value of one of them
        kept = (answers.OPTIONS if option else answers.VALUES).get(args)
    else:
        return None
    return None if kept is None else [item for item in kept if item.startswith(incomplete)]


def _given(
    words: tuple[str, ...], table: dict[str, tuple[int, bool, bool]]
) -> tuple[str | None, set[int], list[tuple[str, str]]] | None:
    """The option whose value the Tab completes (None: an option or the first argument), the
    options ``words`` gave and the values given, in order, as click's parser reads a command's
    words; None where they hold more than options and their values (an argument, ``--``, a short
    cluster, a value like an option)."""
    used: set[int] = set()
    values: list[tuple[str, str]] = []
    i = 0
    while i < len(words):
        name, equals, value = words[i].partition("=") if words[i].startswith("--") else (words[i], "", "")
        found = table.get(name)
        if found is None:
            return None
        index, takes_value, _ = found
        if equals and not takes_value:
            return None
        used.add(index)
        if takes_value and not equals:
            if i + 1 == len(words):
                return name, used, values
            if words[i + 1].startswith("-"):
                return None
            i += 1
            value = words[i]
        if takes_value:
            values.append((name, value))
        i += 1
    return None, used, values


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
    text = prerendered_help(sys.argv[1:], os.environ)
    if text is not None and _write_stdout(text.encode()):
        return 0
    names = command_word_completions(os.environ)
    if names is None:
        names = prerendered_completions(os.environ)
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
    try:
        code = main()
    except KeyboardInterrupt:
        # Ctrl-C during an answer given here (help, a Tab), or while shmctl.app is imported:
        # shmctl.app's own handling is not in place yet. Its one line and its exit status.
        try:  # noqa: SIM105 (contextlib is an import this path does not pay)
            os.write(2, b"shmctl: error: interrupted\n")
        except OSError:
            pass
        os._exit(130)
    sys.exit(code)
