"""Everything about park directories: a reaper's own, the trust in those it finds, what is in them.

``reap`` never unlinks a name in a shared directory: it moves each file it proved dead into a
directory of its own, proves the move, and unlinks it there. This package is that directory
and everything that follows from it::

    directory.py  the reaper's park directory (made, locked, marked) and the proofs of a move
    trust.py      which directories named like a park are really a reaper's (judge, Adopter)
    views.py      how a scan report shows park directories and the files in them
    parked.py     what waits in a root's park directories, judged as a scan judges files
    settle.py     what a dead reaper left parked: proven dead again and removed, or given back

The names below are the package's own, as ``kvoffload.liveness.park`` exported them when it was
one module. ``parked`` and ``settle`` are imported by name (they need the scan's report and
the removal): importing this package stays as cheap as the directory and its trust.
"""

from __future__ import annotations

from kvoffload.liveness.park.directory import (
    MARK_PREFIX,
    PARK_PREFIX,
    RENAME_NOREPLACE,
    Identity,
    Moved,
    ParkDir,
    ParkName,
    ParkOutcome,
    RootId,
    format_park_name,
    is_park_name,
    mark_name,
    open_park,
    parse_park_name,
    renameat2,
    unlink_proven,
)
from kvoffload.liveness.park.trust import (
    NO_MARK,
    Adopter,
    FoundPark,
    Untrusted,
    adopt,
    judge,
    lock_held,
    remove_dead,
)
from kvoffload.liveness.park.views import ParkedView, ParkView, UntrustedPark

__all__ = [
    "MARK_PREFIX",
    "NO_MARK",
    "PARK_PREFIX",
    "RENAME_NOREPLACE",
    "Adopter",
    "FoundPark",
    "Identity",
    "Moved",
    "ParkDir",
    "ParkName",
    "ParkOutcome",
    "ParkView",
    "ParkedView",
    "RootId",
    "Untrusted",
    "UntrustedPark",
    "adopt",
    "format_park_name",
    "is_park_name",
    "judge",
    "lock_held",
    "mark_name",
    "open_park",
    "parse_park_name",
    "remove_dead",
    "renameat2",
    "unlink_proven",
]
