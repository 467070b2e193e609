"""Validation of real ``--json`` output against the JSON Schemas shipped in ``shmctl/schemas``.

Every document a command prints with ``--json`` (or writes with ``--report``) has a schema
named for it: ``shmctl/schemas/<name>.schema.json``. Tests feed the command's actual output
through :func:`validate`, so a field renamed in the code and not in the schema fails a test.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource

SCHEMAS = Path(__file__).resolve().parents[2] / "shmctl" / "schemas"


@functools.cache
def schema(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(loaded)
    return loaded


@functools.cache
def registry() -> Registry[Any]:
    """Every shipped schema by its ``$id``, so ``urn:shmctl:schema:scan#/$defs/entry`` resolves."""
    resources = [
        Resource.from_contents(schema(p.name.removesuffix(".schema.json")))
        for p in sorted(SCHEMAS.glob("*.schema.json"))
    ]
    return Registry().with_resources((r.id() or "", r) for r in resources)


def validate(document: Any, name: str) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``document`` matches schema ``name``."""
    validator = jsonschema.Draft202012Validator(
        schema(name), registry=registry(), format_checker=jsonschema.FormatChecker()
    )
    error = jsonschema.exceptions.best_match(validator.iter_errors(document))
    if error is not None:
        raise error
