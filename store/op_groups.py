"""How the writer cuts what it took from its queue into the groups it commits: each read apart
between runs of the others, each version bump with only the acks queued right before it, and
runs of small puts prepared together (merged into one put where they can be), split again when
a group fails and is retried op by op.

The writer (store/writer.py) commits each group; these functions only decide what goes
together, given the index whose tables prepare the puts.
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from .index import StoreIndex
from .ops import BumpOp, MergedPutOp, Op, PutOp, ReadOp, SettleOp, SmallPutOp, fail


def prepare_small(index: StoreIndex, ops: list[Op], merged_put_rows: int) -> list[Op]:
    """Replace small puts by prepared ones, merging runs of them to the same table and schema
    (up to ``merged_put_rows`` rows a run).

    A put that fails preparation fails alone, and leaves the group.
    """
    out: list[Op] = []
    run: list[SmallPutOp] = []
    rows = 0
    for op in ops:
        if isinstance(op, SmallPutOp):
            if run and (op.table != run[0].table or rows + op.data.num_rows > merged_put_rows
                        or not op.data.schema.equals(run[0].data.schema)):
                out.extend(_prepare_run(index, run))
                run, rows = [], 0
            run.append(op)
            rows += op.data.num_rows
            continue
        if run:
            out.extend(_prepare_run(index, run))
            run, rows = [], 0
        out.append(op)
    if run:
        out.extend(_prepare_run(index, run))
    return out


def _prepare_run(index: StoreIndex, run: list[SmallPutOp]) -> list[Op]:
    if len(run) > 1:
        try:
            merged = pa.concat_tables([op.data for op in run])
            # Two puts of one sample stay apart: prepare would merge them into one row.
            if pc.count_distinct(merged.column("sample_id")).as_py() == merged.num_rows:
                return [MergedPutOp(index.prepare(run[0].table, merged), run)]
        except Exception:  # noqa: BLE001 - one of them is bad: prepare each to find it
            pass
    out: list[Op] = []
    for op in run:
        try:
            put = PutOp(index.prepare(op.table, op.data))
        except Exception as e:  # noqa: BLE001 - handed to this put's caller
            fail(op, e)
            continue
        put.future = op.future
        out.append(put)
    return out


def merged_apart(index: StoreIndex, ops: list[Op]) -> list[Op]:
    """The ops of a failed group, to be retried one by one (merged puts split again)."""
    out: list[Op] = []
    for op in ops:
        if isinstance(op, MergedPutOp):
            for member in op.members:
                out.extend(_prepare_run(index, [member]))
        else:
            out.append(op)
    return out


def reads_apart(ops: list[Op]) -> list[list[Op] | ReadOp]:
    """The ops in order, each read on its own between the runs of the others (a run may be
    empty: lease bookkeeping alone)."""
    parts: list[list[Op] | ReadOp] = []
    run: list[Op] = []
    for op in ops:
        if isinstance(op, ReadOp):
            if run:
                parts.append(run)
                run = []
            parts.append(op)
        else:
            run.append(op)
    if run or not parts:
        parts.append(run)
    return parts


def bumps_apart(ops: list[Op]) -> list[list[Op]]:
    """Split a group so that every version bump commits with nothing but the acks queued right
    before it; whatever follows a bump starts a new group.

    Why: puts are checked against, and nacks settled by, the in-memory versions and rows, which a
    transaction updates only after its commit. A put sharing a transaction with a bump would be
    checked against the old version, and its rows would miss the bump's stale marking: a
    strictly on-policy trainer would then be handed samples of the previous policy. Acks before
    a bump may share its commit (one fsync for a trainer's last ack and its bump): the rows they
    consume are leased, which the bump's stale marking passes over, and they record the version
    before the bump, as they would in a commit of their own.
    """
    parts: list[list[Op]] = [[]]
    for op in ops:
        if isinstance(op, BumpOp):
            if not all(isinstance(o, SettleOp) and o.ack for o in parts[-1]):
                parts.append([])
            parts[-1].append(op)
            parts.append([])
        else:
            parts[-1].append(op)
    return [p for p in parts if p] or [[]]
