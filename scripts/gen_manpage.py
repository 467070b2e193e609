"""Write shmctl(1), the man page, as ``shmctl man`` prints it (``shmctl.manpage``).

``make man`` runs ``python scripts/gen_manpage.py -o man/shmctl.1``; without ``-o`` the page goes
to stdout. The page is rendered by the installed package, from the command tree the CLI parses
with, so the committed file, the installed ``share/man/man1/shmctl.1`` and ``shmctl man`` are one
text; a test regenerates it and compares with the committed file, so it cannot go stale unnoticed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shmctl.manpage import render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-o", "--output", type=Path, help="write the page here (default: stdout)")
    args = parser.parse_args(argv)
    page = render()
    if args.output is None:
        sys.stdout.write(page)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
