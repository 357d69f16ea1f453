"""Arrow IPC streams put together from serialized messages.

A stream writer (``pa.ipc.new_stream``) costs more to set up than writing the messages of a
one-row table; claim answers and put-log records are written once per call on the hot path.
"""
from __future__ import annotations

import pyarrow as pa

_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def ipc_stream(table: pa.Table) -> bytes:
    """``table`` as an Arrow IPC stream: its schema message, its batches, the end marker.

    Readable by ``pa.ipc.open_stream`` like a stream writer's output. Store tables have no
    dictionary columns, whose dictionaries a stream would also have to carry.
    """
    return b"".join([table.schema.serialize().to_pybytes(),
                     *(batch.serialize().to_pybytes() for batch in table.to_batches()),
                     _END_OF_STREAM])
