"""The harness's one error: it could not get as far as running a test (exit 2)."""

from __future__ import annotations


class SetupError(Exception):
    """The harness could not get as far as running a test (exit 2)."""
