"""The root Typer app and the one place where errors become exit codes.

Commands are thin: options in, one kvoffload call, render, exit status. They raise
library errors freely; ``main`` maps them here, so no command has an except ladder.
Importing this module must stay cheap (shell completion runs it on every Tab): no
torch, no numpy, and command modules import their heavy parts inside the command body.
"""

from __future__ import annotations

import signal
import sys
from typing import Annotated, Any

import typer
import typer.core

from kvoffload.errors import ConfigError, KvOffloadError
from shmctl.commands import register_all
from shmctl.exit import ExitStatus
from shmctl.render import error_line


class Interrupted(BaseException):
    """A signal stopped the command: ``shmctl: error: interrupted``, exit 128 + its number.

    A BaseException, like the KeyboardInterrupt it usually stands for, so no ``except
    Exception`` on the way out can swallow it.
    """

    def __init__(self, signal_name: str = "SIGINT", detail: str = "") -> None:
        self.signal_name = signal_name
        self.message = f"interrupted by {signal_name}: {detail}" if detail else "interrupted"
        super().__init__(self.message)

    @property
    def exit_status(self) -> int:
        return 128 + signal.Signals[self.signal_name].value


class _ClosedPipe(BaseException):
    """Stdout's reader went away; carried past click, which would make it exit 1."""


class _Group(typer.core.TyperGroup):
    # Typer turns a KeyboardInterrupt raised inside a command into a silent `Exit(130)`, which
    # standalone_mode=False hands back as a bare 130: Ctrl-C would print nothing. Carried out
    # as Interrupted, it reaches main() and its one line.
    def invoke(self, ctx: Any) -> Any:  # a click Context (typer vendors click in recent versions)
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted() from None
        except BrokenPipeError:
            if _stdout_reader_gone():
                raise _ClosedPipe() from None
            raise  # a pipe of the library's own (a participant's, a command's): a real error


app = typer.Typer(
    name="shmctl",
    cls=_Group,
    help="Find, explain and safely reap vLLM KV-offload regions in /dev/shm.",
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from shmctl import version

        sys.stdout.write(f"shmctl {version()}\n")
        raise typer.Exit(ExitStatus.OK)


@app.callback()
def _root(
    _version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_print_version, help="Print shmctl's version and exit."
        ),
    ] = False,
) -> None:
    """Find, explain and safely reap vLLM KV-offload regions in /dev/shm."""


register_all(app)


def exit_status_for(error: BaseException) -> ExitStatus:
    if isinstance(error, KeyboardInterrupt):
        return ExitStatus.INTERRUPTED
    if isinstance(error, ConfigError):
        return ExitStatus.USAGE
    return ExitStatus.RUNTIME


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: run the app, map errors to exit codes, never a traceback."""
    args = sys.argv[1:] if argv is None else argv
    _reopen_closed_std_streams()
    if not args:
        args = ["--help"]  # a bare `shmctl` is a request for help, not a usage error
    try:
        # Without standalone mode, click returns typer.Exit's code instead of raising it.
        code = app(args=args, prog_name="shmctl", standalone_mode=False)
        if isinstance(code, int):
            return code
    except SystemExit as e:  # typer.Exit, --help, completion
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else ExitStatus.USAGE)
    except Interrupted as e:
        error_line(e.message)
        return e.exit_status
    except KeyboardInterrupt:  # outside any command (typer has not taken over yet)
        error_line("interrupted")
        return ExitStatus.INTERRUPTED
    except KvOffloadError as e:
        error_line(str(e))
        return exit_status_for(e)
    except _ClosedPipe:
        # `shmctl scan | head -1`: the reader has what it wanted. Quietly 0, as for cat;
        # 1 would read as "findings" and 3 as a failure.
        _silence_stdout()
        return ExitStatus.OK
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        error_line(f"{where}{e.strerror or e}")
        return ExitStatus.RUNTIME
    except Exception as e:  # click usage errors and anything unexpected
        return _click_or_crash(e)
    return ExitStatus.OK


def _click_or_crash(error: Exception) -> int:
    # typer vendors click; its public base is TyperException (usage errors carry exit_code 2).
    if isinstance(error, typer.Abort):
        error_line("aborted")
        return ExitStatus.INTERRUPTED
    if isinstance(error, typer.TyperException):
        format_message = getattr(error, "format_message", None)
        message = format_message() if callable(format_message) else str(error)
        usage = getattr(error, "exit_code", 2) == 2
        if usage:
            # click names the problem; the fix is in the command's help.
            command = getattr(getattr(error, "ctx", None), "command_path", None) or "shmctl"
            message = f"{message} (fix: see `{command} --help`)"
        error_line(message)
        return ExitStatus.USAGE if usage else ExitStatus.RUNTIME
    raise error


def _stdout_reader_gone() -> bool:
    """True when stdout is a pipe whose reader has closed it (poll reports POLLERR)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # no stdout at all
        return False


def _reopen_closed_std_streams() -> None:
    """Give a standard fd that was closed (``shmctl scan >&-``, ``reap <&-``) /dev/null.

    Python then starts with ``sys.stdout`` (or stdin, stderr) None, and every command that
    looks at it would raise. Worse, the next file opened would get that fd number: a region
    file opened as fd 1 would receive what the report writes. /dev/null fills the gap: what
    is written goes nowhere, as the caller asked, a closed stdin reads as end of file (no
    terminal to confirm on), and the exit status is the command's own.
    """
    import os

    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        if getattr(sys, name) is not None:
            continue
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free fd: this very one
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        errors = "backslashreplace" if name == "stderr" else "surrogateescape"
        setattr(sys, name, open(fd, mode, errors=errors, closefd=False))  # noqa: SIM115


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null so the interpreter's last flush cannot fail on the closed pipe."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def run() -> None:
    code = main()
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # the reader left while the last bytes were buffered
        _silence_stdout()
        code = ExitStatus.OK if code in (ExitStatus.OK, ExitStatus.FINDINGS) else code
    sys.exit(code)


if __name__ == "__main__":
    run()
