"""shmctl: the operator's CLI for vLLM KV-offload regions in /dev/shm (a thin client of kvoffload)."""

from __future__ import annotations


def version() -> str:
    """The installed distribution's version (importlib.metadata is read only when asked)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("shmctl")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"
