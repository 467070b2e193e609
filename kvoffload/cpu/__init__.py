"""CPU offloading: the CPU spec, the chunk-pool manager and its cache policies."""
