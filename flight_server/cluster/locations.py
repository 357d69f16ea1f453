"""Location keys: where a by-reference value of a cluster table lives.

A data node stores each column of a put as one chunk of its blob store and names it
``node@segment:offset:length``; with a replica, the chunk's holders are joined by ``,``. A row's
location key is its chunk's holders, ``/`` and the row's index in the chunk::

    dn-1@0:4096:81920/17                       one holder
    dn-1@0:4096:81920,dn-2@3:0:81920/17        the value on two nodes

The coordinator stores these strings in the table (a by-value string column); a consumer
fetches the values from any holder (its own node's first).
"""
from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from store.errors import InvalidArgument

NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_HOLDER = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.-]{0,62})@([0-9]+:[0-9]+:[0-9]+)")


class Holder(NamedTuple):
    node: str
    chunk: str          # "segment:offset:length" in that node's blob store


def check_node_id(node_id: object) -> str:
    if not isinstance(node_id, str) or not NODE_ID.fullmatch(node_id):
        raise InvalidArgument(f"data node id {node_id!r} is invalid; expected 1-63 letters, "
                              "digits, '_', '.' or '-', starting with a letter or digit")
    return node_id


def chunk_location(holders: list[Holder]) -> str:
    return ",".join(f"{h.node}@{h.chunk}" for h in holders)


def parse_key(key: str) -> tuple[tuple[Holder, ...], int]:
    """A row's holders and its row index in the chunk.

    Raises:
        InvalidArgument: naming the key and the expected form.
    """
    where, sep, row = key.rpartition("/")
    holders = []
    for part in where.split(",") if sep else ():
        m = _HOLDER.fullmatch(part)
        if m is None:
            break
        holders.append(Holder(m.group(1), m.group(2)))
    else:
        if holders and row.isdigit():
            return tuple(holders), int(row)
    raise InvalidArgument(f"location key {key!r} is malformed; expected "
                          "'node@segment:offset:length[,node@…]/row'")


def row_numbers(rows: int) -> pa.Array:
    """``"0" … "{rows-1}"`` as a large_string array: the row part of a chunk's keys."""
    return pc.cast(pa.array(np.arange(rows, dtype=np.int64)), pa.large_string())


def row_keys(location: str, rows: int | pa.Array) -> pa.Array:
    """``location/0 … location/{rows-1}`` as a large_string array, built vectorised (``rows``:
    a count, or its :func:`row_numbers`, made once for the chunks of a put)."""
    numbers = row_numbers(rows) if isinstance(rows, int) else rows
    return pc.binary_join_element_wise(pa.scalar(location, pa.large_string()), numbers,
                                       pa.scalar("/", pa.large_string()))


def lost_predicate(column: str, lost: list[str]) -> str:
    """SQL: the value in ``column`` has no holder outside ``lost`` (every holder is gone).

    Node ids are checked (letters, digits, ``_.-``), so they can stand as literals; the column
    name is a checked identifier. At most two holders (``replicas`` ≤ 2)."""
    names = ", ".join(f"'{check_node_id(n)}'" for n in lost)
    first = f"split_part(split_part(\"{column}\", ',', 1), '@', 1)"
    second = f"split_part(\"{column}\", ',', 2)"
    return (f"(\"{column}\" IS NOT NULL AND {first} IN ({names}) AND "
            f"({second} = '' OR split_part({second}, '@', 1) IN ({names})))")


def degraded_predicate(column: str, lost: list[str]) -> str:
    """SQL: the value in ``column`` has two holders, one of them in ``lost`` and the other not
    (one copy left: what re-replication restores). Checked as :func:`lost_predicate`."""
    names = ", ".join(f"'{check_node_id(n)}'" for n in lost)
    first = f"split_part(split_part(\"{column}\", ',', 1), '@', 1)"
    second = f"split_part(split_part(\"{column}\", ',', 2), '@', 1)"
    return (f"(\"{column}\" IS NOT NULL AND {second} <> '' AND "
            f"(({first} IN ({names})) <> ({second} IN ({names}))))")


def holder_segments_sql(table: str, column: str) -> str:
    """SQL: every (node, segment) a location key of ``column`` names, distinct; the names are
    checked identifiers."""
    return (f"SELECT DISTINCT split_part(h, '@', 1) AS node, "
            f"CAST(split_part(split_part(h, '@', 2), ':', 1) AS BIGINT) AS segment FROM ("
            f"SELECT unnest(string_split(regexp_replace(\"{column}\", '/[0-9]+$', ''), ',')) "
            f"AS h FROM \"{table}\" WHERE \"{column}\" IS NOT NULL) AS holders")


def parse_holder(text: str) -> Holder:
    """``node@segment:offset:length`` (one holder of a chunk, as a data node answers it)."""
    m = _HOLDER.fullmatch(text)
    if m is None:
        raise InvalidArgument(f"chunk location {text!r} is malformed; expected "
                              "'node@segment:offset:length'")
    return Holder(m.group(1), m.group(2))
