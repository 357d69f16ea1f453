"""Version history: every bump of a version group, with the weights it published.

Revision ID: 0002_version_history
Revises: 0001_catalog
Create Date: 2026-11-21
"""
from __future__ import annotations

from alembic import op

revision = "0002_version_history"
down_revision = "0001_catalog"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE _expstore_versions (
            version_group VARCHAR NOT NULL,
            version BIGINT NOT NULL,
            weights_uri VARCHAR,
            bumped_at TIMESTAMPTZ NOT NULL DEFAULT now(),
            PRIMARY KEY (version_group, version)
        )""")
    # Groups that existed before this revision get their current version recorded.
    op.execute("""
        INSERT INTO _expstore_versions (version_group, version)
        SELECT name, version FROM _expstore_groups""")


def downgrade() -> None:
    op.execute("DROP TABLE _expstore_versions")
