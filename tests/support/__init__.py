"""Helpers the tests share: real processes, hostile users, mounts, schemas, strace windows."""
