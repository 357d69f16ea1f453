"""Prometheus metrics: what an operator needs to see trouble before it costs a run.

Counters and gauges are read from the store when Prometheus scrapes (no work on the hot path);
the Flight server adds latency histograms per verb.

Exported (prefix ``expstore_``): ``rows_put_total``, ``puts_total``, ``claims_total``,
``rows_claimed_total``, ``acks_total``, ``rows_acked_total``, ``nacks_total``,
``leases_expired_total``, ``redeliveries_total``, ``dead_letters_total``, ``stale_rows_total``,
``version_bumps_total``, ``rows_requeued_total``; per table ``version``, ``ready_rows`` (queue depth), ``processing_rows``,
``pending_rows``; ``writer_queue_depth``; ``writer_up``; ``disk_bytes{file=database|wal|putlog|blobs}``; ``health{status=…, error=…}`` (1, with
``health``'s status ok / failed / closed and the cause of a failure, e.g. a full disk);
histogram ``request_seconds{verb=…}``.

The endpoint is as protected as the Flight server: when the server has a tokens file, a scrape
needs ``Authorization: Bearer <token>`` with any of its tokens (Prometheus: ``authorization:
{credentials: …}`` in the scrape config), else it gets 401; and it can listen on an address of its
own (``--metrics-host``, e.g. loopback while Flight listens on every interface).
"""
from __future__ import annotations

import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pyarrow.flight as flight
from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from store.embedded import EmbeddedStore

if TYPE_CHECKING:
    from .auth import AuthMiddlewareFactory

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                   5, 10)


class StoreCollector(Collector):
    def __init__(self, store: EmbeddedStore) -> None:
        self._store = store

    def collect(self) -> Iterator:
        s = self._store
        for name, value in list(s.counters.items()):
            yield CounterMetricFamily(f"expstore_{name}", f"expstore {name.replace('_', ' ')}",
                                      value=value)
        version = GaugeMetricFamily("expstore_version", "current policy version",
                                    labels=["table"])
        ready = GaugeMetricFamily("expstore_ready_rows", "rows ready to claim (queue depth)",
                                  labels=["table"])
        processing = GaugeMetricFamily("expstore_processing_rows", "rows under a lease",
                                       labels=["table"])
        pending = GaugeMetricFamily("expstore_pending_rows", "rows still being generated",
                                    labels=["table"])
        gauges = s.gauges()
        for table in gauges["tables"]:
            name = table["table"]
            version.add_metric([name], table["version"])
            ready.add_metric([name], table["ready"])
            processing.add_metric([name], table["processing"])
            pending.add_metric([name], table["pending"])
        yield from (version, ready, processing, pending)
        yield GaugeMetricFamily("expstore_writer_queue_depth", "operations waiting for the "
                                "writer", value=gauges["writer_queue_depth"])
        disk = GaugeMetricFamily("expstore_disk_bytes", "bytes on disk of the store's files "
                                 "(database, wal, putlog, blobs); gc --drop gives blobs back",
                                 labels=["file"])
        for file, size in gauges["disk"].items():
            disk.add_metric([file], size)
        yield disk
        yield GaugeMetricFamily("expstore_claim_cache_bytes", "bytes of ready rows' values held "
                                "so that claims need no DuckDB read", value=s.cache.used)
        yield GaugeMetricFamily("expstore_writer_up", "1 while the store's writer runs; 0 once "
                                "an unexpected error stopped it (restart the server)",
                                value=1 if gauges["writer_running"] else 0)
        health = s.health()
        status = GaugeMetricFamily("expstore_health", "1, labelled with the health action's "
                                   "status (ok, failed, closed) and the cause of a failure "
                                   "(e.g. the database cannot be written: a full disk)",
                                   labels=["status", "error"])
        status.add_metric([health["status"], _bounded(health.get("error", ""))], 1)
        yield status


_WsgiApp = Callable[[dict, Callable], Iterable[bytes]]


def _bearer_only(app: _WsgiApp, auth: "AuthMiddlewareFactory") -> _WsgiApp:
    """``app`` behind the Flight server's bearer tokens (any role may read metrics)."""
    def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
        try:
            auth.principal(environ.get("HTTP_AUTHORIZATION", ""))
        except flight.FlightUnauthenticatedError as e:
            start_response("401 Unauthorized", [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("WWW-Authenticate", 'Bearer realm="expstore metrics"')])
            return [f"{e}\n".encode()]
        return app(environ, start_response)
    return guarded


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper must not hold the server's exit


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # one line per scrape on stderr is noise in the server's log


def _bounded(text: str, limit: int = 1000) -> str:
    """A label value of bounded size (a cause may quote a long DuckDB message)."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


class Metrics:
    """A registry for one server: the store collector plus request latency histograms."""

    def __init__(self, store: EmbeddedStore) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StoreCollector(store))
        self.latency = Histogram("expstore_request_seconds", "Flight request latency",
                                 ["verb"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self._by_verb: dict[str, Any] = {}

    def timed(self, verb: str) -> "_Timed":
        """A context manager counting the time spent inside as one call of ``verb``."""
        return _Timed(self, verb)

    def observe(self, verb: str, seconds: float) -> None:
        """Count one call of ``verb`` that took ``seconds`` (for calls answered elsewhere)."""
        child = self._by_verb.get(verb)
        if child is None:  # labels() costs more than the observation itself: keep the child
            child = self._by_verb[verb] = self.latency.labels(verb)
        child.observe(seconds)

    def serve(self, port: int, host: str = "127.0.0.1",
              auth: "AuthMiddlewareFactory | None" = None) -> int:
        """Start the HTTP endpoint (``/metrics``); returns the port it listens on.

        ``auth``: the Flight server's token check; a scrape then needs one of its bearer tokens.
        """
        app = make_wsgi_app(self.registry)
        if auth is not None:
            app = _bearer_only(app, auth)
        server_class = _ThreadingServer6 if ":" in host else _ThreadingServer
        self._http: Any = make_server(host, port, app, server_class,
                                      handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._http.serve_forever,
                                        name="expstore-metrics", daemon=True)
        self._thread.start()
        return int(self._http.server_port)

    def close(self) -> None:
        """Stop the HTTP endpoint, if started."""
        http = getattr(self, "_http", None)
        if http is not None:
            http.shutdown()
            http.server_close()
            self._http = None


class _Timed:
    """:meth:`Metrics.timed`'s context manager (a class: it is entered on every call of every
    verb, where a generator's context manager costs several times as much)."""

    __slots__ = ("_metrics", "_verb", "_start")

    def __init__(self, metrics: Metrics, verb: str) -> None:
        self._metrics = metrics
        self._verb = verb
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._metrics.observe(self._verb, time.perf_counter() - self._start)
