"""``python compat/vllm_engine``: the harness (``cli.main``), or one of its inner commands.

It is run by path, the folder as a program, in both venvs: the engine's venv has this
repository installed (kvoffload and shmctl, editable) but not ``compat/``, and a scenario and
its engines run in the work folder, so neither ``-m`` nor the working directory would find the
package there. Run by path, Python puts this folder at the head of ``sys.path``, where its
modules would shadow others by their bare names (``engine``, ``model``...); ``compat/`` goes
there instead, as it did for the script ``compat/vllm_engine.py`` that this package was, so
that ``vllm_engine`` and ``vllm_compat`` import by their names.
"""

import os
import sys
from pathlib import Path

if __package__ != "vllm_engine":
    _package = Path(__file__).resolve().parent
    sys.path[:] = [
        str(_package.parent),
        *(p for p in sys.path if not (os.path.isdir(p) and os.path.samefile(p, _package))),
    ]

from vllm_engine.cli import INNER_COMMANDS, inner_main, main

if len(sys.argv) > 1 and sys.argv[1] in INNER_COMMANDS:
    sys.exit(inner_main(sys.argv[1:]))
sys.exit(main())
