"""Experience table definitions: meta, data and status columns, and their DuckDB DDL.

A table has three groups of columns (FlexMARL, Figure 3):

* meta columns the store owns (:data:`META_COLUMNS`),
* the user's data columns, each stored by value, by reference, or by size (``auto``),
* one ``<column>_status`` boolean per data column, true once that value is fully generated.

A data column stored by reference or ``auto`` has a hidden ``<column>__ref`` key column in DuckDB;
the value column is NULL for values that went to the blob store.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import pyarrow as pa

from .errors import InvalidArgument
from .halves import has_half
from .naming import check_identifier, quote
from .types import duckdb_type, is_complex, parse_type, type_name

STORAGE_MODES = ("value", "ref", "auto")

#: Meta columns: (name, DuckDB type, Arrow type). ``row_id`` is the store's own surrogate key.
META_COLUMNS: list[tuple[str, str, pa.DataType]] = [
    ("row_id", "BIGINT NOT NULL", pa.int64()),
    ("sample_id", "VARCHAR NOT NULL", pa.large_string()),
    ("input_id", "VARCHAR NOT NULL", pa.large_string()),
    ("turn", "INTEGER NOT NULL", pa.int32()),
    ("trajectory_id", "INTEGER NOT NULL", pa.int32()),
    ("policy_version", "BIGINT NOT NULL", pa.int64()),
    ("finished_version", "BIGINT", pa.int64()),
    ("is_processing", "BOOLEAN NOT NULL DEFAULT false", pa.bool_()),
    ("lease_id", "VARCHAR", pa.large_string()),
    ("lease_owner", "VARCHAR", pa.large_string()),
    ("lease_expires_at", "TIMESTAMPTZ", pa.timestamp("us", tz="UTC")),
    ("delivery_count", "INTEGER NOT NULL DEFAULT 0", pa.int32()),
    ("consumed", "BOOLEAN NOT NULL DEFAULT false", pa.bool_()),
    ("consumed_version", "BIGINT", pa.int64()),
    ("stale", "BOOLEAN NOT NULL DEFAULT false", pa.bool_()),
    ("dead", "BOOLEAN NOT NULL DEFAULT false", pa.bool_()),
    ("created_at", "TIMESTAMPTZ", pa.timestamp("us", tz="UTC")),
    ("updated_at", "TIMESTAMPTZ", pa.timestamp("us", tz="UTC")),
]
META_NAMES = {name for name, _, _ in META_COLUMNS}
#: Meta columns a producer may write; the store sets all the others.
WRITABLE_META = {"sample_id", "policy_version", "finished_version"}
#: Meta columns returned with every claimed row.
CLAIM_META = ["sample_id", "input_id", "turn", "trajectory_id", "policy_version",
              "finished_version", "delivery_count"]


@dataclass(frozen=True)
class ColumnDef:
    """One data column."""

    name: str
    type: pa.DataType
    storage: str = "auto"
    required: bool = True

    # Cached: the writer asks for both several times per column of every put (immutable here).
    @functools.cached_property
    def status(self) -> str:
        return f"{self.name}_status"

    @functools.cached_property
    def ref(self) -> str | None:
        """The DuckDB key column, or None for a column stored only by value."""
        if self.storage == "value" or not is_complex(self.type):
            return None
        return f"{self.name}__ref"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "type": type_name(self.type), "storage": self.storage,
                "required": self.required}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ColumnDef":
        return cls(d["name"], parse_type(d["type"]), d["storage"], d["required"])


def check_column_mapping(table: object, columns: object) -> None:
    """Refuse a table's data columns unless they are a non-empty mapping of name to type (what
    a client checks before sending, as :meth:`TableDef.build` does).

    Raises:
        InvalidArgument: naming what was given.
    """
    if not isinstance(columns, Mapping) or not columns:
        raise InvalidArgument(f"table {table!r} needs at least one data column, given as a "
                              "mapping of column name to type, e.g. {'reward': 'float64'}; got "
                              f"{type(columns).__name__} {columns!r}")


@dataclass(frozen=True)
class TableDef:
    """The definition of one experience table, as kept in the catalog."""

    name: str
    columns: tuple[ColumnDef, ...]
    version_group: str
    max_staleness: int = 0
    max_deliveries: int = 5
    lease_seconds: float = 60.0
    _by_name: dict[str, ColumnDef] = field(default_factory=dict, compare=False, repr=False)
    # schemas derived from the (immutable) definition, built once: claims ask for them often
    _schemas: dict[str, pa.Schema] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name.update({c.name: c for c in self.columns})

    @functools.cached_property
    def has_halves(self) -> bool:
        """Whether a data column holds half-precision values (held as their 16-bit patterns in
        DuckDB, see :mod:`store.halves`)."""
        return any(has_half(c.type) for c in self.columns)

    @classmethod
    def build(cls, name: str, columns: Mapping[str, Any], *, version_group: str | None = None,
              max_staleness: int = 0, max_deliveries: int = 5, lease_seconds: float = 60.0,
              storage: Mapping[str, str] | None = None,
              required: list[str] | None = None) -> "TableDef":
        """Validate a user's table definition.

        Args:
            columns: data column name → type spelling (see :mod:`store.types`).
            storage: column → ``"value" | "ref" | "auto"`` (default ``auto`` for complex types).
            required: data columns that must be complete before a row is ready (default all).
        """
        check_identifier(name, "table")
        # Only None means "no group": a falsy non-string ([], 0, "") is a mistake, not a default.
        group = check_identifier(version_group, "version group") \
            if version_group is not None else name
        check_column_mapping(name, columns)
        if storage is not None and not isinstance(storage, Mapping):
            raise InvalidArgument(f"storage {storage!r} is invalid; expected a mapping of column "
                                  "name to 'value', 'ref' or 'auto'")
        if required is not None and (not isinstance(required, (list, tuple, set, frozenset))
                                     or not all(isinstance(c, str) for c in required)):
            raise InvalidArgument(f"required {required!r} is invalid; expected a list of data "
                                  "column names")
        storage = dict(storage or {})
        required_set = set(columns) if required is None else set(required)
        for col in list(storage) + list(required_set):
            if col not in columns:
                raise InvalidArgument(f"column {col!r} named in storage/required is not a data "
                                      f"column of {name!r}; data columns: {sorted(columns)}")
        defs = []
        # SQL folds identifiers' case (quoted ones too): "A" beside "a", "Sample_ID" beside the
        # meta column sample_id or "X_STATUS" beside x's status column are one name to DuckDB.
        seen: dict[str, str] = {}
        for col, spec in columns.items():
            check_identifier(col, "column")
            folded = col.lower()
            if folded in META_NAMES:
                raise InvalidArgument(f"column name {col!r} is the meta column {folded!r} (names "
                                      "are case-insensitive in SQL); meta columns are "
                                      f"{sorted(META_NAMES)}")
            if folded.endswith("_status") or "__" in col:
                raise InvalidArgument(f"column name {col!r} is not allowed: names ending in "
                                      "'_status' (in any case) or containing '__' are reserved "
                                      "for the store's status and reference columns")
            if folded in seen:
                raise InvalidArgument(f"column names {seen[folded]!r} and {col!r} differ only in "
                                      "case, which makes them one name in SQL; choose another "
                                      "name for one of them")
            seen[folded] = col
            mode = storage.get(col, "auto")
            if mode not in STORAGE_MODES:
                raise InvalidArgument(f"storage {mode!r} of column {col!r} is unknown; expected "
                                      f"one of {', '.join(STORAGE_MODES)}")
            arrow_type = parse_type(spec)
            if mode == "ref" and not is_complex(arrow_type):
                raise InvalidArgument(f"column {col!r} of type {type_name(arrow_type)} cannot be "
                                      "stored by reference: only strings, binary, lists and "
                                      "tensors can")
            defs.append(ColumnDef(col, arrow_type, mode, col in required_set))
        for label, value, low in (("max_staleness", max_staleness, 0),
                                  ("max_deliveries", max_deliveries, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise InvalidArgument(f"{label} {value!r} is invalid; expected an integer ≥ {low}")
        if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, (int, float)) \
                or not 0 < lease_seconds <= 86400:
            raise InvalidArgument(f"lease_seconds {lease_seconds!r} is invalid; expected a "
                                  "number of seconds in (0, 86400]")
        return cls(name, tuple(defs), group, max_staleness, max_deliveries, float(lease_seconds))

    # -- lookups ---------------------------------------------------------------------------
    def column(self, name: str) -> ColumnDef:
        try:
            return self._by_name[name]
        except KeyError:
            raise InvalidArgument(f"table {self.name!r} has no data column {name!r}; data "
                                  f"columns: {[c.name for c in self.columns]}") from None

    def has_column(self, name: str) -> bool:
        return name in self._by_name

    @property
    def status_columns(self) -> list[str]:
        return [c.status for c in self.columns]

    @property
    def required_mask(self) -> int:
        return sum(1 << i for i, c in enumerate(self.columns) if c.required)

    # -- schemas ---------------------------------------------------------------------------
    def arrow_schema(self) -> pa.Schema:
        """The logical schema users read: meta, data (values resolved), status columns."""
        fields = [pa.field(n, t) for n, _, t in META_COLUMNS]
        fields += [pa.field(c.name, c.type) for c in self.columns]
        fields += [pa.field(c.status, pa.bool_()) for c in self.columns]
        return pa.schema(fields, metadata={"expstore.table": self.name})

    def claim_schema(self) -> pa.Schema:
        """What a claim returns: :data:`CLAIM_META`, data and status columns."""
        schema = self._schemas.get("claim")
        if schema is None:
            meta = {n: t for n, _, t in META_COLUMNS}
            fields = [pa.field(n, meta[n]) for n in CLAIM_META]
            fields += [pa.field(c.name, c.type) for c in self.columns]
            fields += [pa.field(c.status, pa.bool_()) for c in self.columns]
            schema = self._schemas["claim"] = pa.schema(
                fields, metadata={"expstore.table": self.name})
        return schema

    def payload_schema(self) -> pa.Schema:
        """Claimable values as cached in memory: claim columns but ``delivery_count`` (which
        changes), with blob keys in ``<col>__ref`` still unresolved."""
        meta = {n: t for n, _, t in META_COLUMNS}
        fields = [pa.field(n, meta[n]) for n in CLAIM_META if n != "delivery_count"]
        for c in self.columns:
            fields.append(pa.field(c.name, c.type))
            if c.ref:
                fields.append(pa.field(c.ref, pa.large_string()))
        fields += [pa.field(c.status, pa.bool_()) for c in self.columns]
        return pa.schema(fields)

    def write_schema(self) -> pa.Schema:
        """What a producer may send: ``sample_id``, optional versions, data and status columns."""
        fields = [pa.field("sample_id", pa.large_string(), nullable=False),
                  pa.field("policy_version", pa.int64()),
                  pa.field("finished_version", pa.int64())]
        fields += [pa.field(c.name, c.type) for c in self.columns]
        fields += [pa.field(c.status, pa.bool_()) for c in self.columns]
        return pa.schema(fields)

    def ddl(self) -> str:
        parts = [f"{quote(n)} {t}" for n, t, _ in META_COLUMNS]
        for c in self.columns:
            parts.append(f"{quote(c.name)} {duckdb_type(c.type)}")
            if c.ref:
                parts.append(f"{quote(c.ref)} VARCHAR")
            parts.append(f"{quote(c.status)} BOOLEAN NOT NULL DEFAULT false")
        # No PRIMARY KEY on (sample_id, policy_version): the writer thread, the only path to the
        # table, keeps keys unique itself (it decides new vs existing from the live and terminal
        # indexes, or asks DuckDB; see RowWriter._classify in store/rows_sql.py). DuckDB's key
        # index made every insert markedly slower (docs/bench/history.md, "The round of
        # 2026-11-24 10:10") and DuckDB 2.0 does not use a two-column index for the writer's
        # lookups anyway.
        # Tables made with the key by earlier versions keep it; both work the same.
        return f"CREATE TABLE {quote(self.name)} (\n  " + ",\n  ".join(parts) + "\n)"

    # -- catalog ---------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({
            "name": self.name, "columns": [c.to_json() for c in self.columns],
            "version_group": self.version_group, "max_staleness": self.max_staleness,
            "max_deliveries": self.max_deliveries, "lease_seconds": self.lease_seconds})

    @classmethod
    def from_json(cls, text: str) -> "TableDef":
        d = json.loads(text)
        return cls(d["name"], tuple(ColumnDef.from_json(c) for c in d["columns"]),
                   d["version_group"], d["max_staleness"], d["max_deliveries"],
                   d["lease_seconds"])

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "columns": [c.to_json() for c in self.columns],
                "version_group": self.version_group, "max_staleness": self.max_staleness,
                "max_deliveries": self.max_deliveries, "lease_seconds": self.lease_seconds}
