"""kvoffload.tiering: the tiering manager, its tiers, vLLM's hosted tiers."""
