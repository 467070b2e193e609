"""Parity with vLLM 0.33: its behaviour, its tests' harness, the engine shims."""
