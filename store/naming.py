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
#: A valid sample id, for Python's ``re`` and RE2 (Arrow) alike: an input id without control
#: characters, then the turn and trajectory id in canonical decimal (no leading zeros, at most 9
#: digits). Why canonical: "q1_00_0" beside "q1_0_0" would be two rows with the same input, turn,
#: trajectory and version, and a group claim could deliver one trajectory twice as a "group".
SAMPLE_ID_PATTERN = (r"^(?P<input_id>[^\x00-\x1f\x7f-\x9f]+)_(?P<turn>0|[1-9][0-9]{0,8})"
                     r"_(?P<trajectory_id>0|[1-9][0-9]{0,8})$")
_SAMPLE_ID = re.compile(SAMPLE_ID_PATTERN.removeprefix("^").removesuffix("$"))
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def sample_id_problem(text: object) -> str | None:
    """What is wrong with a sample id, as a message naming it and the expected form; None if
    nothing is."""
    if not isinstance(text, str):
        return (f"sample_id {text!r} is not a string; expected "
                "'{input_id}_{turn}_{trajectory_id}'")
    if len(text) <= MAX_SAMPLE_ID and _SAMPLE_ID.fullmatch(text):
        return None
    shown = repr(text[:80]) + ("…" if len(text) > 80 else "")
    expected = ("expected '{input_id}_{turn}_{trajectory_id}' with a non-empty input id without "
                "control characters, and the turn and trajectory id as non-negative integers "
                f"without leading zeros (at most 9 digits each), at most {MAX_SAMPLE_ID} "
                "characters in all")
    if len(text) > MAX_SAMPLE_ID:
        why = f"is {len(text)} characters long"
    elif _CONTROL.search(text):
        char = _CONTROL.search(text).group()  # type: ignore[union-attr]
        why = f"holds the control character {char!r}"
    else:
        parts = text.rsplit("_", 2)
        numbers = parts[1:] if len(parts) == 3 and parts[0] else []
        if numbers and all(n.isascii() and n.isdigit() and len(n) <= 9 for n in numbers) \
                and any(len(n) > 1 and n.startswith("0") for n in numbers):
            canonical = f"{parts[0]}_{int(parts[1])}_{int(parts[2])}"
            why = (f"has a leading zero; write it as {canonical!r} (ids are compared as text, so "
                   "the two would be different samples)")
        else:
            why = "is malformed"
    return f"sample_id {shown} {why}; {expected}"


def parse_sample_id(text: object) -> SampleId:
    """Parse and validate a sample id.

    >>> parse_sample_id("gsm8k_17_2_5")
    SampleId(input_id='gsm8k_17', turn=2, trajectory_id=5)
    """
    problem = sample_id_problem(text)
    if problem is not None:
        raise InvalidArgument(problem)
    assert isinstance(text, str)
    parts = text.rsplit("_", 2)
    return SampleId(parts[0], int(parts[1]), int(parts[2]))


def format_sample_id(input_id: str, turn: int, trajectory_id: int) -> str:
    sid = f"{input_id}_{turn}_{trajectory_id}"
    parse_sample_id(sid)
    return sid
