"""The catalog: experience tables, version groups and settings.

Revision ID: 0001_catalog
Revises:
Create Date: 2026-11-21
"""
from __future__ import annotations

from alembic import op

revision = "0001_catalog"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE _expstore_tables (
            name VARCHAR PRIMARY KEY,
            definition VARCHAR NOT NULL,
            version_group VARCHAR NOT NULL,
            created_at TIMESTAMPTZ NOT NULL DEFAULT now()
        )""")
    op.execute("""
        CREATE TABLE _expstore_groups (
            name VARCHAR PRIMARY KEY,
            version BIGINT NOT NULL DEFAULT 0,
            updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
        )""")
    op.execute("""
        CREATE TABLE _expstore_settings (
            key VARCHAR PRIMARY KEY,
            value VARCHAR NOT NULL
        )""")


def downgrade() -> None:
    op.execute("DROP TABLE _expstore_settings")
    op.execute("DROP TABLE _expstore_groups")
    op.execute("DROP TABLE _expstore_tables")
