"""Shared-memory files: names, regions, the owner record, /proc evidence, scan and reap."""
