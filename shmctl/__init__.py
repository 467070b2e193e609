"""shmctl: the operator's CLI for vLLM KV-offload regions in /dev/shm (a thin client of kvoffload)."""
