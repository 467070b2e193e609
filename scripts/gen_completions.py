"""Write completions/: what ``shmctl completion SHELL`` prints, under the names shells look up.

``make completions`` runs ``python scripts/gen_completions.py -o completions``. The texts are the
installed package's (``shmctl.completion_scripts``), so the committed files, the files the wheel
installs and ``shmctl completion`` are one text per shell. Each goes where a shell finds it by its
name (pyproject.toml installs them there):

- ``shmctl``: the bash script under the name bash-completion looks up first for the command
  ``shmctl`` in ``share/bash-completion/completions`` (the name its own completions use);
- ``_shmctl``: the zsh script as a function file for ``$fpath`` (compinit reads its ``#compdef``
  line and autoloads it as ``_shmctl``);
- ``shmctl.fish``: for fish's ``vendor_completions.d``;
- ``shmctl.bash``, ``shmctl.zsh``, ``shmctl.fish``: the same three under ``share/shmctl/completions``,
  to source by hand.

A test regenerates every file and compares it with the committed one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shmctl.completion_scripts import SCRIPTS

REPO = Path(__file__).resolve().parent.parent
PROG = "shmctl"


def render() -> dict[str, str]:
    """Every file of completions/, by name."""
    files = {f"{PROG}.{shell}": script for shell, script in SCRIPTS.items()}
    files[PROG] = SCRIPTS["bash"]
    files[f"_{PROG}"] = SCRIPTS["zsh"]
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "-o", "--output-dir", type=Path, default=REPO / "completions", help="default: completions/"
    )
    args = parser.parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (args.output_dir / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
