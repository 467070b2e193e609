"""One module per command; each exposes ``register(app)``. Keep imports here cheap."""

from __future__ import annotations

import typer


def register_all(app: typer.Typer) -> None:
    from shmctl import helptext
    from shmctl.commands import audit, doctor, faults_cmd, init, metrics, reap, scan, watch

    for module in (scan, reap, init, faults_cmd, audit, metrics, watch, doctor):
        module.register(app)
    # Summaries and examples live in one table (shmctl.helptext), which --help, the man page and
    # the tests read; the commands' docstrings keep the longer description.
    for info in app.registered_commands:
        name = info.name or ""
        info.short_help = info.short_help or helptext.SUMMARIES.get(name)
        examples = helptext.EXAMPLES.get(name)
        if examples and info.epilog is None:
            info.epilog = helptext.epilog(examples)
