"""KV bytes per GPU block for a few well-known models, so operators need not compute it.

vLLM derives ``worker_kv_bytes_per_block`` from the model it loaded; ``shmctl init`` has
no model, so it takes the figure as ``--kv-bytes-per-block`` or from a preset here. The
figure is what one worker holds for one GPU block, over all layers:

    standard attention (K and V, heads sharded by tensor parallelism):
        num_layers * 2 * max(1, num_kv_heads // world_size) * head_dim * dtype_bytes * gpu_block_size
    MLA (DeepSeek; one compressed latent per token, the same on every worker):
        num_layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes * gpu_block_size

``max(1, ...)``: with more workers than KV heads vLLM replicates heads, one per worker.
MLA caches are identical on every worker, which is why vLLM stores them once per row
(``replicated_layout``); a preset says so and the CLI follows unless told otherwise.
The dtype is the KV-cache dtype, bfloat16 (2 bytes) unless vLLM runs an fp8 KV cache.
Architecture figures are from each model's public ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ModelPreset:
    name: str
    num_layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    #: MLA latent width (kv_lora_rank + qk_rope_head_dim); 0 for standard attention.
    mla_width: int = 0
    dtype_bytes: int = 2

    @property
    def mla(self) -> bool:
        return self.mla_width > 0

    def worker_kv_bytes_per_block(self, gpu_block_size: int, world_size: int) -> int:
        """Bytes one worker holds for one GPU block of ``gpu_block_size`` tokens (formula above)."""
        if gpu_block_size < 1 or world_size < 1:
            raise ConfigError("gpu_block_size", "block size and world size must be positive")
        if self.mla:
            per_token = self.num_layers * self.mla_width * self.dtype_bytes
        else:
            heads = max(1, self.num_kv_heads // world_size)
            per_token = self.num_layers * 2 * heads * self.head_dim * self.dtype_bytes
        return per_token * gpu_block_size


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128),
        ModelPreset("llama-3-70b", num_layers=80, num_kv_heads=8, head_dim=128),
        ModelPreset("llama-3.1-405b", num_layers=126, num_kv_heads=8, head_dim=128),
        ModelPreset("mistral-7b", num_layers=32, num_kv_heads=8, head_dim=128),
        ModelPreset("qwen2.5-7b", num_layers=28, num_kv_heads=4, head_dim=128),
        ModelPreset("qwen2.5-72b", num_layers=80, num_kv_heads=8, head_dim=128),
        ModelPreset("deepseek-v3", num_layers=61, mla_width=512 + 64),
    )
}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(
            "--model", f"no preset for {name!r}", fix="use one of: " + ", ".join(PRESETS)
        ) from None
