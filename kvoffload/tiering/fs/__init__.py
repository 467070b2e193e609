"""The filesystem secondary tier: one file per KV block under a shared root (vLLM's ``fs`` tier)."""
