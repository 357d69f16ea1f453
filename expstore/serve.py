"""Run the Flight server in the foreground until SIGINT/SIGTERM (``expstore serve``,
``python -m flight_server``).

Shutdown order on a signal: ask open sessions and subscriptions to end, stop accepting and let
running calls finish (``shutdown``, from a helper thread: the signal handler runs on the main
thread, and shutting down from there would wait on itself), then close the store, which drains
the writer and checkpoints the WAL.

A call that does not end holds that shutdown up: gRPC waits for every open call, and an action
session ends only when its client ends its side (a client that is frozen, or that does not
follow the protocol's "closing" message, never does). So the wait is bounded: after
``shutdown_grace`` seconds, or at a second signal, the store is closed anyway (everything
acknowledged is durable by then) and the process exits without waiting for those calls.
"""
from __future__ import annotations

import gc
import importlib.util
import logging
import os
import signal
import ssl
import sys
import threading
import time
from typing import Any, Callable, NoReturn, TextIO

log = logging.getLogger("expstore.serve")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How long a signal's shutdown waits for open calls before the store is closed without them.
# Below the 30 s that process supervisors (Kubernetes, systemd) commonly allow before SIGKILL.
SHUTDOWN_GRACE_SECONDS = 10.0


def metrics_available() -> bool:
    """Whether this installation has the Prometheus metrics module (``flight_server.metrics``)."""
    try:
        return importlib.util.find_spec("flight_server.metrics") is not None
    except ImportError:
        return False


def tune_gc() -> None:
    """Collect garbage less often in a server process.

    The server's heap is mostly the long-lived index of live rows (a dict entry per row, and an
    object per row outside a bulk put's block, store/live.py); with Python's default threshold a
    collection runs every 700 allocations, i.e. several times per bulk put, and its older
    generations walk that whole index (a measurable share of every bulk put). Freezing what exists after start-up and a larger young generation keep the
    collector for what it is for, cycles among short-lived objects.
    """
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


def check_tls_files(cert: str, key: str) -> None:
    """Refuse a TLS certificate or key that gRPC would fail on ("Server did not start
    properly"), naming the file and the cause.

    Raises:
        InvalidArgument: either is no PEM file, or the key does not belong to the certificate.
    """
    from store.errors import InvalidArgument

    texts = {}
    for option, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            with open(path, "rb") as f:
                texts[option] = f.read()
        except OSError as e:
            raise InvalidArgument(f"TLS cannot start: {option} {path!r}: {e.strerror}") from None
    cause = None
    if b"-----BEGIN CERTIFICATE-----" not in texts["--tls-cert"]:
        cause = f"--tls-cert {cert!r} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
    elif b"PRIVATE KEY-----" not in texts["--tls-key"]:
        cause = f"--tls-key {key!r} holds no PEM private key (-----BEGIN PRIVATE KEY-----)"
    elif b"ENCRYPTED" in texts["--tls-key"]:
        cause = f"--tls-key {key!r} is encrypted; the server needs it without a passphrase"
    else:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
        except ssl.SSLError as e:
            cause = (f"--tls-key {key!r} is not the key of --tls-cert {cert!r}"
                     if e.reason == "KEY_VALUES_MISMATCH" else
                     f"--tls-cert {cert!r} or --tls-key {key!r} is damaged (it does not load"
                     + (f": {e.reason})" if e.reason else ")"))
    if cause is not None:
        raise InvalidArgument(f"TLS cannot start: {cause}; give --tls-cert a PEM certificate "
                              "and --tls-key its unencrypted PEM private key")


def ready_line(location: str, db: str) -> str:
    return f"expstore serving {location} (db {db})"


def run_server(db: str, *, host: str = "127.0.0.1", port: int = 8815,
               tokens_file: str | None = None, tls_cert: str | None = None,
               tls_key: str | None = None, memory_limit: str | None = None,
               cache_limit: int | None = None, max_live_rows: int | None = None,
               metrics_port: int | None = None, metrics_host: str | None = None,
               out: TextIO | None = None, warn: Callable[[str], Any] | None = None,
               shutdown_grace: float = SHUTDOWN_GRACE_SECONDS,
               store_options: dict[str, Any] | None = None) -> int:
    """Serve ``db`` until SIGINT or SIGTERM; print one ready line to ``out``; return 0.

    ``store_options``: more fields of :class:`store.settings.StoreSettings` (``--set``).

    A signal's shutdown waits up to ``shutdown_grace`` seconds for open calls (or until a second
    signal); then the store is closed and the process exits 0 without them.

    Raises:
        ExpstoreError: the store cannot be opened (e.g. the file is locked by another process);
            InvalidArgument: the address cannot be listened on, or the TLS files are unusable.
    """
    import pyarrow as pa

    from flight_server.listening import check_can_listen  # late: keeps `expstore --help` quick
    from flight_server.server import ExpstoreFlightServer
    from store.errors import Unavailable

    out = out if out is not None else sys.stdout
    options: dict[str, Any] = {}
    if memory_limit:
        options["memory_limit"] = memory_limit
    if cache_limit is not None:
        options["cache_limit"] = cache_limit
    if max_live_rows is not None:
        options["max_live_rows"] = max_live_rows
    options.update(store_options or {})  # --set is the more specific: it wins over a default
    if metrics_port is not None:
        if metrics_available():
            options["metrics_port"] = metrics_port
            if metrics_host:
                options["metrics_host"] = metrics_host
        elif warn is not None:
            warn(f"warning: --metrics-port {metrics_port} ignored: this installation has no "
                 "metrics module (flight_server.metrics)")
    check_can_listen(host, port)
    if options.get("metrics_port"):  # 0 picks a free one
        check_can_listen(metrics_host or host, options["metrics_port"], "--metrics-port")
    if tls_cert and tls_key:
        check_tls_files(tls_cert, tls_key)
    try:
        server = ExpstoreFlightServer(db, host=host, port=port, tokens_file=tokens_file,
                                      tls_cert=tls_cert, tls_key=tls_key, **options)
    except pa.ArrowException as e:  # what the checks above did not foresee
        raise Unavailable(f"the server could not start on {host}:{port} ({e}); gRPC's own "
                          "lines above name the cause") from None
    if getattr(server, "metrics_port", None) is not None:
        log.info("Prometheus metrics on http://%s:%s/metrics%s", server.metrics_host,
                 server.metrics_port, " (bearer token required)" if tokens_file else "")
    stopper = _Stopper(server, shutdown_grace)
    # Signal handlers can only be installed on the main thread; elsewhere the caller stops us.
    on_main = threading.current_thread() is threading.main_thread()
    if on_main:  # this process is the server's own: its collector settings are ours to set
        tune_gc()
    previous = {sig: signal.signal(sig, stopper.on_signal) for sig in STOP_SIGNALS} \
        if on_main else {}
    try:
        print(ready_line(server.location, db), file=out, flush=True)
        if on_main:
            # Not serve(): seeing our handlers installed, pyarrow's serve() shuts gRPC down by
            # itself on a signal, waiting for every open call before our handler may run; a
            # client's open session never ends that way (it needs the "closing" message that
            # our shutdown sends first). So the main thread stays in Python, where the handler
            # runs, until the shutdown a signal started has finished.
            while not stopper.finished(0.5):
                if stopper.overdue(shutdown_grace):
                    _stop_now(server, stopper, shutdown_grace)
        else:
            server.serve()
        stopper.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.close()
    log.info("server on %s stopped%s", server.location,
             f" by {signal.Signals(stopper.signum).name}" if stopper.signum else "")
    return 0


def _stop_now(server: Any, stopper: "_Stopper", grace: float) -> NoReturn:
    """Close the store without waiting for the calls still open, and exit the process.

    Only a process exit ends those calls: gRPC's shutdown, blocked in another thread, has no
    deadline in pyarrow and cannot be interrupted.
    """
    why = "a second signal" if stopper.repeated else f"the {grace:g} s grace"
    sessions = server.open_sessions()
    log.warning("stopping without waiting for the calls still open after %s%s; closing the store",
                why, f" ({sessions} of them action sessions whose client did not end its stream "
                     "when told to)" if sessions else "")
    code = 0
    try:
        server.close_store()
        log.info("server on %s stopped by %s; store closed", server.location,
                 signal.Signals(stopper.signum).name if stopper.signum else "a signal")
    except BaseException:  # noqa: BLE001 - logged; the process exits either way
        log.exception("closing the store failed")
        code = 1
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


class _Stopper:
    """Signal handler that shuts the server down once, from a helper thread."""

    def __init__(self, server: Any, grace: float) -> None:
        self.server = server
        self.grace = grace
        self.signum: int | None = None
        self.since: float | None = None  # monotonic time of the first signal
        self.repeated = False  # a second signal came: stop without waiting any longer
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()

    def on_signal(self, signum: int, frame: object) -> None:
        with self._lock:
            if self._thread is not None:
                self.repeated = True
                return
            self.signum = signum
            self.since = time.monotonic()
            self._thread = threading.Thread(target=self._shutdown, name="expstore-shutdown",
                                            daemon=True)
            self._thread.start()

    def _shutdown(self) -> None:
        # Logged here, not in the handler: the line tells an operator (and a test) that the
        # signal was taken and how long open calls may hold the server.
        log.info("stopping on %s: waiting up to %g s for open calls (a second signal stops at "
                 "once)", signal.Signals(self.signum).name if self.signum else "a signal",
                 self.grace)
        try:
            self.server.shutdown()
        finally:
            self._done.set()

    def overdue(self, grace: float) -> bool:
        """Whether the shutdown should stop waiting for open calls."""
        return self.repeated or (self.since is not None
                                 and time.monotonic() - self.since >= grace)

    def finished(self, timeout: float) -> bool:
        """Whether a signal's shutdown has finished (waits up to ``timeout`` seconds)."""
        return self._done.wait(timeout)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
