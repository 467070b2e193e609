"""vLLM 0.33's object-store secondary tier, hosted.

The modules of this package are vLLM's own files, run on kvoffload's tiering base: see
``kvoffload.tiering.hosted``. Importing it without vLLM installed is a
``ModuleNotFoundError`` that says so.
"""

from kvoffload.tiering.hosted import host

__path__ = host(__name__)
