"""Bench results as an aligned text table, and as JSON."""

from __future__ import annotations

import json
from pathlib import Path


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def format_table(title: str, rows: list[dict]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_cell(row.get(column, "")) for column in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = [title, "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def write_json(path: str | Path, mode: str, settings: dict, rows: list[dict]) -> None:
    Path(path).write_text(
        json.dumps({"mode": mode, "settings": settings, "results": rows}, indent=2, default=str)
        + "\n"
    )
