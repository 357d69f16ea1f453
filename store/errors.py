"""The store's error hierarchy.

Every error a caller can act on is a subclass of :class:`ExpstoreError`. The Flight server
translates each class to one Flight error type at exactly one boundary
(``flight_server/errors.py``), and the remote client translates it back, so code written against
the embedded store catches the same classes against a server.
"""
from __future__ import annotations

import re


class ExpstoreError(Exception):
    """Base class of all expstore errors."""

    #: A stable machine-readable name, sent over the wire so clients can rebuild the class.
    code = "internal"


class InvalidArgument(ExpstoreError):
    """A value the caller passed is malformed: a name, a type, a sample id, a limit."""

    code = "invalid_argument"


class SchemaMismatch(InvalidArgument):
    """A batch's columns or types do not match the table's definition."""

    code = "schema_mismatch"


class NotFound(ExpstoreError):
    """A table, claim or version group does not exist."""

    code = "not_found"


class AlreadyExists(ExpstoreError):
    """A table is created twice without ``if_not_exists``."""

    code = "already_exists"


class VersionConflict(ExpstoreError):
    """A compare-and-set version bump lost: the version was not the expected one."""

    code = "version_conflict"


class BarrierTimeout(ExpstoreError):
    """A version group's barrier waited its timeout for a member that never arrived: nothing
    was bumped (see store/barrier.py)."""

    code = "barrier_timeout"


class StaleVersion(ExpstoreError):
    """A write names a policy version outside the table's staleness bound, or in the future."""

    code = "stale_version"


class LeaseExpired(ExpstoreError):
    """An ack or nack arrived for a claim whose lease has expired or been revoked."""

    code = "lease_expired"


class QueryRefused(ExpstoreError):
    """SQL through the query path that is not a single read-only SELECT."""

    code = "query_refused"


class QueryTimeout(ExpstoreError):
    """A query ran past its time limit and was cancelled."""

    code = "query_timeout"


class QueryBusy(QueryTimeout):
    """No query slot became free within the time limit: the server was running as many queries
    (and claim predicates) as it allows. Nothing ran; retrying later may succeed."""

    code = "query_busy"


class CatalogOutdated(ExpstoreError):
    """The database's catalog is older (or newer) than this version of expstore."""

    code = "catalog_outdated"


class StoreClosed(ExpstoreError):
    """The store was closed, or its writer stopped after a fatal error."""

    code = "store_closed"


class StorageError(ExpstoreError):
    """The disk or blob store failed: disk full, read-only directory, a missing or corrupt blob."""

    code = "storage_error"


class Unauthenticated(ExpstoreError):
    """No valid token was presented."""

    code = "unauthenticated"


class PermissionDenied(ExpstoreError):
    """The token's role may not perform this operation."""

    code = "permission_denied"


class Unavailable(ExpstoreError):
    """The server cannot be reached or is shutting down; retrying later may succeed."""

    code = "unavailable"


class StorageUnavailable(Unavailable, StorageError):
    """The database cannot be written for now (a full disk, a checkpoint that failed): nothing
    of the change was stored. The store retries on its own and takes writes again once the
    cause is gone (``health`` says ``failed`` with the cause until then), so retrying later may
    succeed: a kind of ``unavailable`` and of ``storage_error``."""

    code = "storage_unavailable"


class TableFull(Unavailable):
    """A put would take a table past its store's limit of live rows (``max_live_rows``): the
    consumers are behind; retrying once they have consumed may succeed."""

    code = "table_full"


ERROR_CLASSES: dict[str, type[ExpstoreError]] = {
    cls.code: cls
    for cls in (
        ExpstoreError, InvalidArgument, SchemaMismatch, NotFound, AlreadyExists,
        VersionConflict, BarrierTimeout, StaleVersion, LeaseExpired, QueryRefused, QueryTimeout,
        QueryBusy, CatalogOutdated, StoreClosed, StorageError, Unauthenticated,
        PermissionDenied, Unavailable, TableFull, StorageUnavailable,
    )
}


def open_error(path: str, e: BaseException) -> Exception:
    """The store error for a database file DuckDB could not open: the cause in DuckDB's words
    (without its exception class or documentation link) and what to do; here, not in
    store/opening.py, because migrations raise it too (and opening imports the migrations)."""
    text = _reason(e)
    if "lock" in text.lower():
        return StorageError(
            f"database {path!r} is in use by another process (only one process can write a "
            f"DuckDB file; when a server owns it, connect to the server with --uri grpc://…, "
            f"or stop it first for expstore migrate or another expstore serve): {text}")
    if "version" in text.lower() and "storage" in text.lower():
        return CatalogOutdated(f"database {path!r} was written by a newer DuckDB/expstore than "
                               f"this one can read; upgrade expstore: {text}")
    if "not a valid duckdb database" in text.lower():
        return StorageError(f"database {path!r} is not a DuckDB database ({text}); give --db an "
                            "expstore database or the name of a new file")
    return StorageError(f"database {path!r} cannot be opened: {text}; check that its directory "
                        "exists and this user may write there")


def _reason(e: BaseException) -> str:
    """DuckDB's message without its "IO Error:" class prefix and "See also <url>" tail."""
    text = str(e).strip()
    text = re.sub(r"\s*See also https?://\S+$", "", text)
    return re.sub(r"^[A-Za-z ]*Error: ", "", text)
