"""The SQL guard (store.sqlguard) and the locked-down database configuration behind it."""
from __future__ import annotations

import duckdb
import pytest

from store.errors import QueryRefused
from store.opening import connect_duckdb
from store.sqlguard import MAX_SQL_CHARS, check_predicate, check_select

ALLOWED = [
    "SELECT 1",
    "select * from t where x > 1 order by 1 limit 5",
    "WITH a AS (SELECT 1 AS x) SELECT x FROM a",
    "SELECT * FROM range(10)",
    "SELECT * FROM generate_series(1, 3)",
    "SELECT unnest([1, 2, 3])",
    "SELECT * FROM duckdb_tables()",
    "SELECT * FROM duckdb_columns() WHERE table_name = 'solver'",
    "SELECT s.a FROM s JOIN v USING (sample_id)",
    "SELECT input_id FROM t GROUP BY 1 HAVING stddev(reward) > 0",
    "SELECT 'read_csv(''/etc/passwd'')' AS harmless_string",
    "SELECT 1 -- ; DROP TABLE t",
    "FROM t SELECT x",
    "SELECT ?::INT",
    "SELECT * FROM main.t",
    # catalog views that name tables and columns but show no path or setting stay readable
    "SELECT * FROM information_schema.columns",
    "SELECT * FROM duckdb_tables",
    "SELECT datname FROM pg_database",
    "SELECT current_database()",
]


@pytest.mark.parametrize("sql", ALLOWED)
def test_allowed(sql):
    assert check_select(sql) == sql


REFUSED = [
    ("INSERT INTO t VALUES (1)", "INSERT"),
    ("UPDATE t SET a = 1", "UPDATE"),
    ("DELETE FROM t", "DELETE"),
    ("DROP TABLE t", "DROP"),
    ("CREATE TABLE x (a INT)", "CREATE"),
    ("ALTER TABLE t RENAME TO u", "ALTER"),
    ("ATTACH 'x.db'", "ATTACH"),
    ("DETACH x", "DETACH"),
    ("COPY t TO 'x.csv'", "COPY"),
    ("EXPORT DATABASE 'dir'", "EXPORT"),
    ("INSTALL httpfs", "'INSTALL httpfs' (LOAD statement)"),  # as DuckDB parses it
    ("LOAD httpfs", "LOAD"),
    ("SET threads = 1", "SET"),
    ("PRAGMA threads = 1", None),
    ("CALL pragma_version()", "CALL"),
    ("CHECKPOINT", None),
    ("SELECT 1; SELECT 2", "2 statements"),
    ("SELECT * FROM read_csv('/etc/passwd')", "read_csv"),
    ("SELECT * FROM read_parquet('x.parquet')", "read_parquet"),
    ("SELECT * FROM read_json('x.json')", "read_json"),
    ("SELECT * FROM read_text('/etc/passwd')", "read_text"),
    ("SELECT * FROM glob('*')", "glob"),
    ("SELECT * FROM query('SELECT 1')", "query"),
    ("SELECT * FROM query_table('t')", "query_table"),
    ("SELECT getenv('HOME')", "getenv"),
    ("SELECT GETENV('HOME')", "GETENV"),
    ("SELECT current_setting('threads')", "current_setting"),
    ("SELECT * FROM t WHERE x IN (SELECT * FROM read_text('/etc/passwd'))", "read_text"),
    ("SELECT (SELECT content FROM read_text('a'))", "read_text"),
    ("SELECT * FROM range(3), glob('*')", "glob"),
    ("SELECT * FROM '/etc/passwd'", "/etc/passwd"),
    ("SELECT * FROM 'data.parquet'", "data.parquet"),
    ("SELECT * FROM 's3://bucket/x'", "s3://bucket/x"),
    ("SELECT * FROM t JOIN '~/x.csv' USING (a)", "~/x.csv"),
    ("SELECT * FROM pragma_table_info('t')", "pragma_table_info"),
    # the server's settings, the database's path, secrets, extensions and log (issue #29, item 7)
    *[(sql, named) for sql, named in (
        ("SELECT * FROM pg_settings", "pg_settings"),
        ("SELECT name, setting FROM pg_catalog.pg_settings", "pg_settings"),
        ('SELECT * FROM "PG_SETTINGS"', "pg_settings"),
        ("SELECT * FROM duckdb_databases", "duckdb_databases"),
        ("SELECT path FROM system.main.duckdb_databases", "duckdb_databases"),
        ("SELECT * FROM duckdb_databases()", "duckdb_databases"),
        ("SELECT * FROM pragma_database_list", "pragma_database_list"),
        ("SELECT * FROM pragma_database_list()", "pragma_database_list"),
        ("SELECT * FROM duckdb_logs", "duckdb_logs"),
        ("SELECT * FROM pg_prepared_statements", "pg_prepared_statements"),
        ("SELECT * FROM duckdb_settings()", "duckdb_settings"),
        ("SELECT * FROM duckdb_secrets()", "duckdb_secrets"),
        ("SELECT install_path FROM duckdb_extensions()", "duckdb_extensions"),
        ("SELECT * FROM duckdb_temporary_files()", "duckdb_temporary_files"),
        ("SELECT * FROM duckdb_memory()", "duckdb_memory"),
        ("SELECT * FROM which_secret('s3://x', 's3')", "which_secret"),
        ("SELECT current_setting('temp_directory')", "current_setting"),
        ("SELECT current_setting('secret_directory')", "current_setting"),
        ("SELECT getenv('PATH')", "getenv"),
        ("SELECT getvariable('x')", "getvariable"),
        ("SELECT write_log('x')", "write_log"),
        ("SELECT sleep_ms(100000)", "sleep_ms"),
        ("SELECT pg_sleep(100)", "pg_sleep"),
        ("SELECT nextval('s')", "nextval"),
        ("SELECT * FROM t WHERE x IN (SELECT path FROM duckdb_databases)", "duckdb_databases"),
        ("WITH s AS (SELECT * FROM pg_settings) SELECT * FROM s", "pg_settings"),
        ("PRAGMA database_list", None),
        ("PRAGMA show_databases", None),
    )],
    ("SELEC 1", "parse"),
    ("", None),
]


@pytest.mark.parametrize("sql, named", REFUSED)
def test_refused(sql, named):
    with pytest.raises(QueryRefused) as err:
        check_select(sql)
    if named:
        assert named.lower() in str(err.value).lower()


def test_too_long():
    with pytest.raises(QueryRefused, match=str(MAX_SQL_CHARS)):
        check_select("SELECT " + "1+" * MAX_SQL_CHARS + "1")


@pytest.mark.parametrize("bad", [None, 1, b"SELECT 1", ["SELECT 1"]])
def test_not_a_string(bad):
    with pytest.raises(QueryRefused):
        check_select(bad)


@pytest.mark.parametrize("where", [
    "reward > 0", "input_id IN (SELECT input_id FROM t GROUP BY 1 HAVING min(reward) < max(reward))",
    "x IS NULL OR y = 'a;b'",        # a ';' in a string literal is part of one expression
    "1=1 --",                        # the comment ends at the line the claim's query adds
    "reward > 0) OR (1=1",           # bound as one expression: (reward > 0) OR (1=1)
])
def test_predicates_allowed(where):
    assert check_predicate(where) == where


@pytest.mark.parametrize("where", ["1=1; DROP TABLE t", "1=1) UNION SELECT * FROM read_text('x'",
                                   "x IN (SELECT * FROM read_csv('/etc/passwd'))",
                                   "getenv('HOME') IS NOT NULL", "", None,
                                   "1=1) ORDER BY (1", "1=1) LIMIT (1", "1=1), (2", "x > ?",
                                   "1=1) FROM t WHERE (1", "1 /* unterminated",
                                   "x IN (SELECT path FROM duckdb_databases)"])
def test_predicates_refused(where):
    with pytest.raises(QueryRefused, match="predicate"):
        check_predicate(where)


def test_database_itself_refuses_external_access(tmp_path):
    """The second layer: whatever the guard let through, the store's database reads no files."""
    secret = tmp_path / "secret.csv"
    secret.write_text("a,b\n1,2\n")
    con = connect_duckdb(str(tmp_path / "x.duckdb"), None)
    try:
        for sql in (f"SELECT * FROM read_csv('{secret}')", f"SELECT * FROM '{secret}'",
                    f"ATTACH '{tmp_path / 'other.duckdb'}' AS other",
                    f"COPY (SELECT 1) TO '{tmp_path / 'out.csv'}'"):
            with pytest.raises(duckdb.Error):
                con.execute(sql)
        with pytest.raises(duckdb.Error):
            con.execute("SET enable_external_access = true")
    finally:
        con.close()
    assert not (tmp_path / "out.csv").exists() and not (tmp_path / "other.duckdb").exists()


def test_no_readable_system_view_shows_the_server(tmp_path):
    """Every built-in view and every allowed table function, read through the real store: each
    is refused, or shows neither the database's directory nor a setting's value."""
    import store
    from store.sqlguard import ALLOWED_TABLE_FUNCTIONS
    s = store.connect(str(tmp_path / "x.duckdb"))
    try:
        s.create_table("solver", {"reward": "float64"})
        views = s.query("SELECT schema_name, view_name FROM duckdb_views() WHERE internal")
        sources = [f'"{schema}"."{name}"' for schema, name in
                   zip(*(views.column(i).to_pylist() for i in range(2)))]
        sources += [f"{fn}()" for fn in sorted(ALLOWED_TABLE_FUNCTIONS)
                    if fn not in ("unnest", "range", "generate_series")]
        assert len(sources) > 40, sources
        readable = 0
        for source in sources:
            try:
                rows = s.query(f"SELECT * FROM {source}").to_pylist()
            except QueryRefused:
                continue
            readable += 1
            text = repr(rows)
            assert str(tmp_path) not in text, (source, text[:300])
            assert "secret_directory" not in text and "temp_directory" not in text, source
        assert readable > 30  # the catalog views people use stay readable
    finally:
        s.close()
