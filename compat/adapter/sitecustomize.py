"""Started by every interpreter of the kvoffload run (test process and spawned children)."""

import kvoffload_vllm_adapter

kvoffload_vllm_adapter.install()
