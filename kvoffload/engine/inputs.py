"""Moved to ``kvoffload.bringup.inputs`` (issue #29).

``kvoffload.engine.inputs`` re-exports ``load_config`` for one release, and still
``read_kv_transfer_config``, which lives in ``kvoffload.config`` (the bounded reader).
"""

#: Moved to kvoffload.bringup.inputs; kept here for one release (issue #29).
from kvoffload.bringup.inputs import load_config

#: read_kv_transfer_config lives in kvoffload.config (the bounded reader); still importable here.
from kvoffload.kv_transfer_config import read_kv_transfer_config

__all__ = ["load_config", "read_kv_transfer_config"]
