"""Issue 30, findings 1, 2 and 4-5: SQL reads only the store's own tables, nothing in the text
changes the settings the store applies, and each permission holds in SQL as in the API.

Each test here failed before issue 30: ``file()`` read the host's files for an all-tenant token, a
trailing ``--`` commented out the appended ``SETTINGS readonly = 1``, ``INTO OUTFILE`` wrote files,
and a token without ``token_ids`` read raw token ids in SQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sparseety.errors import QueryError, SqlRefusedError, StoreError
from sparseety.queries.sql import Access, run_sql, run_sql_raw
from sparseety.sinks.clickhouse.client import Store
from tests.security.conftest import HEAVY, Api

ADMIN = Access(None, token_ids=True)
ADMIN_NO_IDS = Access(None, token_ids=False)
ACME = Access(("acme",), token_ids=False)
ACME_IDS = Access(("acme",), token_ids=True)


@pytest.fixture(scope="module")
def reader(store: Store) -> Iterator[Store]:
    with store.readers(1) as pool:
        yield pool.store()


def rows(reader: Store, sql: str, access: Access = ADMIN) -> list[tuple]:
    return run_sql(reader, sql.format(db=reader.database), access=access)[1]


@pytest.mark.parametrize("access", [ADMIN, ACME], ids=["admin", "tenant"])
@pytest.mark.parametrize(
    "sql, why",
    [
        ("SELECT substring(file('/etc/passwd'), 1, 20)", "function file"),
        ("SELECT file('/proc/self/environ')", "function file"),
        ("SELECT * FROM file('/etc/hostname', 'LineAsString')", "table function file"),
        ("SELECT * FROM url('http://127.0.0.1:9/x', 'CSV')", "table function url"),
        ("SELECT * FROM s3('http://127.0.0.1:9/b/k', 'CSV')", "table function s3"),
        ("SELECT * FROM remote('127.0.0.1', system.one)", "table function remote"),
        ("SELECT * FROM executable('id', 'TSV', 'x String')", "table function executable"),
        ("SELECT * FROM numbers(10)", "table function numbers"),
        ("SELECT * FROM system.numbers LIMIT 1", "store's tables"),
        ("SELECT * FROM system.query_log", "store's tables"),
        ("SELECT * FROM system.processes", "store's tables"),
        ("SELECT 1 AS x SETTINGS readonly = 0", "SETTINGS"),
        ("SELECT a FROM (SELECT 1 AS a SETTINGS max_execution_time = 0)", "SETTINGS"),
        ("SELECT 'x' AS x INTO OUTFILE '/tmp/sparseety-outfile-probe'", "INTO OUTFILE"),
        ("SELECT getSetting('readonly') AS r) SETTINGS readonly=0 --", "does not parse"),
        ("SELECT 'x' AS x) INTO OUTFILE '/tmp/sparseety-outfile-probe' --", "does not parse"),
        ("SELECT 1 UNION ALL SELECT * FROM file('/etc/passwd', 'LineAsString')", "table function file"),
        ("SELECT dictGet('d', 'a', 1)", "function dictGet"),
        ("SELECT joinGet('t', 'a', 1)", "function joinGet"),
        ("SELECT sleepEachRow(3)", "function sleepEachRow"),
        ("SELECT getClientHTTPHeader('Authorization')", "function getClientHTTPHeader"),
        ("SHOW TABLES", "one SELECT"),
        ("DESCRIBE TABLE system.one", "one SELECT"),
        ("EXPLAIN SELECT 1", "one SELECT"),
        ("SELECT 1; SELECT 2", "Multi-statements"),
    ],
)
def test_nothing_reads_outside_the_store(reader: Store, sql: str, why: str, access: Access) -> None:
    with pytest.raises(QueryError, match=why):
        run_sql(reader, sql, access=access)
    assert not Path("/tmp/sparseety-outfile-probe").exists()


def test_the_client_itself_is_read_only(store: Store, reader: Store) -> None:
    # the reader's handle stays read-only whatever ran before: settings come from the store
    assert rows(reader, "SELECT getSetting('readonly') AS r") == [(2,)]
    assert rows(reader, "SELECT 1 AS x -- a comment at the end") == [(1,)]
    with pytest.raises(StoreError, match="read-only client"):
        run_sql(store, "SELECT 1")  # the owner's own client is never a caller's


def test_admin_reads_the_store_and_clickhouse_metadata(reader: Store) -> None:
    assert rows(reader, "SELECT count() FROM {db}.requests_v") == [(8,)]
    assert rows(reader, "SELECT count() FROM {db}.dead_letters") == [(1,)]
    assert rows(reader, "SELECT count() > 0 FROM system.settings") == [(1,)]
    assert rows(reader, "WITH t AS (SELECT tenant FROM {db}.requests) SELECT count() FROM t") == [(8,)]
    with pytest.raises(SqlRefusedError, match="store's tables"):
        rows(reader, "SELECT count() FROM system.settings", ACME)


def test_token_ids_hold_in_sql_as_in_the_api(reader: Store) -> None:
    ids = "SELECT prompt_token_ids FROM {db}.request_tokens ORDER BY request_uid"
    for who in (ACME, ADMIN_NO_IDS):
        with pytest.raises(SqlRefusedError, match="token_ids permission"):
            rows(reader, ids, who)
        # through the view that reads it: filtered to nothing
        assert rows(reader, "SELECT count() FROM {db}.request_tokens_v", who) == [(0,)]
    assert rows(reader, "SELECT count() FROM {db}.request_tokens_v", ACME_IDS) == [(1,)]
    assert rows(reader, ids, ACME_IDS) == [([11, 12, 13, 14, 15, 16, 17, 18, 19, 20],)]
    assert len(rows(reader, ids, ADMIN)) == 2


def test_prices_and_pipeline_tables_are_one_model(reader: Store, api: Api) -> None:
    # prices: every token reads the list, in SQL as in the API
    in_sql = rows(reader, "SELECT count() FROM {db}.prices", ACME)[0][0]
    listed = api.get("/api/v1/prices", "tok-acme")
    assert listed.status_code == 200 and len(listed.json()["rows"]) == in_sql > 0
    # dead letters and migrations: all-tenant tokens only, in SQL as in the API
    for table in ("dead_letters", "schema_migrations"):
        with pytest.raises(SqlRefusedError, match="all-tenant token only"):
            rows(reader, "SELECT count() FROM {db}." + table, ACME)
    assert api.get("/api/v1/dead-letters", "tok-acme").status_code == 403
    assert api.get("/api/v1/dead-letters", "tok-all").status_code == 200


def test_limits_stop_a_statement(reader: Store) -> None:
    with pytest.raises(QueryError, match="Timeout exceeded") as exc:
        run_sql(reader, HEAVY.format(n=450_000), access=ACME, limits={"max_execution_time": 1})
    assert exc.value.fields["code"] == 159
    memory = "SELECT length(groupArray(toString(a))) FROM (SELECT arrayJoin(range(20000000)) a)"
    with pytest.raises(QueryError, match=r"[Mm]emory limit") as exc:
        run_sql(reader, memory, access=ACME, limits={"max_memory_usage": 32 << 20})
    assert exc.value.fields["code"] == 241
    with pytest.raises(QueryError, match=r"[Ll]imit for .*bytes") as exc:
        rows_of = f"SELECT sum(prompt_tokens) FROM {reader.database}.requests"
        run_sql(reader, rows_of, access=ACME, limits={"max_bytes_to_read": 1})
    assert exc.value.fields["code"] == 307
    # the raw path (the ClickHouse interface) applies the same checks and limits
    with pytest.raises(QueryError, match="function file"):
        run_sql_raw(reader, "SELECT file('/etc/passwd')", "TabSeparated")
    cut = run_sql_raw(reader, "SELECT * FROM system.one", "TabSeparated", limits={"max_result_rows": 1})
    assert cut == b"0\n"
