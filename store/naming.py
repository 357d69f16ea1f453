"""Names users choose (tables, columns, version groups) and versioned sample ids."""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import InvalidArgument

_IDENT = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,62}$")
# Table names must not collide with the store's own catalog tables.
RESERVED_PREFIXES = ("_expstore", "expstore_", "alembic", "duckdb_", "sqlite_", "pg_")


def check_identifier(name: object, what: str) -> str:
    """Validate a table, column or group name; return it.

    Names are case-sensitive ASCII identifiers so that they are safe to quote and to use as
    Flight paths: a letter, then letters, digits or underscores, at most 63 characters.
    """
    if not isinstance(name, str) or not _IDENT.match(name):
        raise InvalidArgument(
            f"{what} name {name!r} is not allowed; expected a letter followed by up to 62 "
            "letters, digits or underscores")
    if name.lower().startswith(RESERVED_PREFIXES):
        raise InvalidArgument(f"{what} name {name!r} uses a reserved prefix "
                              f"({', '.join(RESERVED_PREFIXES)})")
    return name


def quote(name: str) -> str:
    """Quote an identifier for DuckDB (names are validated, quoting is defence in depth)."""
    return '"' + name.replace('"', '""') + '"'


@dataclass(frozen=True)
class SampleId:
    """A parsed ``{input_id}_{turn}_{trajectory_id}``.

    The input id may itself contain underscores: the last two fields are the turn and the
    trajectory id, both non-negative integers.
    """

    input_id: str
    turn: int
    trajectory_id: int

    def __str__(self) -> str:
        return f"{self.input_id}_{self.turn}_{self.trajectory_id}"


MAX_SAMPLE_ID = 512


def parse_sample_id(text: object) -> SampleId:
    """Parse and validate a sample id.

    >>> parse_sample_id("gsm8k_17_2_5")
    SampleId(input_id='gsm8k_17', turn=2, trajectory_id=5)
    """
    if not isinstance(text, str):
        raise InvalidArgument(f"sample_id {text!r} is not a string; expected "
                              "'{input_id}_{turn}_{trajectory_id}'")
    parts = text.rsplit("_", 2)
    if (len(text) > MAX_SAMPLE_ID or len(parts) != 3 or not parts[0]
            or not parts[1].isdigit() or not parts[2].isdigit() or not parts[1].isascii()
            or not parts[2].isascii() or len(parts[1]) > 9 or len(parts[2]) > 9):
        raise InvalidArgument(
            f"sample_id {text[:80]!r} is malformed; expected '{{input_id}}_{{turn}}_{{trajectory_id}}' "
            f"with a non-empty input id, non-negative integer turn and trajectory id (at most 9 "
            f"digits each), at most {MAX_SAMPLE_ID} characters")
    return SampleId(parts[0], int(parts[1]), int(parts[2]))


def format_sample_id(input_id: str, turn: int, trajectory_id: int) -> str:
    sid = f"{input_id}_{turn}_{trajectory_id}"
    parse_sample_id(sid)
    return sid
