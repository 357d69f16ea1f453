"""The row SQL of puts, inside the writer's group transaction.

A run of puts with the same shape becomes one statement: their rows get row ids
(``RowWriter._row_ids``: numbered in one step when every key is new, else looked up), new rows
are inserted (``_insert``), rows that exist are updated column by column (``_update``), the rows'
claimable values go to the claim cache when the write holds them all (``_payload``), and the
effect on the in-memory index waits for the commit (``_index_block``, ``_index_effects``). In a
group going to the put log the statements become records instead (see store/putlog.py).
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, NamedTuple

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .blob_keys import chunk_key, keys_for
from .blobs import BlobStore
from .errors import StaleVersion, StorageError
from .halves import to_stored_table
from .index import StoreIndex
from .live import LEASED, LiveTable, Row, RowBlock
from .naming import quote
from .ops import KeyedRows, MergedPutOp, NotLoggable, PutOp, Txn
from .prepare import PreparedPut
from .settings import StoreSettings
from .sources import now_column, registered
from .types import one_array

#: Columns every row has, written as given.
_META = ("row_id", "sample_id", "input_id", "turn", "trajectory_id", "policy_version")


class RowWriter:
    """Writes puts' rows (see the module docstring); the writer owns one.

    Args:
        index: the in-memory index (versions, live tables, the claim cache).
        blobs: where by-reference values go.
        settings: the statement-shape thresholds (``values_insert_rows``, …).
    """

    def __init__(self, index: StoreIndex, blobs: BlobStore, settings: StoreSettings) -> None:
        self._index = index
        self._blobs = blobs
        self._settings = settings

    def write_puts(self, con: duckdb.DuckDBPyConnection, txn: Txn,
                   puts: list[tuple[int, PutOp]], results: list[Any]) -> None:
        """Run a run of consecutive puts (``results[i]`` answers op ``i``), merging those with
        the same shape into one statement."""
        index = self._index
        batch: list[tuple[PreparedPut, KeyedRows]] = []
        batch_keys: set[tuple[str, int]] | None = None  # built once a second put may join
        for i, op in puts:
            p = op.prepared
            live = index.live_table(p.table)
            self._check_versions(live, p)
            keyed = txn.physical.pop(id(op))
            version = index.version_of(live)
            if isinstance(op, MergedPutOp):
                results[i] = [{"rows": m.data.num_rows, "version": version} for m in op.members]
                txn.applies.append(functools.partial(index.count_put, p.rows, len(op.members)))
            else:
                results[i] = {"rows": p.rows, "version": version}
                txn.applies.append(functools.partial(index.count_put, p.rows))
            if batch:
                if batch_keys is None:
                    batch_keys = {k for q, _ in batch for k in q.keys}
                if batch[0][0].signature() != p.signature() or not batch_keys.isdisjoint(p.keys):
                    self._write_rows(con, txn, batch)
                    batch, batch_keys = [], None
                else:
                    batch_keys.update(p.keys)
            batch.append((p, keyed))
        if batch:
            self._write_rows(con, txn, batch)

    def _check_versions(self, live: LiveTable, p: PreparedPut) -> None:
        current = self._index.version_of(live)
        bound = current - live.tdef.max_staleness
        versions = p.physical.column("policy_version").to_numpy()
        high, low = int(versions.max()), int(versions.min())
        if high > current:
            raise StaleVersion(f"policy_version {high} is ahead of table {p.table!r}'s current "
                               f"version {current}; expected a version in [{max(bound, 0)}, "
                               f"{current}]")
        if low < bound:
            raise StaleVersion(
                f"policy_version {low} is stale for table {p.table!r}: its current version is "
                f"{current} and max_staleness {live.tdef.max_staleness} accepts versions ≥ "
                f"{bound}; regenerate the sample with the current policy")

    def with_blob_keys(self, p: PreparedPut) -> KeyedRows:
        """Append the put's chunks to the blob store; its rows with their ``__ref`` row indexes
        turned into blob keys (made before any statement of the group runs), and which of
        those columns name their chunk's rows 0 … n-1 in order (see :meth:`_payload`)."""
        physical = p.physical
        whole: dict[str, tuple[int, int, int] | None] = {}
        for ref in [n for n in physical.column_names if n.endswith("__ref")]:
            index = one_array(physical.column(ref))
            chunk = p.chunks.get(ref[: -len("__ref")])
            whole[ref] = None
            if chunk is None:
                keys = pa.nulls(len(index), pa.large_string())
            else:
                prefix = self._blobs.append(chunk)
                rows = len(index) - index.null_count
                keys = keys_for(prefix, rows)
                if _counts_up(index):
                    whole[ref] = chunk_key(prefix)
                else:
                    keys = keys.take(index)
            physical = physical.set_column(physical.schema.get_field_index(ref), ref, keys)
        return KeyedRows(physical, whole)

    def _write_rows(self, con: duckdb.DuckDBPyConnection, txn: Txn,
                    batch: list[tuple[PreparedPut, KeyedRows]]) -> None:
        """Write puts of one shape to one table as one INSERT and one UPDATE at most."""
        first = batch[0][0]
        live = self._index.live_table(first.table)
        physical = pa.concat_tables([t.rows for _, t in batch]) if len(batch) > 1 \
            else batch[0][1].rows
        # Puts written together: each key column spans several chunks, so names none whole.
        whole = batch[0][1].whole if len(batch) == 1 else {}
        keys = first.keys if len(batch) == 1 else [k for p, _ in batch for k in p.keys]
        set_mask = np.concatenate([p.set_mask for p, _ in batch])
        clear_mask = np.concatenate([p.clear_mask for p, _ in batch])
        ids = self._row_ids(con, txn, live, keys)
        physical = physical.append_column("row_id", pa.array(ids.row_ids, pa.int64()))
        current = self._index.version_of(live)
        # DuckDB holds half-precision values as their 16-bit patterns (store/halves.py).
        stored = to_stored_table(physical) if live.tdef.has_halves else physical
        if ids.is_new.any():
            new_rows = stored if ids.is_new.all() else stored.filter(pa.array(ids.is_new))
            self._insert(con, txn, live, first, new_rows, current)
        if (~ids.is_new).any():
            old_rows = stored.filter(pa.array(~ids.is_new)) if ids.is_new.any() else stored
            self._update(con, live, first, old_rows, current)
        payload, cached, complete = self._payload(txn, live, first, physical, keys, current,
                                                  whole)
        ready = (set_mask & live.required_mask) == live.required_mask
        if txn.logged is not None and (ready & ~complete).any():
            raise NotLoggable("a ready row's values would have to be read from DuckDB")
        if ids.fresh and payload is not None and complete.all() and ready.all():
            self._index_block(txn, live, physical, keys, ids, set_mask, cached)
        else:
            self._index_effects(txn, live, physical, keys, ids, set_mask, clear_mask, complete,
                                cached)

    # -- row ids --------------------------------------------------------------------------------
    def _row_ids(self, con: duckdb.DuckDBPyConnection, txn: Txn, live: LiveTable,
                 keys: list[tuple[str, int]]) -> "_RowIds":
        """The row id of each key: a new one, numbered in one step when every key is new (the
        bulk case), else looked up key by key (see :meth:`_classify`)."""
        tname = live.tdef.name
        n = len(keys)
        txn_rows = txn.new_rows(tname)
        next_id = txn.next_row_id.get(tname, live.next_row_id)
        terminal: set[int] = set()
        fresh = _all_fresh(live, txn_rows, keys)
        if txn.logged is not None and not fresh:
            raise NotLoggable("some rows may exist")
        if fresh:  # the bulk case: every row new, numbered in one step
            row_ids = np.arange(next_id, next_id + n, dtype=np.int64)
            txn.add_new_run(tname, keys, next_id)
            next_id += n
            is_new = np.ones(n, bool)
        else:
            row_ids, is_new, next_id = self._classify(con, live, tname, txn_rows, keys, next_id,
                                                      terminal)
        txn.next_row_id[tname] = next_id
        return _RowIds(row_ids, is_new, terminal, fresh, next_id)

    # -- INSERT ---------------------------------------------------------------------------------
    def _insert(self, con: duckdb.DuckDBPyConnection, txn: Txn, live: LiveTable,
                first: PreparedPut, new_rows: pa.Table, current: int) -> None:
        """Insert new rows: a put-log record in a logged group, a parametrised VALUES list for a
        few rows, else a registered Arrow table."""
        tname = live.tdef.name
        tdef = live.tdef
        # (column, SQL expression of the value written, with {} for the batch's column)
        inserted: list[tuple[str, str, str | None]] = [(c, "{}", c) for c in _META]
        inserted += [
            ("finished_version", f"coalesce({{}}, {int(current)})", "finished_version"),
            ("created_at", "now()", None), ("updated_at", "now()", None)]
        for c in first.data_columns:
            inserted.append((c, "{}", c))
            ref = tdef.column(c).ref
            if ref:
                inserted.append((ref, "{}", ref))
        for s in first.status_columns:
            inserted.append((s, "coalesce({}, false)", s))
        into = f"INSERT INTO {quote(tname)} ({', '.join(quote(c) for c, _, _ in inserted)}) "
        sources = [src for _, _, src in inserted if src is not None]
        if txn.logged is not None:
            txn.logged.append(("rows", {"table": tname},
                               _as_inserted(new_rows, inserted, current)))
        elif new_rows.num_rows <= self._settings.values_insert_rows and \
                _bindable(new_rows, sources):
            # A few rows: one parametrised INSERT … VALUES costs less than register +
            # INSERT … SELECT + unregister, whose cost is the same whatever the rows (from a
            # handful of rows on, the registered table wins); the same expressions, with
            # parameters.
            one = "(" + ", ".join(e.format("?") for _, e, _ in inserted) + ")"
            by_col = [new_rows.column(src).to_pylist() for src in sources]
            params = [col[r] for r in range(new_rows.num_rows) for col in by_col]
            con.execute(into + "VALUES " + ", ".join([one] * new_rows.num_rows), params)
        else:
            exprs = [e.format(f"b.{quote(src)}") if src else e for _, e, src in inserted]
            with registered(con, "_expstore_new", new_rows):
                con.execute(into + f"SELECT {', '.join(exprs)} FROM _expstore_new AS b")

    # -- UPDATE ---------------------------------------------------------------------------------
    def _update(self, con: duckdb.DuckDBPyConnection, live: LiveTable, first: PreparedPut,
                old_rows: pa.Table, current: int) -> None:
        """Update rows that exist: only the columns the write gives (a null keeps the stored
        value); a parametrised VALUES list for a few rows, else a registered Arrow table."""
        tname = live.tdef.name
        tdef = live.tdef
        data_cols = first.data_columns
        status_cols = first.status_columns
        sets = [f"finished_version = coalesce(b.finished_version, {int(current)})",
                "updated_at = now()"]
        for c in data_cols:
            w = quote(f"{c}__w")
            sets.append(f"{quote(c)} = CASE WHEN b.{w} THEN b.{quote(c)} ELSE t.{quote(c)} END")
            ref = tdef.column(c).ref
            if ref:
                sets.append(f"{quote(ref)} = CASE WHEN b.{w} THEN b.{quote(ref)} "
                            f"ELSE t.{quote(ref)} END")
        for s in status_cols:
            sets.append(f"{quote(s)} = coalesce(b.{quote(s)}, t.{quote(s)})")
        update = f"UPDATE {quote(tname)} AS t SET {', '.join(sets)} FROM "
        used = ["row_id", "finished_version"]
        for c in data_cols:
            used += [c, f"{c}__w"] + ([ref] if (ref := tdef.column(c).ref) else [])
        used += status_cols
        if old_rows.num_rows <= self._settings.values_update_rows and _bindable(old_rows, used):
            # A few rows (partial writes of single samples): the batch's columns as a
            # parametrised VALUES list instead of a registered Arrow table.
            one = "(" + ", ".join(["?"] * len(used)) + ")"
            by_col = [old_rows.column(c).to_pylist() for c in used]
            params = [col[r] for r in range(old_rows.num_rows) for col in by_col]
            updated = con.execute(
                update + f"(VALUES {', '.join([one] * old_rows.num_rows)}) AS b("
                f"{', '.join(map(quote, used))}) WHERE t.row_id = b.row_id", params).fetchall()
        else:
            with registered(con, "_expstore_old", old_rows):
                updated = con.execute(update + "_expstore_old AS b WHERE t.row_id = b.row_id"
                                      ).fetchall()
        _check_updated(updated, old_rows.num_rows, tname)

    # -- cache admission ------------------------------------------------------------------------
    def _payload(self, txn: Txn, live: LiveTable, first: PreparedPut, physical: pa.Table,
                 keys: list[tuple[str, int]], current: int,
                 whole: Mapping[str, tuple[int, int, int] | None]
                 ) -> tuple[pa.Table | None, pa.Table | None, np.ndarray]:
        """The rows' claimable values if the write holds every data column (else None); the
        same if the claim cache keeps them (else None); which rows wrote every data column (only
        those may take their values from it: a null value leaves the stored one, which the
        write lacks).

        ``whole``: by ``__ref`` column of ``physical``, the chunk whose rows 0 … n-1 it names
        in order, or None (absent: None); recorded for the cached table's key columns, so that
        a claim need not check its keys again (:meth:`BlobStore.know_whole`)."""
        tdef = live.tdef
        if len(first.data_columns) != len(tdef.columns):
            return None, None, np.zeros(len(keys), bool)
        # The write carries every data column: the row's claimable values are all here.
        values: dict[str, Any] = {n: physical.column(n) for n in _META[1:]}
        values["finished_version"] = _or(physical.column("finished_version"),
                                         pa.scalar(int(current), pa.int64()))
        for col in tdef.columns:
            values[col.name] = physical.column(col.name)
            if col.ref:
                values[col.ref] = physical.column(col.ref)
        for col in tdef.columns:
            values[col.status] = _or(physical.column(col.status), _FALSE)
        # The columns have the cache's types already (a cast of the table was most of a
        # one-row put's Python in the writer after its INSERT).
        schema = live.payload_schema
        payload = pa.Table.from_arrays([values[f.name] for f in schema], schema=schema)
        cache = self._index.cache
        cached = None
        if txn.logged is not None:  # DuckDB cannot serve these rows before the log is applied
            cache.hold(payload)
            txn.logged_values.append((live, keys, payload))
            cached = payload
        elif cache.admit(payload):
            cached = payload
        if cached is not None:
            self._blobs.know_whole(cached, {schema.get_field_index(col.ref): whole.get(col.ref)
                                            for col in tdef.columns if col.ref})
        complete = np.logical_and.reduce([
            physical.column(f"{c.name}__w").to_numpy(zero_copy_only=False).astype(bool)
            for c in tdef.columns])
        return payload, cached, complete

    # -- index effects, after the commit ---------------------------------------------------------
    def _index_block(self, txn: Txn, live: LiveTable, physical: pa.Table,
                     keys: list[tuple[str, int]], ids: "_RowIds", set_mask: np.ndarray,
                     cached: pa.Table | None) -> None:
        """Every row new, ready and with its values at hand (the bulk case): indexed as one
        block, its rows built when a claim or a write first touches their group."""
        index = self._index
        codes, group_keys = _group_codes(physical)
        block = RowBlock(keys, ids.row_ids, physical.column("turn").to_numpy(),
                         physical.column("trajectory_id").to_numpy(), set_mask, codes,
                         cached, group_keys)
        next_id = ids.next_id

        def apply_block() -> None:
            if index.live.get(live.tdef.name) is not live:
                return  # dropped meanwhile
            live.next_row_id = max(live.next_row_id, next_id)
            live.add_block(block)

        txn.applies.append(apply_block)

    def _index_effects(self, txn: Txn, live: LiveTable, physical: pa.Table,
                       keys: list[tuple[str, int]], ids: "_RowIds", set_mask: np.ndarray,
                       clear_mask: np.ndarray, complete: np.ndarray,
                       cached: pa.Table | None) -> None:
        """Row by row: new rows enter the index, written rows' status bits change (ready or
        not), their cached values are replaced; leased rows keep their lease."""
        index = self._index
        tname = live.tdef.name
        next_id = ids.next_id
        terminal = ids.terminal
        input_ids = physical.column("input_id").to_pylist()
        turns = physical.column("turn").to_pylist()
        trajs = physical.column("trajectory_id").to_pylist()
        ids_list = ids.row_ids.tolist()
        new_list = ids.is_new.tolist()
        sets = set_mask.tolist()
        clears = clear_mask.tolist()
        complete_list = complete.tolist()

        def apply() -> None:
            if index.live.get(tname) is not live:
                return  # dropped meanwhile
            live.next_row_id = max(live.next_row_id, next_id)
            required = live.required_mask
            rows = live.rows
            rows_get = rows.get
            add_ready = live.add_ready
            for i, key in enumerate(keys):
                rid = ids_list[i]
                if terminal and rid in terminal:
                    continue
                row = rows_get(key)
                if isinstance(row, RowBlock):
                    row = live.row(key)  # still in a bulk put's block: build it
                if row is None:
                    if not new_list[i]:
                        continue  # consumed or gone since: nothing live to update
                    # A new row (the bulk case): its mask is what this write set.
                    mask = sets[i]
                    row = Row(rid, key[0], key[1], input_ids[i], turns[i], trajs[i], mask)
                    rows[key] = row
                    if cached is not None and complete_list[i]:
                        row.payload = (cached, i)
                    if mask & required == required:
                        add_ready(row, key)
                        if row.payload is None:
                            txn.need_payload.append((live, row))
                    continue
                row.mask = (row.mask & ~clears[i]) | sets[i]
                row.payload = (cached, i) if cached is not None and complete_list[i] else None
                if row.state == LEASED:
                    continue
                if row.mask & required == required:
                    live.make_ready(row)
                    if row.payload is None:
                        txn.need_payload.append((live, row))
                else:
                    live.unready(row)
        txn.applies.append(apply)

    # -- looking keys up ----------------------------------------------------------------------
    def _classify(self, con: duckdb.DuckDBPyConnection, live: LiveTable, tname: str,
                  txn_rows: dict[tuple[str, int], int], keys: list[tuple[str, int]], next_id: int,
                  terminal: set[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """Row ids of ``keys``: a live row's, one new earlier in this transaction's, a terminal
        row's (added to ``terminal``: the write updates it) or a new one from ``next_id``.

        Returns (row ids, which are new, the next free row id).
        """
        n = len(keys)
        first_id = next_id
        rows_get = live.rows.get
        txn_get = txn_rows.get
        # Keys neither live nor new in this transaction may be terminal rows (consumed, stale,
        # dead: an at-least-once producer re-sending); the write then updates them instead of
        # inserting the key twice. The table's terminal index answers; without one, DuckDB.
        terminal_index = live.terminal
        ids: list[int] = [0] * n
        new_flags: list[bool] = [False] * n
        for i, key in enumerate(keys):
            row = rows_get(key)
            if row is not None:
                ids[i] = row.row_id_of(key) if isinstance(row, RowBlock) else row.row_id
                continue
            known = txn_get(key)
            if known is not None:
                ids[i] = known
                continue
            if terminal_index is not None:
                by_sid = terminal_index.get(key[1])
                rid = by_sid.get(key[0]) if by_sid is not None else None
                if rid is not None:
                    ids[i] = rid
                    terminal.add(rid)
                    continue
            ids[i] = next_id
            txn_rows[key] = next_id
            next_id += 1
            new_flags[i] = True
        row_ids = np.array(ids, np.int64)
        is_new = np.array(new_flags, bool)
        # No index (or it was given up while we looked: forget() fills it before a row leaves
        # ``rows``, so only its removal can hide a key): ask DuckDB about the keys left.
        if is_new.any() and (terminal_index is None or live.terminal is not terminal_index):
            found = self._existing_rows(con, tname, [keys[i] for i in np.nonzero(is_new)[0]])
            if found:
                for i in np.nonzero(is_new)[0].tolist():
                    rid = found.get(keys[i])
                    if rid is not None:
                        txn_rows.pop(keys[i], None)
                        row_ids[i] = int(rid)
                        is_new[i] = False
                        terminal.add(int(rid))
                # Re-number what is really new so row ids stay dense.
                next_id = first_id
                for i in np.nonzero(is_new)[0].tolist():
                    row_ids[i] = next_id
                    txn_rows[keys[i]] = next_id
                    next_id += 1
        return row_ids, is_new, next_id

    def _existing_rows(self, con: duckdb.DuckDBPyConnection, table: str,
                       keys: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Row ids of keys already in DuckDB (only terminal rows can be; live ones are known)."""
        if not self._index.may_have_terminal_rows(table):
            return {}
        # a few filtered scans cost less than one join
        if len(keys) <= self._settings.point_lookup_keys:
            out: dict[tuple[str, int], int] = {}
            for key in keys:
                hit = con.execute(
                    f"SELECT row_id FROM {quote(table)} WHERE sample_id = ? AND policy_version = ?",
                    list(key)).fetchall()
                if hit:
                    out[key] = int(hit[0][0])
            return out
        probe = pa.table({"sample_id": [k[0] for k in keys],
                          "policy_version": pa.array([k[1] for k in keys], pa.int64())})
        with registered(con, "_expstore_probe", probe):
            found = con.execute(
                f"SELECT t.sample_id, t.policy_version, t.row_id FROM {quote(table)} AS t "
                "JOIN _expstore_probe AS p USING (sample_id, policy_version)").fetchall()
        return {(s, int(v)): int(r) for s, v, r in found}


class _RowIds(NamedTuple):
    """The row ids of a batch's keys (see :meth:`RowWriter._row_ids`)."""

    row_ids: np.ndarray
    is_new: np.ndarray
    terminal: set[int]      # terminal rows the write updates (consumed, stale, dead)
    fresh: bool             # every key new: numbered in one step
    next_id: int            # the table's next free row id after them


def _group_codes(physical: pa.Table) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """Each row's group number, groups numbered in the order they first appear, and the groups'
    keys ``(policy_version, input_id)``.

    Why Arrow: a bulk put's rows have one version, and dictionary-encoding the input ids numbers
    the groups the same way as a dict filled row by row, at a fraction of its cost.
    """
    versions = physical.column("policy_version")
    bounds = pc.min_max(versions)
    version = bounds["min"].as_py()
    if version == bounds["max"].as_py():
        encoded = pc.dictionary_encode(physical.column("input_id").combine_chunks())
        return (encoded.indices.to_numpy(zero_copy_only=False),
                [(version, iid) for iid in encoded.dictionary.to_pylist()])
    by_group: dict[tuple[int, str], int] = {}
    get = by_group.get
    codes: list[int] = []
    for gk in zip(versions.to_pylist(), physical.column("input_id").to_pylist()):
        g = get(gk)
        if g is None:
            g = by_group[gk] = len(by_group)
        codes.append(g)
    return np.array(codes, np.int64), list(by_group)


def _all_fresh(live: LiveTable, txn_rows: dict[tuple[str, int], int],
               keys: list[tuple[str, int]]) -> bool:
    """Whether every key is new: not live, not new earlier in this transaction, not a remembered
    terminal row (False without a terminal index: DuckDB must be asked).

    Why: a bulk put's keys are all new, and set operations check them many times faster than the
    per-key loop of :meth:`RowWriter._classify`.
    """
    terminal = live.terminal
    if terminal is None or not live.rows.keys().isdisjoint(keys) \
            or (txn_rows and not txn_rows.keys().isdisjoint(keys)):
        return False
    if terminal:
        versions = {v for _, v in keys}
        for version in [v for v in versions if v in terminal]:
            sids = (s for s, v in keys if v == version) if len(versions) > 1 else \
                (s for s, _ in keys)
            if not terminal[version].keys().isdisjoint(sids):
                return False
    # A row forgotten meanwhile is remembered before it leaves ``rows``, unless the index was
    # given up (see RowWriter._classify).
    return live.terminal is terminal


def _as_inserted(rows: pa.Table, inserted: list[tuple[str, str, str | None]],
                 current: int) -> pa.Table:
    """The rows an ``INSERT`` of ``inserted`` (column, SQL expression, source column) would
    write, computed in Arrow, for the put log."""
    n = rows.num_rows
    now = now_column(n)
    columns: list[Any] = []
    for _, expression, source in inserted:
        if source is None:
            assert expression == "now()", expression
            columns.append(now)
        elif expression == "{}":
            columns.append(rows.column(source))
        elif expression == "coalesce({}, false)":
            columns.append(_or(rows.column(source), _FALSE))
        else:
            assert expression == f"coalesce({{}}, {int(current)})", expression
            column = rows.column(source)
            columns.append(pa.array(np.full(n, current, np.int64)) if column.null_count == n
                           else _or(column, pa.scalar(int(current), pa.int64())))
    return pa.Table.from_arrays(columns, names=[c for c, _, _ in inserted])


_FALSE = pa.scalar(False)


def _counts_up(index: pa.Array) -> bool:
    """Whether row index ``index`` is 0 … n-1 with no nulls (n > 0): its keys are then its
    chunk's rows in order."""
    if not len(index) or index.null_count:
        return False
    at = index.to_numpy()
    return bool(np.array_equal(at, np.arange(len(at), dtype=at.dtype)))


def _or(column: pa.ChunkedArray, default: pa.Scalar) -> pa.ChunkedArray:
    """``coalesce(column, default)``, without a kernel call when nothing is null."""
    return pc.coalesce(column, default) if column.null_count else column


def _bindable(table: pa.Table, names: list[str]) -> bool:
    """Whether these columns go through Python values to DuckDB parameters unchanged."""
    return all(_bindable_type(table.schema.field(n).type) for n in names)


def _bindable_type(t: pa.DataType) -> bool:
    return (pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_float32(t)
            or pa.types.is_float64(t) or pa.types.is_large_string(t)
            or pa.types.is_string(t))


def _check_updated(result: list[tuple], expected: int, table: str) -> None:
    """Every row a put updates exists: a miss would lose the write, so the transaction fails."""
    if result and int(result[0][0]) != expected:
        raise StorageError(f"a write to {table!r} updated {int(result[0][0])} rows, expected "
                           f"{expected}; nothing was written")


