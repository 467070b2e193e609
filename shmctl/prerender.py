"""Render, through typer, the answers that ``shmctl.launch`` then gives without it.

``shmctl --help`` (and each command's), and the Tab presses that list a command's options or
complete an option's value from a fixed list, print the same bytes on every run: typer renders
them from declarations that change only when the code does. Importing typer and building the
commands costs ~50 ms of such a run's ~80 (issue #31); the answers, rendered once here and kept
in ``shmctl/answers.py``, cost a dict lookup.

What makes a kept answer safe to print:

* it is exactly what ``shmctl.app.main`` prints for the request (rendered by calling it here);
* ``answers.FINGERPRINT`` is a checksum of every source file that was imported while rendering
  (shmctl's and kvoffload's modules, listed in ``answers.SOURCES``) and of typer's
  ``__init__.py`` (which names its version); ``shmctl.launch`` checks it before using any
  answer, so an edit to a command, an option or a help text, or another typer (vLLM's images
  carry their own), makes it fall back to typer (correct, only slower) until this module is
  run again;
* help is kept for the width click uses at 80 columns or more (``shmctl.launch`` falls back on a
  narrower terminal, or a ``COLUMNS`` below 80), and value completions only for options whose
  answer cannot depend on the machine: no completion at all, or one of ``STATIC_COMPLETIONS``.

Run ``python -m shmctl.prerender`` after changing a command's options or help;
``python -m shmctl.prerender --check`` exits 1 when ``shmctl/answers.py`` is stale (a test runs it).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The help requests kept: the root's and each command's, as the operator types them.
HELP_FLAGS = ("--help", "-h")

#: Autocompletion functions whose answer is a prefix filter of a fixed list, by qualified name.
STATIC_COMPLETIONS = frozenset(
    {
        "shmctl.options.complete_families",
        "shmctl.options.complete_presets",
        "shmctl.app._complete_color",
        "shmctl.commands.init._complete_points",
        "shmctl.commands.init._complete_modes",
        "shmctl.commands.init.complete_lifetimes",
        "shmctl.commands.init.complete_engines",
        "shmctl.commands.completion._complete_shell",
    }
)

#: Value types whose completion answers nothing, whatever is typed: click's base type (strings,
#: numbers, shmctl's parsers) and typer's own Path (``TyperPath``: typer 0.28 leaves paths to the
#: shell's own file completion).
SILENT_TYPES = frozenset(
    {"typer._click.types.ParamType.shell_complete", "typer.models.TyperPath.shell_complete"}
)

#: Autocompletion functions that list the engine ids of the command's root
#: (``kvoffload.shm.names.engine_ids``): shmctl.launch lists them itself, from the root the words
#: before the Tab give (or the root option's environment variable, or its default).
ENGINE_COMPLETIONS = frozenset({"shmctl.commands.reap._complete_engines"})

#: Where the generated module lives, and the directory its SOURCES are relative to.
PACKAGE = Path(__file__).resolve().parent
TOP = PACKAGE.parent
ANSWERS = PACKAGE / "answers.py"
#: Not sources of any answer: the reader of the answers, the answers, and this renderer.
NOT_SOURCES = frozenset({"shmctl/launch.py", "shmctl/answers.py", "shmctl/prerender.py"})


def fingerprint(top: str, sources: tuple[str, ...], typer_init: str) -> int:
    """CRC-32 of the sources' contents, in order, then of typer's ``__init__.py``
    (``shmctl.launch`` computes the same)."""
    crc = 0
    for path in (*(os.path.join(top, source) for source in sources), typer_init):
        with open(path, "rb") as f:
            crc = zlib.crc32(f.read(), crc)
    return crc


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _typers_answer(argv: list[str], **environ: str) -> str:
    """What ``shmctl.app.main(argv)`` prints on stdout at 80 columns; its exit status must be 0."""
    from shmctl.app import main

    out = io.StringIO()
    with _environment(COLUMNS="80", LINES="24", **environ), contextlib.redirect_stdout(out):
        code = main(argv)
    if code != 0:
        raise RuntimeError(f"shmctl {' '.join(argv)} exited {code} while rendering")
    return out.getvalue()


def complete(words: str, cword: int) -> list[str]:
    """Typer's bash answer for ``COMP_WORDS=words COMP_CWORD=cword``, one item a line."""
    text = _typers_answer([], _SHMCTL_COMPLETE="complete_bash", COMP_WORDS=words, COMP_CWORD=str(cword))
    return text.removesuffix("\n").split("\n") if text != "\n" else []


def _functions_in(function: Any, seen: set[int] | None = None) -> Iterator[Any]:
    """``function`` and every function its closures hold (typer wraps an autocompletion twice)."""
    seen = set() if seen is None else seen
    if not callable(function) or id(function) in seen:
        return
    seen.add(id(function))
    yield function
    for cell in getattr(function, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            yield from _functions_in(cell.cell_contents, seen)


def _completion_names(param: Any) -> set[str]:
    custom = getattr(param, "_custom_shell_complete", None)
    functions = _functions_in(custom) if custom is not None else iter(())
    return {f"{f.__module__}.{f.__qualname__}" for f in functions if hasattr(f, "__qualname__")}


def _static_completion(param: Any) -> bool:
    """Whether ``param``'s value completion is the same on every machine and every run."""
    custom = getattr(param, "_custom_shell_complete", None)
    if custom is None:
        # No autocompletion: the type's own. Click's File, Choice and Path answer something
        # (the word typed, or choices): left to typer.
        complete = getattr(type(param.type), "shell_complete", None)
        return f"{complete.__module__}.{complete.__qualname__}" in SILENT_TYPES if complete else False
    return bool(_completion_names(param) & STATIC_COMPLETIONS)


def _help_flags_in_order(names: list[str]) -> tuple[str, ...]:
    """``names`` with -h before --help: typer lists the two in either order from run to run
    (both orders are its answer), and a kept answer must not change with the run."""
    flags = iter(flag for flag in HELP_FLAGS[::-1] if flag in names)
    return tuple(next(flags) if name in HELP_FLAGS else name for name in names)


def _option_table(params: list[Any]) -> dict[str, tuple[int, bool, bool]] | None:
    """Each option name of a command: (its option's index, takes a value, may be repeated), for
    ``shmctl.launch`` to tell which options the words before the Tab gave (click offers an option
    given once no more). None where click's parser does more than that emulation knows: a value of
    several words, an optional value, a counter."""
    table = {}
    for index, param in enumerate(params):
        if param.param_type_name != "option" or param.hidden:
            continue
        if param.nargs != 1 or param.count or getattr(param, "_flag_needs_value", False):
            return None
        for opt in (*param.opts, *param.secondary_opts):
            table[opt] = (index, not param.is_flag, bool(param.multiple))
    return dict(sorted(table.items()))  # the help option lists -h and --help in either order


def render() -> dict[str, Any]:
    """Every kept answer, rendered by typer, and the fingerprint of what they were rendered from."""
    import typer.main

    from shmctl import commands
    from shmctl.app import app

    root = typer.main.get_command(app)
    ctx = root.make_context("shmctl", [], resilient_parsing=True)
    help_texts: dict[tuple[str, ...], str] = {(): _typers_answer(["--help"])}
    options: dict[tuple[str, ...], tuple[str, ...]] = {}
    values: dict[tuple[str, ...], tuple[str, ...]] = {}
    given: dict[str, dict[str, tuple[int, bool, bool]]] = {}
    engines: dict[tuple[str, str], tuple[tuple[str, ...], str, str]] = {}
    for name in [None, *commands.MODULES]:
        path = () if name is None else (name,)
        command = root if name is None else root.get_command(ctx, name)  # type: ignore[attr-defined]
        if name is not None:
            help_texts[path] = _typers_answer([name, "--help"])
        words = " ".join(("shmctl", *path))
        options[path] = _help_flags_in_order(complete(f"{words} -", len(path) + 1))
        params: list[Any] = command.get_params(ctx)
        if name is not None and (table := _option_table(params)) is not None:
            given[name] = table
        arguments = [param for param in params if param.param_type_name == "argument"]
        if (
            name is not None
            and len(arguments) == 1
            and arguments[0].nargs == 1
            and _static_completion(arguments[0])
        ):
            values[path] = tuple(complete(f"{words} ", len(path) + 1))
        roots = [p for p in params if p.name == "root" and p.param_type_name == "option" and not p.multiple]
        for param in params:
            if param.param_type_name != "option" or param.is_flag or param.hidden or param.count:
                continue
            if name is not None and roots and _completion_names(param) & ENGINE_COMPLETIONS:
                (root_param,) = roots
                for opt in param.opts:
                    engines[(name, opt)] = (
                        tuple(root_param.opts),
                        root_param.envvar,
                        str(root_param.default),
                    )
                continue
            if not _static_completion(param):
                continue
            answer = tuple(complete(f"{words} {param.opts[0]} ", len(path) + 2))
            for opt in (*param.opts, *param.secondary_opts):
                values[(*path, opt)] = answer
    sources = tuple(
        sorted(
            source
            for module in list(sys.modules.values())
            if (file := getattr(module, "__file__", None))
            and Path(file).resolve().is_relative_to(TOP)
            and (source := Path(file).resolve().relative_to(TOP).as_posix()).split("/")[0]
            in ("shmctl", "kvoffload")
            and source not in NOT_SOURCES
        )
    )
    # Written by shmctl.launch as UTF-8 bytes; click would encode for the locale: ASCII is both.
    help_texts = {path: text for path, text in help_texts.items() if text.isascii()}
    return {
        "SOURCES": sources,
        "FINGERPRINT": fingerprint(str(TOP), sources, str(typer.__file__)),
        "TYPER_VERSION": typer.__version__,
        "HELP": help_texts,
        "OPTIONS": options,
        "VALUES": values,
        "GIVEN": given,
        "ENGINES": engines,
    }


def module_text(answers: dict[str, Any]) -> str:
    """The text of ``shmctl/answers.py`` holding ``answers``."""
    lines = [
        '"""What shmctl prints for its --help and fixed Tab completions, rendered by typer.',
        "",
        "Generated by ``python -m shmctl.prerender`` (see there): do not edit. shmctl.launch",
        "prints these only while FINGERPRINT matches SOURCES and the typer it would import.",
        '"""',
        "",
        "# ruff: noqa: E501",
        "# fmt: off",
        f"SOURCES = {answers['SOURCES']!r}",
        f"FINGERPRINT = {answers['FINGERPRINT']!r}",
        "#: The typer that rendered them (in FINGERPRINT too); the tests skip what needs it.",
        f"TYPER_VERSION = {answers['TYPER_VERSION']!r}",
        "",
    ]
    for name in ("HELP", "OPTIONS", "VALUES", "GIVEN", "ENGINES"):
        lines.append(f"{name} = {{")
        lines += [f"    {key!r}: {value!r}," for key, value in answers[name].items()]
        lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = module_text(render())
    if args == ["--check"]:
        if ANSWERS.exists() and ANSWERS.read_text() == text:
            return 0
        import difflib

        kept = ANSWERS.read_text().splitlines() if ANSWERS.exists() else []
        changed = [d for d in difflib.unified_diff(kept, text.splitlines(), lineterm="", n=0)][2:12]
        print(f"{ANSWERS} is stale (fix: run `python -m shmctl.prerender`)", file=sys.stderr)
        print("\n".join(line[:200] for line in changed), file=sys.stderr)
        return 1
    ANSWERS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
