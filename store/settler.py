"""Acking, nacking and renewing a claim on the caller's thread: the checks against the index
that answer at once (an unknown, ended or repeated claim), and the settle handed to the writer.

What the writer then commits is store/settle.py; the facade (store/embedded.py) answers
``ack``, ``nack``, ``dead_letter``, ``renew`` and their ``_async`` forms through a
:class:`Settler`.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from .claims import check_lease_seconds
from .errors import InvalidArgument, LeaseExpired, NotFound
from .index import StoreIndex
from .live import Lease
from .naming import quote
from .ops import SettleOp
from .readers import Readers
from .writer import Writer


class Settler:
    """Settles and renews the claims of one store.

    Args:
        index: the in-memory index (leases, recently ended claims), behind its lock.
        writer: commits a settle (and is poked to write a renewal's lease bookkeeping).
        readers: a cursor for the rows a claim consumed before a restart.
    """

    def __init__(self, index: StoreIndex, writer: Writer, readers: Readers) -> None:
        self._index = index
        self._writer = writer
        self._readers = readers

    def settle(self, claim_id: str, ack: bool) -> dict[str, Any]:
        """Ack or nack a claim; its answer once durable (see :meth:`settle_async`)."""
        return self.settle_async(claim_id, ack).result()

    def settle_async(self, claim_id: str, ack: bool) -> Future:
        """Ack or nack a claim: a Future of the answer, resolved once it is durable.

        Raises:
            InvalidArgument: a malformed claim id.
            LeaseExpired: the claim ended (a repeated ack is answered ``duplicate`` instead).
            NotFound: the claim id is unknown.
        """
        _check_claim_id(claim_id)
        verb = "ack" if ack else "nack"
        with self._index.lock:
            lease = self._index.active_lease(claim_id)
            if lease is None:
                recently_acked = self._index.recently_acked(claim_id)
                if ack and recently_acked is not None:
                    return _done({"claim_id": claim_id, "acked": recently_acked,
                                  "duplicate": True})
                self._raise_if_ended(claim_id, verb)
            elif lease.state == Lease.SETTLING:
                return self._index.settling[claim_id]
            else:
                lease.state = Lease.SETTLING
                # The caller's Future resolves only after a failed commit has put the lease
                # back, so that a retry finds it leased, not still settling.
                answer: Future = Future()
                self._index.settling[claim_id] = answer
                self._writer.submit(SettleOp(lease, ack)).add_done_callback(
                    lambda done: self._settle_done(lease, done, answer))
                return answer
        acked = self._acked_before(claim_id) if ack else 0
        if acked:
            return _done({"claim_id": claim_id, "acked": acked, "duplicate": True})
        raise _unknown_claim(claim_id)

    def renew(self, claim_id: str, lease_seconds: float | None) -> dict[str, Any]:
        """``EmbeddedStore.renew``: extend an active claim's lease (see its docstring)."""
        _check_claim_id(claim_id)
        check_lease_seconds(lease_seconds)
        with self._index.lock:
            lease = self._index.active_lease(claim_id)
            if lease is None:
                self._raise_if_ended(claim_id, "renew")
                raise _unknown_claim(claim_id)
            if lease.state == Lease.SETTLING:
                raise LeaseExpired(f"claim {claim_id!r} is being acked or nacked; a claim that "
                                   "is ending cannot be renewed")
            expires_at = self._index.renew(lease, lease_seconds)
        self._writer.poke()
        return {"claim_id": claim_id, "expires_at": expires_at}

    def _raise_if_ended(self, claim_id: str, verb: str) -> None:
        """LeaseExpired, saying how, if claim ``claim_id`` ended recently (lock held): acked,
        nacked, expired, or voided by a restart; ``verb`` is what was asked of it ("nack",
        "renew", or "ack", whose caller answers a repeated ack before asking)."""
        if self._index.recently_acked(claim_id) is not None:
            raise LeaseExpired(f"claim {claim_id!r} was already acked; it cannot be "
                               f"{verb}ed")
        why = self._index.why_ended(claim_id)
        if why is not None:
            raise LeaseExpired(f"claim {claim_id!r} ended before this {verb}: {why}")

    def _settle_done(self, lease: Lease, done: Future, answer: Future) -> None:
        """Hand the writer's outcome on; a failed commit leaves the claim leased as before."""
        error = done.exception()
        if error is None:
            answer.set_result(done.result())
            return
        with self._index.lock:
            if lease.state == Lease.SETTLING and self._index.claims.get(lease.claim_id) is lease:
                lease.state = Lease.ACTIVE
            self._index.settling.pop(lease.claim_id, None)
        answer.set_exception(error)

    def _acked_before(self, claim_id: str) -> int:
        """Rows a claim consumed before a restart (acks record the claim id on the rows)."""
        total = 0
        for name in self._index.table_names():
            # fetchall: a result left unfinished would refuse the cursor's next statement
            rows = self._readers.cursor().execute(
                f"SELECT count(*) FROM {quote(name)} WHERE lease_id = ? AND consumed",
                [claim_id]).fetchall()
            total += int(rows[0][0]) if rows else 0
        return total


def _check_claim_id(claim_id: object) -> None:
    if not isinstance(claim_id, str) or not claim_id:
        raise InvalidArgument(f"claim id {claim_id!r} is not a non-empty string")


def _unknown_claim(claim_id: str) -> NotFound:
    return NotFound(f"claim {claim_id!r} is unknown: it was never issued, its table was "
                    "dropped, or it was taken before a restart, which voids every lease (its "
                    "rows are ready to be delivered again)")


def _done(result: Any) -> Future:
    """A Future that already holds ``result`` (an answer known without the writer)."""
    future: Future = Future()
    future.set_result(result)
    return future
