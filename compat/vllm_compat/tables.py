"""``results.md``: the table over the whole scope, the reasons, the flaky and vLLM-only tests."""

from __future__ import annotations

from collections.abc import Sequence

from .comparison import FileRow

COLUMNS = (
    "tests",
    "skip/fail on vLLM",
    "pass on vLLM",
    "pass on kvoffload",
    "vLLM-only",
    "flaky",
    "deliberate",
    "unexpected",
)


def _counts(r: FileRow) -> tuple[int, ...]:
    return (
        r.tests,
        r.not_on_vllm,
        r.passed_vllm,
        r.passed_kvoffload,
        len(r.vllm_only),
        len(r.flaky),
        r.deliberate,
        len(r.unexpected),
    )


def render_table(rows: Sequence[FileRow]) -> str:
    """The whole scope: a row per collected file (``TESTS``-relative), then the totals."""
    lines = [
        "| " + " | ".join(("vLLM test file", *COLUMNS)) + " |",
        "|" + "|".join(["---"] + ["---:"] * len(COLUMNS)) + "|",
    ]
    lines += ["| " + " | ".join((f"`{r.file}`", *map(str, _counts(r)))) + " |" for r in rows]
    totals = [sum(c) for c in zip(*(_counts(r) for r in rows), strict=True)] if rows else [0] * len(COLUMNS)
    lines.append("| " + " | ".join(f"**{c}**" for c in ("total", *totals)) + " |")
    return "\n".join(lines)


def _cell(text: str, limit: int = 160) -> str:
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("|", "\\|").replace("`", "'")


def render_reasons(rows: Sequence[FileRow], most: int = 3) -> str:
    """Why tests do not run (or do not pass) on vLLM here, per file, from its own run."""
    lines = ["| vLLM test file | tests | why, from the file's own run on vLLM |", "|---|---:|---|"]
    for r in rows:
        if not r.reasons:
            continue
        shown = [f"{n} × {_cell(reason)}" for reason, n in r.reasons[:most]]
        if len(r.reasons) > most:
            shown.append(f"{sum(n for _, n in r.reasons[most:])} × other reasons (results.json)")
        count = str(r.not_on_vllm) if r.tests else "—"
        lines.append(f"| `{r.file}` | {count} | {'; '.join(shown)} |")
    return "\n".join(lines)


def render_report(rows: Sequence[FileRow], notes: Sequence[str] = ()) -> str:
    """results.md: the table, the reasons, and every flaky and vLLM-only test by name."""
    parts = [render_table(rows), "", "Tests that skip or fail on vLLM here:", "", render_reasons(rows)]
    flaky = [f"* `{t}` (rerun needed on {sides})" for r in rows for t, sides in r.flaky]
    vllm_only = [f"* `{t}`" for r in rows for t in r.vllm_only]
    if flaky:
        parts += ["", "Flaky (failed, then passed when rerun alone):", "", *flaky]
    if vllm_only:
        parts += ["", "vLLM-only (pass on kvoffload, but no kvoffload code ran):", "", *vllm_only]
    if notes:
        parts += ["", *[f"* {n}" for n in notes]]
    return "\n".join(parts)
