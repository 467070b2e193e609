"""``python -m compat.vllm_compat``: the harness (``cli.main``)."""

import sys

from .cli import main

sys.exit(main())
