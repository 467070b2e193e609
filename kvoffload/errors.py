"""One error hierarchy for the library.

Every error carries the data an operator needs (path, key, stage, bytes) and, where
there is one, the fix. The CLI maps these classes to exit codes in exactly one place
(``shmctl.app``); nothing in the library prints or exits.
"""

from __future__ import annotations

from pathlib import Path


class KvOffloadError(Exception):
    """Base of every error kvoffload raises on purpose."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message} (fix: {self.fix})"


class ConfigError(KvOffloadError, ValueError):
    """Invalid input, found before anything is allocated. ``key`` names the field."""

    def __init__(self, key: str, message: str, *, fix: str | None = None) -> None:
        super().__init__(f"{key}: {message}", fix=fix)
        self.key = key


class FaultSpecError(ConfigError):
    """A fault point name or action that the registry or grammar does not know."""


class RegionError(KvOffloadError):
    """Creating, joining or releasing a shared offload region failed."""

    def __init__(self, path: Path | str, message: str, *, fix: str | None = None) -> None:
        super().__init__(f"{path}: {message}", fix=fix)
        self.path = Path(path)


class InsufficientSpaceError(RegionError):
    """The shm root has fewer free bytes than the region needs."""

    def __init__(self, path: Path | str, required: int, free: int) -> None:
        mib = 1 << 20
        super().__init__(
            path,
            f"insufficient space for the CPU KV offload region: {required / mib:.1f} MiB "
            f"required, {free / mib:.1f} MiB free in {Path(path).parent}",
            fix=(
                "grow the shm mount: docker --shm-size=<bytes> or --ipc=host; "
                "Kubernetes emptyDir {medium: Memory, sizeLimit: <bytes>}; or lower cpu_bytes_to_use"
            ),
        )
        self.required = required
        self.free = free


class CreatorFailedError(RegionError, RuntimeError):
    """A joiner found that the creator died or gave up before sizing the region.

    A ``RuntimeError`` too, as vLLM raises for the same condition.
    """


class JoinTimeoutError(RegionError, TimeoutError):
    """A joiner waited for the creator to size the region and gave up."""


class ViewOverflowError(RegionError, AssertionError):
    """A view asked of a region does not fit the worker's slot or the row.

    An ``AssertionError`` too: vLLM asserts the same bound, and its callers and tests expect that.
    """


class ReservedLabelError(KvOffloadError, AssertionError):
    """A secondary tier declares an info label the tiering manager writes itself.

    An ``AssertionError`` too: vLLM asserts the same rule, and its tests expect that.
    """


class RegionReleasedError(RegionError):
    """A view was asked of a region after ``cleanup()``."""


class InjectedFault(KvOffloadError):
    """Raised by a fault point configured with the ``raise`` action."""

    def __init__(self, point: str, message: str | None = None) -> None:
        super().__init__(message or f"injected fault at {point}")
        self.point = point


class RootError(KvOffloadError):
    """The shm root cannot be used: missing, not a directory, unreadable."""

    def __init__(self, root: Path | str, message: str, *, fix: str | None = None) -> None:
        super().__init__(f"{root}: {message}", fix=fix)
        self.root = Path(root)


class TierIOError(KvOffloadError, OSError):
    """A file-backed secondary tier could not read or write ``path``.

    An ``OSError`` too, with the OS's ``errno`` when the OS refused, so callers written for
    vLLM's tiers catch it. ``num_succeeded``: blocks of the batch copied before this one.
    """

    def __init__(
        self,
        path: Path | str,
        message: str,
        *,
        errno: int | None = None,
        num_succeeded: int = 0,
        fix: str | None = None,
    ) -> None:
        super().__init__(f"{path}: {message}", fix=fix)
        self.path = Path(path)
        self.errno = errno
        self.num_succeeded = num_succeeded
