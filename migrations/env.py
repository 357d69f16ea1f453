"""Alembic environment for the store's DuckDB catalog."""
from __future__ import annotations

from alembic import context
from alembic.ddl.impl import DefaultImpl
from sqlalchemy import create_engine


class DuckDBImpl(DefaultImpl):
    """Alembic has no DuckDB dialect of its own; DuckDB speaks enough PostgreSQL for ours."""

    __dialect__ = "duckdb"
    transactional_ddl = True


def run_migrations_online() -> None:
    config = context.config
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=None)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    try:
        with engine.connect() as conn:
            context.configure(connection=conn, target_metadata=None)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


run_migrations_online()
