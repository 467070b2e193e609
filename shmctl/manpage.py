"""shmctl(1), the man page, written from the command tree the CLI itself parses with.

``shmctl man`` prints it; ``scripts/gen_manpage.py`` (``make man``) writes the same text to
man/shmctl.1, which the wheel installs, and a test compares the two. Every synopsis, option,
metavar, default and environment variable comes from ``typer.main.get_command(shmctl.app.app)``,
through the same ``get_help_record`` that ``--help`` prints, so the page says what the parser
accepts. Rendering it builds every command (``shmctl --help`` does too); nothing on the path of
a Tab or of another command imports this module.

The roff is written here rather than by click-man: typer vendors its own click (click-man wants
the real one and would add it as a dependency), click-man writes one page per subcommand and
stamps each with today's date, which makes regenerating never give the same file twice. The
page carries no date for the same reason (its version is in the footer instead).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from importlib.metadata import version
from typing import Any

import typer.main

from shmctl.app import app
from shmctl.exit import ExitStatus

#: What each exit status means, for every command (``shmctl.exit.ExitStatus``). A test checks that
#: every member is described, so a new status cannot ship undocumented.
EXIT_MEANINGS = {
    ExitStatus.OK: (
        "Success: scan found no orphan, reap is done (what it kept is reported, not an error), "
        "audit found no leak, init held its cleanup contract."
    ),
    ExitStatus.FINDINGS: (
        "Findings: scan found orphans, audit found leaks, init left residue or a dry run does not fit."
    ),
    ExitStatus.USAGE: "Bad arguments or configuration; nothing was done.",
    ExitStatus.RUNTIME: (
        "The root could not be read, an I/O or permission error, or an init failure that was not injected."
    ),
    ExitStatus.INTERRUPTED: (
        "Interrupted by Ctrl-C. SIGTERM and SIGHUP are handled as Ctrl-C is (what Ctrl-C tears "
        "down, they tear down) and exit 128 + their number: 143, 129."
    ),
}

_ENV_VAR = re.compile(r"\[env var: ([^;\]]+)")


def escape(text: str) -> str:
    """Text safe in a roff line: backslashes escaped, a leading control character neutralised."""
    text = text.replace("\\", "\\e")
    if text.startswith((".", "'")):
        text = "\\&" + text
    return text


def option_term(term: str) -> str:
    """``-n, --dry-run`` / ``--root PATH``: option names bold, metavars italic."""
    out = []
    for token in re.split(r"(, | / | )", term):
        if token in (", ", " / ", " "):
            out.append(token.strip() + " " if token.strip() else " ")
        elif token.startswith("-"):
            out.append("\\fB" + escape(token).replace("-", "\\-") + "\\fR")
        elif token:
            out.append("\\fI" + escape(token) + "\\fR")
    return "".join(out).strip()


def paragraphs(text: str) -> Iterator[str]:
    """roff for click help text: blank lines part paragraphs, a ``\\b`` paragraph stays as written."""
    for block in re.split(r"\n\s*\n", text.strip()):
        if block.startswith("\b"):
            yield ".nf\n" + "\n".join(escape(line) for line in block[1:].strip("\n").splitlines()) + "\n.fi"
        else:
            yield escape(" ".join(block.split()))


def help_records(command: Any, ctx: Any) -> list[tuple[str, str]]:
    records = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None:  # hidden
            records.append(record)
    return records


def describe(command: Any, ctx: Any) -> list[str]:
    """The help text, one ``.TP`` per visible option or argument, then the examples."""
    lines = []
    for i, block in enumerate(paragraphs(command.help or "")):
        if i:
            lines.append(".PP")
        lines.append(block)
    lines += describe_options(command, ctx)
    for block in paragraphs(command.epilog or ""):
        lines += [".PP", block]
    return lines


def describe_options(command: Any, ctx: Any) -> list[str]:
    """One ``.TP`` per visible option or argument: the term, then its help as ``--help`` shows it."""
    lines = []
    for term, text in help_records(command, ctx):
        lines += [".TP", option_term(term), escape(" ".join(text.split()))]
    return lines


def environment(records: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """``{VARIABLE: [its option, as --help names it]}`` from the ``[env var: ...]`` notes."""
    found: dict[str, list[str]] = {}
    for term, text in records:
        for match in _ENV_VAR.finditer(text):
            for name in match.group(1).split(","):
                option = term.split()[0].rstrip(",")
                if option not in found.setdefault(name.strip(), []):
                    found[name.strip()].append(option)
    return found


def render() -> str:
    root: Any = typer.main.get_command(app)  # a click Group, from the click typer vendors
    ctx = root.context_class(root, info_name="shmctl", **root.context_settings)
    summary = (root.help or "").strip().splitlines()[0].rstrip(".")
    lines = [
        f'.TH SHMCTL 1 "" "shmctl {version("shmctl")}" "User Commands"',
        ".SH NAME",
        "shmctl \\- " + escape(summary[:1].lower() + summary[1:]),
        ".SH SYNOPSIS",
        ".B shmctl",
        escape(" ".join(root.collect_usage_pieces(ctx))),
        ".SH DESCRIPTION",
        *paragraphs(root.help or ""),
        ".PP",
        "Every command takes \\fB\\-h\\fR, \\fB\\-\\-help\\fR. Commands:",
    ]
    all_records = help_records(root, ctx)
    commands = [(name, root.get_command(ctx, name)) for name in root.list_commands(ctx)]
    for name, command in commands:
        if command is None or command.hidden:
            continue
        short = command.get_short_help_str(limit=200)
        lines += [".TP", f"\\fBshmctl {name}\\fR", escape(short)]
    lines += [".SH OPTIONS", *describe_options(root, ctx)]
    lines.append(".SH COMMANDS")
    for name, command in commands:
        if command is None or command.hidden:
            continue
        sub = command.context_class(command, info_name=name, parent=ctx)
        usage = " ".join(command.collect_usage_pieces(sub))
        lines += [f".SS {escape(f'shmctl {name} {usage}')}", *describe(command, sub)]
        all_records += help_records(command, sub)
    if root.epilog:
        lines.append(".SH EXAMPLES")
        for i, block in enumerate(paragraphs(root.epilog.split("\n", 1)[1])):
            lines += [".PP"] if i else []
            lines.append(block)
        lines += [".PP", "Each command's own examples close its section under \\fBCOMMANDS\\fR."]
    lines += [".SH EXIT STATUS", "The same for every command:"]
    for status in ExitStatus:
        lines += [".TP", f"\\fB{int(status)}\\fR", escape(EXIT_MEANINGS[status])]
    env = environment(all_records)
    if env:
        lines.append(".SH ENVIRONMENT")
        for name, options in sorted(env.items()):
            lines += [
                ".TP",
                f"\\fB{escape(name)}\\fR",
                "Default for " + ", ".join(option_term(o) for o in options) + ".",
            ]
    lines += [
        ".SH FILES",
        ".TP",
        "\\fI/dev/shm/vllm_offload_\\fR\\fIENGINE_ID\\fR\\fI.mmap\\fR[\\fI.N\\fR]",
        "The region files of vLLM's CPU KV offload (and kvoffload's): the base file and its segments.",
        ".SH SEE ALSO",
        "\\fBlsfd\\fR(1), \\fBfuser\\fR(1), \\fBfcntl\\fR(2), \\fBflock\\fR(2), \\fBsystemd.exec\\fR(5)",
    ]
    return "\n".join(lines) + "\n"
