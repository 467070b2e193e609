"""The root Typer app and the one place where errors become exit codes.

Commands are thin: options in, one kvoffload call, render, exit status. They raise
library errors freely; ``main`` maps them here, so no command has an except ladder.
Importing this module must stay cheap (shell completion runs it on every Tab): no
torch, no numpy, and command modules import their heavy parts inside the command body.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import os
import signal
import sys
from collections.abc import Iterator, MutableMapping
from typing import Annotated, Any

import typer
import typer.core

from kvoffload.errors import ConfigError, KvOffloadError, RootError
from shmctl import commands, helptext
from shmctl.exit import ExitStatus
from shmctl.render import error_line


class Interrupted(BaseException):
    """A signal stopped the command: ``shmctl: error: interrupted``, exit 128 + its number.

    A BaseException, like the KeyboardInterrupt it usually stands for, so no ``except
    Exception`` on the way out can swallow it.
    """

    def __init__(self, signal_name: str = "SIGINT", detail: str = "") -> None:
        self.signal_name = signal_name
        by = "" if signal_name == "SIGINT" and not detail else f" by {signal_name}"
        self.message = f"interrupted{by}: {detail}" if detail else f"interrupted{by}"
        super().__init__(self.message)

    @property
    def exit_status(self) -> int:
        return 128 + signal.Signals[self.signal_name].value


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, delivered as Ctrl-C is: every path that tears down on Ctrl-C (an
    ``init --hold`` engine, a bring-up, an audit's child) tears down on a service stop or a
    closed terminal too, and the exit status says which signal it was (143, 129).
    """

    def __init__(self, signum: int) -> None:
        self.signal_name = signal.Signals(signum).name
        super().__init__(self.signal_name)


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


def _handle_termination_signals() -> None:
    """SIGTERM and SIGHUP raise ``Terminated`` where they would have killed us silently.

    A disposition the caller chose is kept: ``nohup`` ignores SIGHUP, and so do we.
    """
    for signum in (signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _raise_terminated)
        except (ValueError, OSError):  # not the main thread (a test's runner)
            return


class _Outcome:
    """Whether the command's outcome is decided: its exit status, and the line that says why."""

    settled = False


def _settle() -> None:
    _Outcome.settled = True


def _exit_once_settled(signum: int, frame: object) -> None:
    """A signal after the outcome is decided ends the process at once, with 128 + its number.

    Raised as an exception there, it would meet no handler left to make it one line (the
    error line just written, the last flush, the interpreter's shutdown) and print a
    traceback. Before that, it is the KeyboardInterrupt every command tears down on.
    """
    if _Outcome.settled:
        os._exit(128 + signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def _exit_on_late_signals() -> None:
    """Route SIGINT, SIGTERM and SIGHUP through ``_exit_once_settled`` (the console script only:
    a test's runner calling ``main`` keeps its own handlers). A disposition the caller chose
    (an ignored SIGHUP under ``nohup``) is kept."""
    ours = (signal.default_int_handler, _raise_terminated)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(signum) in ours:
                signal.signal(signum, _exit_once_settled)
        except (ValueError, OSError):  # not the main thread
            return


def _signal_name(error: BaseException) -> str:
    return getattr(error, "signal_name", "SIGINT")


class _ClosedPipe(BaseException):
    """Stdout's reader went away; carried past click, which would make it exit 1."""


class _Group(typer.core.TyperGroup):
    # Typer turns a KeyboardInterrupt raised inside a command into a silent `Exit(130)`, which
    # standalone_mode=False hands back as a bare 130: Ctrl-C would print nothing. Carried out
    # as Interrupted, it reaches main() and its one line.
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = _Commands(self.rich_markup_mode)

    def list_commands(self, ctx: Any) -> list[str]:
        # typer's lists them through items(), which would build every one
        return list(self.commands)

    def invoke(self, ctx: Any) -> Any:  # a click Context (typer vendors click in recent versions)
        try:
            return super().invoke(ctx)
        except RootError as e:
            raise _named_by_origin(e, ctx.meta) from None
        except KeyboardInterrupt as e:
            raise Interrupted(_signal_name(e)) from None
        except BrokenPipeError:
            if _stdout_reader_gone():
                raise _ClosedPipe() from None
            raise  # a pipe of the library's own (a participant's, a command's): a real error


def _named_by_origin(error: RootError, meta: dict[str, Any]) -> RootError:
    """``error`` naming its root as the operator gave it: ``SHMCTL_ROOT=/nope: does not exist``
    with a fix about the variable, or ``--root /nope: ...``; as it was for the default root.

    The library names the path and offers both ways to change it; only the CLI knows which
    one the bad value came through.
    """
    from shmctl.options import root_origin_label

    origin = root_origin_label(meta, error.root)
    if origin is None or type(error) is not RootError:
        return error  # a subclass (CapacityError) is about what the root holds, with its own fix
    label, source = origin
    what = error.message.removeprefix(f"{error.root}: ")
    fix = error.fix
    if fix is None or "--root" in fix or "SHMCTL_ROOT" in fix:
        from kvoffload.shm.names import DEFAULT_ROOT

        where = "the directory that holds the region files"
        fix = (
            f"set SHMCTL_ROOT to {where}, or unset it for {DEFAULT_ROOT}"
            if source == "environment"
            else f"pass {where} as --root, or leave it out for {DEFAULT_ROOT}"
        )
    # Reworded where it stands: its fields (root) stay the library's.
    error.message = f"{label}: {what}"
    error.fix = fix
    error.args = (error.message,)
    return error


class _Commands(MutableMapping[str, Any]):
    """The root's commands by name, each built on first use (``shmctl.commands.build``).

    Click looks a command up by name to run it, to complete its options, or to list it in
    ``--help``; only what is looked up is imported and built. ``add_command`` still works.
    """

    def __init__(self, rich_markup_mode: Any) -> None:
        self._markup = rich_markup_mode
        self._names = list(commands.MODULES)
        self._built: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        command = self._built.get(name)
        if command is None:
            if name not in self._names:
                raise KeyError(name)
            command = self._built[name] = commands.build(name, rich_markup_mode=self._markup)
            # `--color` is the root's and every command's (`shmctl scan --color=never`, as ls
            # and grep take it): one option object, not a parameter in each command's signature.
            command.params.append(_color_option())
        return command

    def __setitem__(self, name: str, command: Any) -> None:
        if name not in self._names:
            self._names.append(name)
        self._built[name] = command

    def __delitem__(self, name: str) -> None:
        self._names.remove(name)
        self._built.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@functools.cache  # stateless: one object serves every command
def _color_option() -> Any:
    # Declared as typer declares any option and taken from the command typer builds: the
    # option class's own constructor is private API that changed in typer 0.29 (it now needs
    # a type descriptor), and shmctl also runs in vLLM's images, which carry 0.29.
    probe = typer.Typer()

    @probe.command()
    def color(
        color: Annotated[
            str,
            typer.Option(
                "--color",
                metavar="auto|always|never",
                show_default=False,
                callback=_set_color,
                autocompletion=_complete_color,
                help="Colour on a terminal (auto), always or never.",
            ),
        ] = "auto",
    ) -> None:
        """Never run: only its option is used."""

    option = next(p for p in typer.main.get_command(probe).params if p.name == "color")
    option.expose_value = False
    return option


app = typer.Typer(
    name="shmctl",
    cls=_Group,
    help="Find, explain and safely reap vLLM KV-offload regions in /dev/shm.",
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=helptext.epilog(helptext.ROOT_EXAMPLES),
)


COLOR_MODES = ("auto", "always", "never")


def _complete_color(incomplete: str) -> list[str]:
    return [mode for mode in COLOR_MODES if mode.startswith(incomplete)]


def _set_color(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
    """``--color``, the root's or a command's: the one given last on the line wins.

    Each command carries its own ``--color`` whose default (``auto``) would otherwise undo
    the root's (``shmctl --color never doctor``): only a value that was given sets the mode.
    The root's default resets it, so each run starts from ``auto`` (in-process runs too).
    """
    if value is None:
        return value
    if value not in COLOR_MODES:
        raise typer.BadParameter(f"{value!r} is not one of auto, always, never", param_hint="'--color'")
    source = ctx.get_parameter_source(param.name) if param.name else None
    given = source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")
    if given or ctx.parent is None:
        from shmctl import render

        render.set_color_mode(value)
    return value


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
            "--version",
            "-V",
            is_eager=True,
            callback=_print_version,
            help="Print shmctl's version and exit.",
        ),
    ] = False,
    _color: Annotated[
        str,
        typer.Option(
            "--color",
            metavar="auto|always|never",
            callback=_set_color,
            autocompletion=_complete_color,
            help="Colour on a terminal (auto), always or never; NO_COLOR=1 means never. "
            "Every command takes it too.",
        ),
    ] = "auto",
) -> None:
    """Find, explain and safely reap vLLM KV-offload regions in /dev/shm."""


def exit_status_for(error: BaseException) -> ExitStatus:
    if isinstance(error, KeyboardInterrupt):
        return ExitStatus.INTERRUPTED
    if isinstance(error, ConfigError):
        return ExitStatus.USAGE
    return ExitStatus.RUNTIME


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: run the app, map errors to exit codes, never a traceback.

    Whatever the standard fds are (closed, read-only, a full disk, a pipe whose reader left),
    the result is the command's exit status and at most one line on stderr.
    """
    _reopen_closed_std_streams()
    _guard_std_streams()
    _handle_termination_signals()
    if argv is None:
        _exit_on_late_signals()
    code = _run(sys.argv[1:] if argv is None else argv)
    _settle()
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # the reader left while the last bytes were buffered
        _silence_stdout()
        code = ExitStatus.OK if code in (ExitStatus.OK, ExitStatus.FINDINGS) else code
    except OSError as e:  # the last bytes met a full disk: the data is incomplete
        _silence_stdout()
        error_line(_stream_error(e))
        code = ExitStatus.RUNTIME
    return code


def _run(args: list[str]) -> int:
    """The command's exit status, its error reported. Every way out settles the outcome first
    (``_settle``): a signal while it is reported ends the process (``_exit_once_settled``)."""
    if not args:
        args = ["--help"]  # a bare `shmctl` is a request for help, not a usage error
    try:
        # Without standalone mode, click returns typer.Exit's code instead of raising it.
        code = app(args=args, prog_name="shmctl", standalone_mode=False)
        _settle()
        if isinstance(code, int):
            return code
    except SystemExit as e:  # typer.Exit, --help, completion
        _settle()
        if _click_met_a_closed_pipe():
            return ExitStatus.OK  # `shmctl --help | head -1`, as for a command's output
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else ExitStatus.USAGE)
    except Interrupted as e:
        _settle()
        error_line(e.message)
        return e.exit_status
    except KeyboardInterrupt as e:  # outside any command (typer has not taken over yet)
        _settle()
        interrupted = Interrupted(_signal_name(e))
        error_line(interrupted.message)
        return interrupted.exit_status
    except KvOffloadError as e:
        _settle()
        error_line(str(e))
        return exit_status_for(e)
    except _ClosedPipe:
        _settle()
        # `shmctl scan | head -1`: the reader has what it wanted. Quietly 0, as for cat;
        # 1 would read as "findings" and 3 as a failure.
        _silence_stdout()
        return ExitStatus.OK
    except OSError as e:
        _settle()
        error_line(_stream_error(e))
        return ExitStatus.RUNTIME
    except Exception as e:  # click usage errors and anything unexpected
        _settle()
        return _click_or_crash(e)
    return ExitStatus.OK


def _click_or_crash(error: Exception) -> int:
    # typer vendors click; its public base is TyperException (usage errors carry exit_code 2).
    if isinstance(error, typer.Abort):
        # click's prompt turns Ctrl-C (and so SIGTERM, SIGHUP) into Abort: say which it was.
        signalled = error.__cause__ or error.__context__
        if isinstance(signalled, KeyboardInterrupt):
            interrupted = Interrupted(_signal_name(signalled))
            error_line(interrupted.message)
            return interrupted.exit_status
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


def _click_met_a_closed_pipe() -> bool:
    """Click writes ``--help`` and ``--version`` outside any command, meets EPIPE there, wraps
    the standard streams to silence their last flush and exits 1, which reads as "findings".
    Seen here, it is the quiet 0 of any other closed pipe."""
    wrapped = getattr(sys.stdout, "wrapped", None)
    if type(sys.stdout).__name__ != "PacifyFlushWrapper" or wrapped is None:
        return False
    sys.stdout = wrapped
    sys.stderr = getattr(sys.stderr, "wrapped", sys.stderr)
    _silence_stdout()
    return True


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


#: The fix for an error of writing our own stdout, by errno (the data is what failed to arrive).
_STDOUT_FIXES = {
    errno.ENOSPC: "free space where stdout is redirected, or redirect it elsewhere",
    errno.EDQUOT: "raise the quota where stdout is redirected, or redirect it elsewhere",
    errno.EFBIG: "stdout's file hit its size limit (ulimit -f); redirect it elsewhere",
    errno.EBADF: "stdout is not open for writing; redirect it to a file or /dev/null",
    errno.EINVAL: "stdout cannot be written to; redirect it to a file or /dev/null",
    errno.EIO: "the terminal or device behind stdout failed; redirect it to a file",
}


def _stream_error(error: OSError) -> str:
    """One line for an OSError, with a fix when it was our stdout that failed."""
    where = f"{error.filename}: " if error.filename else ""
    message = f"{where}{error.strerror or error}"
    if error.filename == _STDOUT:
        fix = _STDOUT_FIXES.get(error.errno or 0, "redirect stdout to a file or /dev/null")
        message += f" (fix: {fix})"
    return message


_STDOUT = "stdout"


class _NamedStdout(io.FileIO):
    """fd 1 whose write errors name it: ``stdout: No space left on device (fix: ...)`` rather
    than an errno with no file, which reads as if the shm root were full."""

    def write(self, data: Any) -> int:
        try:
            return super().write(data)
        except OSError as e:
            raise type(e)(e.errno, e.strerror, _STDOUT) from None


class _BestEffortStderr(io.TextIOBase):
    """stderr that cannot fail the command: a diagnostic that cannot be written (a read-only
    fd, a full disk, a reader that left) is dropped, and the exit status stays the command's.
    There is nowhere left to report it."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()

    def fileno(self) -> int:
        return int(self._stream.fileno())

    def isatty(self) -> bool:
        try:
            return bool(self._stream.isatty())
        except (OSError, ValueError):
            return False

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(self._stream.encoding)

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self._stream, "errors", None)


def _guard_std_streams() -> None:
    """Name stdout in its write errors and make stderr best-effort (see the two classes).

    Only the interpreter's own streams on fds 1 and 2 are replaced (a test's capture, or a
    caller's StringIO, is left alone); encoding, error handler and line buffering are kept.
    """
    out = sys.stdout
    binary = getattr(out, "buffer", None)
    # PYTHONUNBUFFERED (or -u) gives the text layer a bare FileIO; otherwise it is buffered.
    raw = binary if isinstance(binary, io.FileIO) else getattr(binary, "raw", None)
    if type(out) is io.TextIOWrapper and type(raw) is io.FileIO and _fileno(raw) == 1:
        out.flush()
        named = _NamedStdout(1, "w", closefd=False)
        sys.stdout = io.TextIOWrapper(
            named if binary is raw else io.BufferedWriter(named),
            encoding=out.encoding,
            errors=out.errors,
            line_buffering=out.line_buffering,
            write_through=binary is raw,
        )
    err = sys.stderr
    if type(err) is io.TextIOWrapper and _fileno(err) == 2:
        sys.stderr = _BestEffortStderr(err)


def _fileno(stream: Any) -> int | None:
    try:
        return int(stream.fileno())
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return None


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null so the interpreter's last flush cannot fail on the closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
