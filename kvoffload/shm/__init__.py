"""The engine's side of shared memory: region names, the region itself and its owner record.

Judging and removing what engines left is the operator's side: ``kvoffload.liveness``.
"""
