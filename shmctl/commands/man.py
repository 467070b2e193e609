"""``shmctl man``: print shmctl(1), the man page, as roff (``shmctl man | man -l -``).

The page is rendered from the command tree (``shmctl.manpage``): the same text as the
``share/man/man1/shmctl.1`` the wheel installs, readable where that directory is on no man path
(a venv, pipx).
"""

import sys

import typer


def man() -> None:
    """Print the man page, shmctl(1), as roff on stdout: read it with `shmctl man | man -l -`.

    The same page as the installed share/man/man1/shmctl.1, which `man shmctl` finds only on
    man's path: /usr/local, or a venv whose bin is on PATH (man looks in BIN/../share/man), but
    not pipx's venv; where it is not found, `man shmctl` opens shmctl(2), the System V call.
    """

    from shmctl import manpage

    sys.stdout.write(manpage.render())


def register(app: typer.Typer) -> None:
    app.command("man")(man)
