"""Cache policies of the CPU chunk pool: the interface (``base``), ``lru``, ``arc`` and the factory."""

from kvoffload.cpu.policies.arc import ARCCachePolicy
from kvoffload.cpu.policies.base import WRITE_PENDING, CachePolicy, ChunkStatus, Eviction, order_request_keys
from kvoffload.cpu.policies.factory import KNOWN_POLICIES, CachePolicyFactory
from kvoffload.cpu.policies.lru import LRUCachePolicy

__all__ = [
    "KNOWN_POLICIES",
    "WRITE_PENDING",
    "ARCCachePolicy",
    "CachePolicy",
    "CachePolicyFactory",
    "ChunkStatus",
    "Eviction",
    "LRUCachePolicy",
    "order_request_keys",
]
