"""Where a file-backed tier keeps each KV block: one file per key, under a namespace directory.

The namespace is ``<root_dir>/<model>_<digest>``: ``digest`` is the first 12 hex digits of
the SHA-256 of the fields that decide a block's bytes (model, dtype, hash granularity, chunk
size, parallel layout, KV-cache groups, byte format), serialised as compact sorted JSON. Two
engines that would write different bytes for one key therefore never share a directory, and
two that would write the same bytes (the same model and layout, on any host sharing the
mount) always do. The digest and the JSON are vLLM 0.33's, byte for byte, so a kvoffload
engine and a vLLM engine on one mount find each other's blocks.

A block of rank ``r`` lives at ``<namespace>_r<r>/<h[:3]>/<h[3:5]>_g<group>/<h>.bin``
(``h``: the block hash in hex): two directory levels keep any one directory small. The
namespace directory itself holds only ``config.json``, the fields the digest was made of,
so an operator can tell what a namespace is without recomputing hashes.

Parallel-agnostic namespaces: a caller that asks for one (``parallel_agnostic=True``) gets
it only when the layout allows it (the config says the block bytes do not depend on the
parallel layout, or the layout is replicated): then tp/pp/pcp/dcp read as 1 and every rank
writes as rank 0, so engines of different TP sizes share blocks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvoffload.base import OffloadKey, get_offload_block_hash, get_offload_group_idx
from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    from kvoffload.base import OffloadingSpec

CONFIG_FILENAME = "config.json"
#: Hex digits of the fields' SHA-256 in a namespace name: enough to keep layouts apart.
NAMESPACE_DIGEST_LEN = 12

#: The version of vLLM's canonical (parallelism-free) page format.
CANONICAL_FORMAT_VERSION = 1
#: vLLM's KV cache layouts (``vllm/v1/kv_cache_layout.py``); two keep their older family names.
_LAYOUT_FAMILIES = {
    "LBHNC": "hnd",
    "LBNHC": "nhd",
    "LHBNC": "lhbnc",
    "BLHNC": "blhnc",
    "BLNHC": "blnhc",
    "BHLNC": "bhlnc",
}


def canonical_format_id(kv_cache_layout: str) -> str:
    """The id of the canonical byte format for ``kv_cache_layout``, as vLLM spells it (``v1-nhd``).

    Canonical pages keep the worker's layout family, so the family is part of the id and a
    reader must match it exactly.
    """
    family = _LAYOUT_FAMILIES.get(kv_cache_layout)
    if family is None:
        raise ConfigError(
            "kv_cache_layout",
            f"unknown KV cache layout {kv_cache_layout!r}",
            fix=f"use one of {', '.join(_LAYOUT_FAMILIES)}",
        )
    return f"v{CANONICAL_FORMAT_VERSION}-{family}"


class FileMapper:
    """Maps offload keys to block file paths inside one namespace (see the module docstring)."""

    def __init__(
        self,
        root_dir: str,
        model_name: str,
        tokens_per_hash: int,
        blocks_per_file: int,
        tp_size: int,
        pp_size: int,
        pcp_size: int,
        dcp_size: int,
        rank: int,
        dtype: str,
        kv_cache_groups: Sequence[Mapping[str, Any]] | None = None,
        inference_engine: str = "vllm",
        parallel_agnostic: bool = False,
        replicated_layout: bool = False,
        canonical_format: str | None = None,
    ) -> None:
        # An empty root_dir is vLLM's: its p2p and object tiers name a run's config and keys
        # with one and never write there. The tiers that do write refuse it themselves.
        if parallel_agnostic:
            tp_size = pp_size = pcp_size = dcp_size = 1
            rank = 0
        self.rank: int = rank
        fields: dict[str, Any] = {
            "model_name": model_name,
            "tokens_per_hash": tokens_per_hash,
            "blocks_per_file": blocks_per_file,
            "tp_size": tp_size,
            "pp_size": pp_size,
            "pcp_size": pcp_size,
            "dcp_size": dcp_size,
            "dtype": str(dtype),
            "kv_cache_groups": [dict(group) for group in kv_cache_groups or ()],
            "inference_engine": inference_engine,
        }
        # Optional fields appear only when they change the bytes, so namespaces written
        # before the field existed keep their digest.
        if not parallel_agnostic:
            fields["parallel_agnostic"] = False
        if replicated_layout:
            fields["replicated_layout"] = True
        if canonical_format is not None:
            fields["canonical_format"] = canonical_format
        self.fields: dict[str, Any] = fields
        self.base_path: str = namespace_path(root_dir, fields)

    @classmethod
    def from_offloading_spec(
        cls,
        root_dir: str,
        offloading_spec: OffloadingSpec,
        blocks_per_file: int = 1,
        parallel_agnostic: bool = False,
    ) -> FileMapper:
        """The mapper for the engine ``offloading_spec`` describes.

        ``parallel_agnostic`` is a request: it is granted only when the config's layout is
        parallelism-agnostic or replicated (see the module docstring).
        """
        config = offloading_spec.config
        parallel = config.parallel
        canonical_format = None
        if config.canonical_layout:
            if config.kv_cache_layout is None:
                raise ConfigError(
                    "kv_cache_layout",
                    "the canonical layout needs the worker's KV cache layout to name its byte format",
                )
            canonical_format = canonical_format_id(config.kv_cache_layout)
        return cls(
            root_dir=root_dir,
            model_name=config.model.name,
            tokens_per_hash=config.cache.tokens_per_hash,
            blocks_per_file=blocks_per_file,
            tp_size=parallel.tp_size,
            pp_size=parallel.pp_size,
            pcp_size=parallel.pcp_size,
            dcp_size=parallel.dcp_size,
            rank=parallel.rank,
            dtype=config.model.dtype,
            kv_cache_groups=[
                {"tokens_per_block": group.tokens_per_block, "layer_names": list(group.layer_names)}
                for group in config.groups
            ],
            parallel_agnostic=parallel_agnostic
            and (parallel.is_parallelism_agnostic or config.replicated_layout),
            replicated_layout=parallel_agnostic and config.replicated_layout,
            canonical_format=canonical_format,
        )

    def get_file_name(self, key: OffloadKey) -> str:
        """``<namespace>_r<rank>/<h[:3]>/<h[3:5]>_g<group>/<h>.bin`` for ``key``."""
        digest = get_offload_block_hash(key).hex()
        return (
            f"{self.base_path}_r{self.rank}/{digest[:3]}/{digest[3:5]}_g{get_offload_group_idx(key)}"
            f"/{digest}.bin"
        )

    def get_run_config(self) -> dict[str, Any]:
        """The fields the namespace digest is made of (a copy: what ``config.json`` holds)."""
        return dict(self.fields)

    def get_config_file_path(self) -> str:
        return f"{self.base_path}/{CONFIG_FILENAME}"


def namespace_path(root_dir: str, fields: Mapping[str, Any]) -> str:
    """``<root_dir>/<model>_<digest>``; a HuggingFace id's ``/`` becomes ``_`` so it cannot nest."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:NAMESPACE_DIGEST_LEN]
    model = str(fields["model_name"]).replace("/", "_")
    return f"{root_dir}/{model}_{digest}"
