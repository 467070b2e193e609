"""Tiering: a CPU primary tier in the shared region with write-through secondary tiers."""
