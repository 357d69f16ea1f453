"""Terminal and script output for the CLI: aligned tables, JSON, CSV cells."""
from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
import shutil
from typing import Any, Iterable, Sequence

import click

#: A cell longer than this is cut with an ellipsis (the whole table is also fitted to the
#: terminal width, see :func:`format_table`).
MAX_CELL = 40


def json_default(value: Any) -> Any:
    """JSON for values the json module does not know: times, bytes, decimals, numpy scalars."""
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)


def dumps(value: Any, *, indent: int | None = 2) -> str:
    return json.dumps(value, default=json_default, indent=indent, ensure_ascii=False)


def echo_json(value: Any) -> None:
    click.echo(dumps(value))


def cell(value: Any) -> str:
    """One value as table or CSV text: nulls empty, nested values as JSON."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.6g}"
    if isinstance(value, (dict, list, tuple)):
        return dumps(value, indent=None)
    if isinstance(value, (bytes, bytearray)):
        return "0x" + bytes(value[:32]).hex() + ("…" if len(value) > 32 else "")
    if isinstance(value, dt.datetime):
        return value.isoformat(sep=" ", timespec="seconds")
    return str(value)


def _cut(text: str, width: int) -> str:
    text = text.replace("\n", "\\n").replace("\t", " ")
    if len(text) <= width:
        return text
    return text[: max(width - 1, 0)] + "…"


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *,
                 max_cell: int = MAX_CELL, width: int | None = None) -> str:
    """Rows as aligned columns that fit ``width`` (default: the terminal), long cells cut."""
    texts = [[cell(v) for v in row] for row in rows]
    widths = [min(max([len(h)] + [len(r[i]) for r in texts]), max_cell)
              for i, h in enumerate(headers)]
    total = shutil.get_terminal_size((120, 24)).columns if width is None else width
    # Shrink the widest columns until the table fits (never below 4 characters).
    while sum(widths) + 2 * (len(widths) - 1) > total and max(widths, default=0) > 4:
        widest = widths.index(max(widths))
        widths[widest] -= 1
    lines = ["  ".join(_cut(h, w).ljust(w) for h, w in zip(headers, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    for r in texts:
        lines.append("  ".join(_cut(v, w).ljust(w) for v, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


def format_pairs(pairs: Sequence[tuple[str, Any]]) -> str:
    """``key: value`` lines with the values aligned."""
    if not pairs:
        return ""
    w = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k.ljust(w)}  {cell(v)}" for k, v in pairs)


def raw_cell(value: Any) -> str:
    """One value as CSV text, without rounding or cutting: nested values and bytes as JSON/base64."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (dict, list, tuple)):
        return dumps(value, indent=None)
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    return str(value)
