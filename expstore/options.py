"""What every ``expstore`` command shares: the error boundary (library errors become one-line
click errors), the store a command talks to (:class:`Target`, from ``--db`` / ``--uri`` /
``--token`` / ``--tls-root-certs``), and the option decorators that build it.
"""
from __future__ import annotations

import functools
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import click
import pyarrow as pa

from store.cache import parse_size
from store.errors import ExpstoreError, InvalidArgument, Unauthenticated

DEFAULT_DB = "./expstore.duckdb"
DEFAULT_PORT = 8815


# -- error boundary -------------------------------------------------------------------------------
class ExpstoreCommand(click.Command):
    """A command whose library errors end as a one-line message (exit status 1)."""

    def invoke(self, ctx: click.Context) -> Any:
        with click_errors():
            return super().invoke(ctx)


class ExpstoreGroup(click.Group):
    command_class = ExpstoreCommand
    group_class = type  # subgroups (``version``) are ExpstoreGroups too


@contextmanager
def click_errors() -> Iterator[None]:
    try:
        yield
    except Unauthenticated as e:
        raise click.ClickException(f"{e}; give a token of the server's --tokens-file with "
                                   "--token or EXPSTORE_TOKEN") from e
    except ExpstoreError as e:
        raise click.ClickException(str(e)) from e
    except BrokenPipeError:
        # The reader went away (`expstore query … | head`): end quietly, as `cat` would, with
        # SIGPIPE's status; stdout goes to /dev/null so that the final flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(141) from None
    except OSError as e:
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        raise click.ClickException(f"{where}{e.strerror or e}") from e
    except pa.ArrowException as e:
        raise click.ClickException(f"arrow: {e}") from e


# -- shared options -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """Which store a command talks to: an embedded DuckDB file or a server URI."""

    db: str
    uri: str | None = None
    token: str | None = None
    tls_root_certs: str | None = None
    create: bool = False

    @property
    def address(self) -> str:
        return self.uri or self.db

    @contextmanager
    def open(self) -> Iterator[Any]:
        """The open store, closed afterwards (an embedded store checkpoints on close)."""
        import store

        if self.uri:
            if "://" not in self.uri:
                # store.connect would take it for a file name and create a database there.
                raise click.ClickException(
                    f"--uri {self.uri!r} is not a server address; expected grpc://HOST:PORT "
                    f"(e.g. grpc://{self.uri}), or --db for a database file")
            options: dict[str, Any] = {}
            if self.token:
                options["token"] = self.token
            if self.tls_root_certs:
                options["tls_root_certs"] = self.tls_root_certs
            s = store.connect(self.uri, **options)
        else:
            if not self.create and not os.path.exists(self.db):
                raise click.ClickException(
                    f"database {self.db!r} does not exist; create a table in it with "
                    f"`expstore create-table --db {self.db} …`, or connect to a running server "
                    "with --uri grpc://HOST:PORT")
            s = store.connect(self.db)
        try:
            yield s
        finally:
            s.close()


def db_option(f: Callable) -> Callable:
    return click.option("--db", default=DEFAULT_DB, show_default=True, envvar="EXPSTORE_DB",
                        type=click.Path(dir_okay=False),
                        help="Embedded store: the DuckDB file [env EXPSTORE_DB].")(f)


def store_options(create: bool = False) -> Callable[[Callable], Callable]:
    """``--db`` / ``--uri`` / ``--token`` / ``--tls-root-certs``, passed on as ``target``.

    ``create``: the command may create the embedded database file (otherwise a missing file is
    an error rather than a new empty database in the working directory).
    """
    def decorator(f: Callable) -> Callable:
        @functools.wraps(f)
        def wrapper(*args: Any, db: str, uri: str | None, token: str | None,
                    tls_root_certs: str | None, **kwargs: Any) -> Any:
            ctx = click.get_current_context()
            src = ctx.get_parameter_source
            explicit_db = src("db") == click.core.ParameterSource.COMMANDLINE
            explicit_uri = src("uri") == click.core.ParameterSource.COMMANDLINE
            if uri and explicit_db and explicit_uri:
                raise click.UsageError("give --db (embedded) or --uri (a server), not both")
            if explicit_db and not explicit_uri:
                uri = None  # an explicit --db beats EXPSTORE_URI from the environment
            target = Target(db=db, uri=uri or None, token=token, tls_root_certs=tls_root_certs,
                            create=create)
            return f(*args, target=target, **kwargs)

        for option in reversed([
            db_option,
            click.option("--uri", envvar="EXPSTORE_URI", metavar="grpc://HOST:PORT",
                         help="Remote store: a running server [env EXPSTORE_URI]."),
            click.option("--token", envvar="EXPSTORE_TOKEN",
                         help="Bearer token for a server with auth on [env EXPSTORE_TOKEN]."),
            click.option("--tls-root-certs", envvar="EXPSTORE_TLS_ROOT_CERTS",
                         type=click.Path(exists=True, dir_okay=False),
                         help="PEM file to trust a grpc+tls:// server's certificate."),
        ]):
            wrapper = option(wrapper)
        return wrapper
    return decorator


json_option = click.option("--json", "as_json", is_flag=True,
                           help="Print JSON (for scripts) instead of aligned columns.")


def size_option(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        return parse_size(value)
    except InvalidArgument as e:
        raise click.BadParameter(str(e)) from e
