"""The deliberate differences: kvoffload's failures that ``compat/differences.toml`` lists.

Each is explained in docs/vllm-compat.md; one that passes now makes the list stale (exit 1).
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from .errors import SetupError


@dataclasses.dataclass(frozen=True)
class Difference:
    tests: tuple[str, ...]
    what: str
    why: str

    def covers(self, test: str) -> bool:
        # "file::name" covers every parameter of name, "file::name[p]" just that one.
        return any(test == t or test.startswith(t + "[") for t in self.tests)


def load_differences(path: Path) -> list[Difference]:
    data = tomllib.loads(path.read_text())
    out = []
    for i, entry in enumerate(data.get("difference", ())):
        try:
            out.append(Difference(tuple(entry["tests"]), entry["what"], entry["why"]))
        except (KeyError, TypeError) as exc:
            raise SetupError(f"{path}: difference #{i + 1} lacks {exc}; give tests, what and why") from exc
    return out
