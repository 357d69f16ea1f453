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
    """``value`` as JSON that any parser reads (``jq``, JavaScript): a NaN or an infinity,
    which JSON has no number for, is written as the string ``"NaN"``, ``"Infinity"`` or
    ``"-Infinity"`` (as protobuf's JSON mapping does), not as Python's bare ``NaN``."""
    try:
        return json.dumps(value, default=json_default, indent=indent, ensure_ascii=False,
                          allow_nan=False)
    except ValueError:  # rare: look for the non-finite numbers only then
        return json.dumps(_finite(value), default=json_default, indent=indent,
                          ensure_ascii=False, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


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


#: Columns squeezed below this many characters to fit the terminal are not readable any more:
#: :func:`format_result` then shows one block per row instead.
MIN_READABLE = 10


def _terminal_width(width: int | None) -> int:
    return shutil.get_terminal_size((120, 24)).columns if width is None else width


def _natural_widths(headers: Sequence[str], texts: list[list[str]], max_cell: int) -> list[int]:
    return [min(max([len(h)] + [len(r[i]) for r in texts]), max_cell)
            for i, h in enumerate(headers)]


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *,
                 max_cell: int = MAX_CELL, width: int | None = None) -> str:
    """Rows as aligned columns that fit ``width`` (default: the terminal), long cells cut."""
    texts = [[cell(v) for v in row] for row in rows]
    widths = _natural_widths(headers, texts, max_cell)
    total = _terminal_width(width)
    # Shrink the widest columns until the table fits (never below 4 characters).
    while sum(widths) + 2 * (len(widths) - 1) > total and max(widths, default=0) > 4:
        widest = widths.index(max(widths))
        widths[widest] -= 1
    lines = ["  ".join(_cut(h, w).ljust(w) for h, w in zip(headers, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    for r in texts:
        lines.append("  ".join(_cut(v, w).ljust(w) for v, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


def format_records(headers: Sequence[str], rows: Iterable[Sequence[Any]], *,
                   max_cell: int = MAX_CELL) -> str:
    """One block per row, a ``column  value`` line per column (psql's expanded display): for
    results with more columns than a terminal shows side by side.

    >>> print(format_records(["a", "long_name"], [[1, "x" * 50]], max_cell=10))
    -[ row 1 ]------
    a          1
    long_name  xxxxxxxxx…
    """
    name_width = max((len(h) for h in headers), default=0)
    blocks = []
    for number, row in enumerate(rows, 1):
        head = f"-[ row {number} ]"
        lines = [head + "-" * max(name_width + 2 + 5 - len(head), 3)]
        lines += [f"{h.ljust(name_width)}  {_cut(cell(v), max_cell)}".rstrip()
                  for h, v in zip(headers, row)]
        blocks.append("\n".join(lines))
    return "\n".join(blocks)


def format_result(headers: Sequence[str], rows: Sequence[Sequence[Any]], *,
                  max_cell: int = MAX_CELL, width: int | None = None,
                  vertical: bool | None = None) -> str:
    """A query result for people: aligned columns when they fit ``width`` (default: the
    terminal) with at least :data:`MIN_READABLE` characters each, else one block per row
    (:func:`format_records`). ``vertical`` True or False forces one of the two."""
    if vertical is None:
        texts = [[cell(v) for v in row] for row in rows]
        least = [min(w, MIN_READABLE) for w in _natural_widths(headers, texts, max_cell)]
        vertical = sum(least) + 2 * (len(least) - 1) > _terminal_width(width)
    if vertical:
        return format_records(headers, rows, max_cell=max_cell)
    return format_table(headers, rows, max_cell=max_cell, width=width)


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
