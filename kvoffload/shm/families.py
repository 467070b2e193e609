"""The families of files a killed engine leaves in a shm root, as data.

A vLLM engine that dies leaves more than its KV-offload region: the message-queue segments of
Python's ``multiprocessing.shared_memory`` (``psm_*``), named POSIX semaphores of
``multiprocessing`` (``sem.mp-*``), NCCL's segments (``nccl-*``) and torch's shared-memory
files (``torch_*``). Each family is one ``Family`` here: its name (what ``--family`` takes),
how its file names are recognised, whether its files group into one unit, and what "nobody
holds it" proves about it. The CLI's choices and completion, docs/families.md and the tests
read this one list, so a family added here is offered, documented and tested the day it lands.

The patterns are the exact shapes their makers write, so that a look-alike is never judged:

* ``psm``: ``/psm_`` + ``secrets.token_hex(4)`` (CPython's ``_make_filename``: the name must
  fit 14 characters on macOS, so 8 lowercase hex digits);
* ``sem``: glibc's ``sem_open("/mp-XXXXXXXX")`` writes ``sem.mp-XXXXXXXX``; the 8 characters
  are ``tempfile._RandomNameSequence``'s (``a-z``, ``0-9``, ``_``);
* ``nccl``: NCCL's ``mkstemp("/dev/shm/nccl-XXXXXX")``: 6 of glibc's ``[A-Za-z0-9]``;
* ``torch``: ATen's ``NewProcessWideShmHandle``: ``/torch_{pid}_{random}_{counter}``, all
  three decimal.

Invariant: the families' patterns are disjoint, so a name belongs to one family at most, and
only ``offload`` groups files (a base file and its segments share one verdict); a file of any
other family is a unit of its own, its ``engine_id`` its own name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from kvoffload.errors import ConfigError
from kvoffload.shm import names

__all__ = [
    "ALL",
    "ALL_WORD",
    "DEFAULT",
    "FAMILIES",
    "FAMILY_NAMES",
    "OFFLOAD",
    "Family",
    "check",
    "family",
    "ordered",
    "parse",
    "select",
]

OFFLOAD = "offload"
#: What ``--family all`` stands for.
ALL_WORD = "all"


@dataclass(frozen=True, slots=True)
class Family:
    """One kind of file in a shm root that a dead process can leave behind."""

    #: What ``--family`` takes, and the entries' ``family``.
    name: str
    #: Whose files they are, in a few words.
    made_by: str
    #: The shape of a name, as a glob an operator can type (``ls /dev/shm/psm_*``).
    glob: str
    #: The exact shape of a name; None for ``offload`` (``names.parse`` knows it).
    pattern: re.Pattern[str] | None
    #: Whether files group into one unit by engine id (only ``offload``: a base and its segments).
    grouped: bool
    #: What "nobody has it open or mapped" proves about such a file, in one line.
    nobody_proves: str

    def parse(self, name: str) -> names.RegionName | None:
        """``name`` as a unit to judge: the region name for ``offload``; for the others the name
        is its own engine id (one file, segment 0). None when ``name`` is not of this family."""
        if self.pattern is None:
            return names.parse(name)
        return names.RegionName(name, 0) if self.pattern.fullmatch(name) else None


FAMILIES: tuple[Family, ...] = (
    Family(
        OFFLOAD,
        "vLLM's KV-offload regions",
        "vllm_offload_*.mmap[.N]",
        None,
        True,
        "no engine process maps the region: its engine is gone, and nothing joins a region it "
        "did not create without opening it first",
    ),
    Family(
        "psm",
        "Python's multiprocessing.shared_memory (vLLM's message queues)",
        "psm_XXXXXXXX",
        re.compile(r"psm_[0-9a-f]{8}"),
        False,
        "no process has the segment open or mapped now; between its creation and a peer's attach "
        "nobody may hold it for a moment, which the grace period covers",
    ),
    Family(
        "sem",
        "multiprocessing's named POSIX semaphores",
        "sem.mp-XXXXXXXX",
        re.compile(r"sem\.mp-[a-z0-9_]{8}"),
        False,
        "no process maps the semaphore; multiprocessing unlinks the name right after sem_open, so "
        "a named one outlived a process that died in between",
    ),
    Family(
        "nccl",
        "NCCL's shared-memory transport",
        "nccl-XXXXXX",
        re.compile(r"nccl-[A-Za-z0-9]{6}"),
        False,
        "no process maps the segment; the last peer to attach unlinks it, so a named one with no "
        "holder lost its peers between create and attach (or attaches within the grace period)",
    ),
    Family(
        "torch",
        "PyTorch's shared-memory tensors (file_system strategy)",
        "torch_PID_RAND_N",
        re.compile(r"torch_[0-9]+_[0-9]+_[0-9]+"),
        False,
        "no process maps the tensor's storage; torch_shm_manager unlinks what its clients "
        "registered when they are gone, so a named one outlived its manager too",
    ),
)

#: Every family's name, in the order docs and completion list them.
FAMILY_NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES)
#: What a scan judges unless told otherwise: the offload regions, as it always has.
DEFAULT: frozenset[str] = frozenset({OFFLOAD})
ALL: frozenset[str] = frozenset(FAMILY_NAMES)
_BY_NAME = {f.name: f for f in FAMILIES}


def select(words: Iterable[str]) -> frozenset[str]:
    """``--family`` values as a set of family names: ``all`` is every family, none is
    ``DEFAULT``; an unknown name is a ``ConfigError`` whose fix lists the names."""
    chosen: set[str] = set()
    for word in words:
        if word == ALL_WORD:
            chosen |= ALL
        elif word in _BY_NAME:
            chosen.add(word)
        else:
            raise ConfigError(
                "--family",
                f"unknown family {word!r}",
                fix=f"pass one of {', '.join(FAMILY_NAMES)} or {ALL_WORD}",
            )
    return frozenset(chosen) if chosen else DEFAULT


def check(families: Iterable[str]) -> frozenset[str]:
    """``families`` (``ScanOptions.families``) if every name is a family's, else a ``ConfigError``."""
    given = frozenset(families)
    unknown = sorted(given - ALL)
    if unknown or not given:
        what = f"unknown family {unknown[0]!r}" if unknown else "is empty"
        raise ConfigError("families", what, fix=f"use names from {', '.join(FAMILY_NAMES)}")
    return given


def ordered(families: Iterable[str]) -> tuple[str, ...]:
    """``families`` in the registry's order: how a report lists the families it judged."""
    given = set(families)
    return tuple(name for name in FAMILY_NAMES if name in given)


def parse(name: str, families: frozenset[str] = ALL) -> tuple[str, names.RegionName] | None:
    """The family of a directory entry's name among ``families``, and the unit it belongs to;
    None when it is no file of theirs. Names are tried cheapest-first: most entries of a busy
    root are offload segments."""
    for family in FAMILIES:
        if family.name in families:
            region = family.parse(name)
            if region is not None:
                return family.name, region
    return None


def family(name: str) -> Family:
    """The family called ``name`` (a ``KeyError`` for any other)."""
    return _BY_NAME[name]
