"""CPU offloading: the chunk-pool manager, its cache policies and (lead) the CPU spec."""
