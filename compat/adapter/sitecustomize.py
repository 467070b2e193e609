"""Started by every interpreter of the kvoffload run (test process and spawned children)."""

import kvoffload_probe
import kvoffload_vllm_adapter

kvoffload_vllm_adapter.install()
kvoffload_probe.install_from_env()
