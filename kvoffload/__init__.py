"""kvoffload: a vLLM-compatible CPU KV-offload region with a tested cleanup contract.

Importing this package is cheap on purpose: ``shmctl`` imports it on every shell
completion, so torch and numpy are imported only by the code paths that move KV data.
"""

__version__ = "0.1.0"
