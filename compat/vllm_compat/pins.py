"""Every pin of ``compat/requirements.txt`` within the ranges vLLM declares in its sdist."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path

from .scope import VERSION


@dataclasses.dataclass(frozen=True)
class Declared:
    specifier: str  # "" for any version
    source: str  # the requirements file, relative to the sdist


def read_requirements(path: Path, root: Path) -> dict[str, list[Declared]]:
    """What one of vLLM's requirements files (and the files it ``-r`` includes) declares here.

    Entries whose environment marker is false on this interpreter are left out (vLLM's
    ``torch==2.14.0`` for macOS, say). Options and URLs are kept only for their name.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    out: dict[str, list[Declared]] = {}
    for raw in path.read_text().splitlines():
        line = re.sub(r"(^|\s)#.*", "", raw).strip()
        if line.startswith(("-r ", "--requirement ")):
            for name, entries in read_requirements(path.parent / line.split()[-1], root).items():
                out.setdefault(name, []).extend(entries)
            continue
        if not line or line.startswith("-"):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        source = path.relative_to(root).as_posix()
        out.setdefault(canonicalize_name(req.name), []).append(Declared(str(req.specifier), source))
    return out


#: Where vLLM declares its runtime ranges for a CPU machine, then the pins its CPU test
#: environment was compiled with (for the test-only packages: pytest, pytest-timeout, ...).
RUNTIME_REQUIREMENTS = "requirements/cpu.txt"
TEST_REQUIREMENTS = "requirements/test/cpu.txt"


def pins_outside_vllms_ranges(pins: Iterable[str], sdist: Path) -> list[str]:
    """One line for each ``name==version`` that vLLM's requirements do not allow, or do not name.

    A name vLLM declares for its runtime must fall in that range; any other name must be one of
    the pins vLLM's CPU tests were compiled with, at a version that range allows.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    runtime = read_requirements(sdist / RUNTIME_REQUIREMENTS, sdist)
    tests = read_requirements(sdist / TEST_REQUIREMENTS, sdist)
    problems = []
    for pin in pins:
        try:
            req = Requirement(pin)
        except InvalidRequirement as exc:
            problems.append(f"{pin}: not a requirement ({exc})")
            continue
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            problems.append(f"{pin}: pin one version with ==")
            continue
        version = Version(specs[0].version)
        name = canonicalize_name(req.name)
        declared = runtime.get(name) or tests.get(name)
        if not declared:
            problems.append(f"{pin}: {req.name} is not among vLLM {VERSION}'s requirements")
            continue
        for entry in declared:
            if not SpecifierSet(entry.specifier).contains(version, prereleases=True):
                problems.append(f"{pin}: outside vLLM's {req.name}{entry.specifier} ({entry.source})")
    return problems


def requirement_lines(path: Path) -> list[str]:
    return [line for raw in path.read_text().splitlines() if (line := raw.split("#")[0].strip())]
