"""What a claim asks for and what it returns."""
from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from .errors import InvalidArgument
from .naming import check_identifier
from .sqlguard import predicate_query

MAX_CLAIM_ROWS = 100_000
GROUP_COLUMNS = ("input_id",)


def claim_requests(requests: object) -> list["ClaimRequest"]:
    """``claim_many``'s requests as a list, each a :class:`ClaimRequest`.

    Raises:
        InvalidArgument: naming what was given instead.
    """
    if isinstance(requests, (str, bytes)) or not hasattr(requests, "__iter__"):
        raise InvalidArgument(f"claim_many takes a list of ClaimRequest, e.g. "
                              f"[ClaimRequest('solver', 16)]; got {type(requests).__name__} "
                              f"{requests!r}")
    out = list(requests)  # type: ignore[call-overload]
    for i, request in enumerate(out):
        if not isinstance(request, ClaimRequest):
            raise InvalidArgument(f"claim_many request {i} is {type(request).__name__} "
                                  f"{request!r}; expected a ClaimRequest, e.g. "
                                  "ClaimRequest('solver', 16)")
    return out


@dataclass(frozen=True)
class ClaimRequest:
    """Up to ``limit`` ready rows of ``table`` matching ``where``.

    Args:
        where: a boolean SQL expression over the table's columns (``"reward > 0"``), or a group
            filter such as ``"input_id IN (SELECT input_id FROM t GROUP BY 1 HAVING
            stddev(reward) > 0)"``.
        group_by: ``"input_id"`` to deliver only complete groups of ``group_size`` rows that share
            an input id and policy version, never splitting one.
        min_rows: deliver nothing unless at least this many rows can be claimed.
    """

    table: str
    limit: int
    where: str | None = None
    group_by: str | None = None
    group_size: int | None = None
    min_rows: int = 1

    def validated(self) -> "ClaimRequest":
        check_identifier(self.table, "table")
        if not _is_int(self.limit) or not 1 <= self.limit <= MAX_CLAIM_ROWS:
            raise InvalidArgument(f"claim limit {self.limit!r} is invalid; expected an integer "
                                  f"in [1, {MAX_CLAIM_ROWS}]")
        if not _is_int(self.min_rows) or not 1 <= self.min_rows <= self.limit:
            raise InvalidArgument(f"min_rows {self.min_rows!r} is invalid; expected an integer "
                                  f"in [1, limit={self.limit}]")
        if self.group_by is not None or self.group_size is not None:
            if self.group_by is None:
                raise InvalidArgument(f"group_size {self.group_size!r} needs group_by, the "
                                      f"column whose groups are claimed whole: one of "
                                      f"{GROUP_COLUMNS}")
            if self.group_size is None and self.group_by in GROUP_COLUMNS:
                raise InvalidArgument(f"group_by {self.group_by!r} needs group_size, the rows "
                                      f"of each group (an integer in [1, limit={self.limit}])")
            if self.group_by not in GROUP_COLUMNS:
                raise InvalidArgument(f"group_by {self.group_by!r} is not supported; expected "
                                      f"one of {GROUP_COLUMNS}")
            if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) \
                    or not 1 <= self.group_size <= self.limit:
                raise InvalidArgument(f"group_size {self.group_size!r} is invalid; expected an "
                                      f"integer in [1, limit={self.limit}]")
        if self.where is not None:
            predicate_query(self.table, self.where)
        return self


@dataclass
class Claim:
    """Rows leased to one consumer until ``expires_at`` (seconds since the epoch).

    ``tables`` maps each table to its claimed rows (meta, data with references resolved, status
    columns); ``data`` is the first table's rows, for the common one-table claim. An empty claim
    (nothing ready) has ``claim_id == ""``, holds no lease, and maps every table it asked for to
    an empty table with that table's claim schema.
    """

    claim_id: str
    consumer: str
    expires_at: float
    tables: dict[str, pa.Table] = field(default_factory=dict)

    @property
    def table(self) -> str:
        return next(iter(self.tables), "")

    @property
    def data(self) -> pa.Table:
        return next(iter(self.tables.values())) if self.tables else pa.table({})

    @property
    def num_rows(self) -> int:
        return sum(t.num_rows for t in self.tables.values())

    def __len__(self) -> int:
        return self.num_rows

    def __bool__(self) -> bool:
        return self.num_rows > 0


MAX_CONSUMER_CHARS = 256


def check_consumer(consumer: object) -> str:
    """A claim's consumer name as leases show it: ``"anonymous"`` for None or ""."""
    if consumer is None or consumer == "":
        return "anonymous"
    if not isinstance(consumer, str):
        raise InvalidArgument(f"consumer {consumer!r} is not a string; expected a name such as "
                              "'trainer-0'")
    if len(consumer) > MAX_CONSUMER_CHARS or not consumer.isprintable():
        raise InvalidArgument(f"consumer {consumer[:80]!r} is not allowed; expected at most "
                              f"{MAX_CONSUMER_CHARS} printable characters")
    return consumer


def check_lease_seconds(seconds: object) -> None:
    """A claim's lease length: None (the table's) or a number of seconds in (0, 86400]."""
    if seconds is not None and (not isinstance(seconds, (int, float)) or isinstance(seconds, bool)
                                or not 0 < seconds <= 86400):
        raise InvalidArgument(f"lease_seconds {seconds!r} is invalid; expected a number of "
                              "seconds in (0, 86400]")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
