"""Catalog migrations (Alembic over duckdb_engine) and the revision check on open."""
from __future__ import annotations

import duckdb
import pytest

import migrations
import store
from store.errors import CatalogOutdated, InvalidArgument, StorageError
from store.opening import catalog_revision


def _tables(path):
    con = duckdb.connect(path)
    try:
        return {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
    finally:
        con.close()


def test_revisions_are_linear():
    assert migrations.head() == "0002_version_history"
    assert set(migrations.known_revisions()) == {"0001_catalog", "0002_version_history"}


def test_fresh_database_gets_head(db_path):
    s = store.connect(db_path)
    s.close()
    assert catalog_revision(db_path) == migrations.head()
    assert {"_expstore_tables", "_expstore_groups", "_expstore_settings",
            "_expstore_versions", "alembic_version"} <= _tables(db_path)


def test_outdated_catalog_refused_until_migrated(db_path):
    migrations.upgrade(db_path, "0001_catalog")
    assert catalog_revision(db_path) == "0001_catalog"
    assert "_expstore_versions" not in _tables(db_path)
    with pytest.raises(CatalogOutdated) as err:
        store.connect(db_path)
    assert "expstore migrate" in str(err.value) and "0001_catalog" in str(err.value)
    migrations.upgrade(db_path)
    assert catalog_revision(db_path) == migrations.head()
    s = store.connect(db_path)
    try:
        s.create_table("t", {"reward": "float64"})
        assert s.bump_version("t") == 1
    finally:
        s.close()


def test_migration_keeps_data_and_versions(db_path):
    s = store.connect(db_path)
    s.create_table("t", {"reward": "float64"}, max_staleness=3)
    s.put("t", {"sample_id": ["a_0_0"], "reward": [2.5]})
    s.bump_version("t")
    s.bump_version("t")
    s.close()
    migrations.downgrade(db_path, "0001_catalog")
    with pytest.raises(CatalogOutdated):
        store.connect(db_path)
    migrations.upgrade(db_path)
    s = store.connect(db_path)
    try:
        assert s.get_version("t") == 2
        assert s.query("SELECT version FROM _expstore_versions WHERE version_group = 't'"
                       ).column(0).to_pylist() == [2]
        assert s.claim("t", 5).data.column("reward").to_pylist() == [2.5]
        assert s.bump_version("t", expected=2) == 3
    finally:
        s.close()


def test_unknown_newer_revision_refused(db_path):
    store.connect(db_path).close()
    con = duckdb.connect(db_path)
    con.execute("UPDATE alembic_version SET version_num = '0099_from_the_future'")
    con.close()
    with pytest.raises(CatalogOutdated) as err:
        store.connect(db_path)
    assert "0099_from_the_future" in str(err.value)
    assert "upgrade expstore" in str(err.value)


def test_unstamped_catalog_refused(db_path):
    con = duckdb.connect(db_path)
    con.execute("CREATE TABLE _expstore_tables (name VARCHAR)")
    con.close()
    with pytest.raises(CatalogOutdated, match="expstore migrate"):
        store.connect(db_path)


def test_bad_paths(tmp_path):
    with pytest.raises(InvalidArgument, match="':memory:'"):
        store.connect(":memory:")
    with pytest.raises(StorageError, match="does not exist"):
        store.connect(str(tmp_path / "missing" / "x.duckdb"))
    with pytest.raises(InvalidArgument, match="ftp://x"):
        store.connect("ftp://x")


def test_a_table_made_with_the_old_primary_key_keeps_working(db_path):
    """Tables were created with PRIMARY KEY (sample_id, policy_version) before the store kept
    keys unique itself; such a table is used as it is, key and all."""
    s = store.connect(db_path)
    s.create_table("t", {"prompt": "string", "reward": "float64"})
    s.close()
    con = duckdb.connect(db_path)
    try:
        ddl = con.execute("SELECT sql FROM duckdb_tables() WHERE table_name = 't'").fetchone()[0]
        assert "PRIMARY KEY" not in ddl
        con.execute("DROP TABLE t")
        con.execute(ddl.rstrip().rstrip(";").rstrip().removesuffix(")")
                    + ", PRIMARY KEY (sample_id, policy_version))")
    finally:
        con.close()
    s = store.connect(db_path)
    try:
        rows = {"sample_id": [f"q{i}_0_0" for i in range(20)], "prompt": ["p"] * 20,
                "reward": [1.0] * 20}
        s.put("t", rows)
        claim = s.claim("t", 20)
        s.ack(claim.claim_id)
        s.put("t", rows | {"reward": [2.0] * 20})      # a re-send of consumed rows: updated
        s.put("t", {"sample_id": ["n_0_0"], "prompt": ["p"], "reward": [3.0]})
        got = s.query("SELECT count(*) AS n, sum(reward) AS r, count(*) FILTER (WHERE consumed)"
                      " AS c FROM t").to_pylist()
        assert got == [{"n": 21, "r": 43.0, "c": 20}]
        assert s.claim("t", 5).data.column("sample_id").to_pylist() == ["n_0_0"]
    finally:
        s.close()
    con = duckdb.connect(db_path)
    try:
        assert con.execute("SELECT count(*) FROM duckdb_constraints() WHERE table_name = 't' "
                           "AND constraint_type = 'PRIMARY KEY'").fetchone()[0] == 1
    finally:
        con.close()
