"""Your own SQL on the store (issue 21): read-only for everyone, a tenant-scoped caller sees only
its tenants' rows whatever it names (table, view, subquery), and nothing reads around that.

Real chDB with the crafted data set of tests/unit/test_api_data.py (acme, globex and initech, two
requests each; segments, blocks, usage windows, a dead letter, prices)."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal

import pytest

from sparseety.errors import QueryError
from sparseety.queries.sql import Access, run_sql
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.prices import Price, list_prices, set_prices
from tests.helpers import chdb_config, throwaway_store
from tests.unit.test_api_data import seed


@pytest.fixture(scope="module")
def owner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """The store as its owner opened it (the sink's writes, prices)."""
    with throwaway_store(chdb_config(tmp_path_factory)) as s:
        seed(s)
        yield s


@pytest.fixture(scope="module")
def store(owner: Store) -> Iterator[Store]:
    """A read-only client of it, as every SQL of a caller runs on."""
    with owner.readers(1) as readers:
        yield readers.store()


def _run(store: Store, sql: str, tenants: tuple[str, ...] | None = None) -> tuple[list[str], list[tuple]]:
    return run_sql(store, sql, access=Access(tenants, token_ids=True))


def one(store: Store, sql: str, tenants: tuple[str, ...] | None = None) -> object:
    cols, rows = _run(store, sql.format(db=store.database), tenants)
    assert len(rows) == 1 and len(cols) == 1, (cols, rows)
    return rows[0][0]


def test_admin_sees_everything_read_only(store: Store) -> None:
    assert one(store, "SELECT count() FROM {db}.requests_v") == 6
    assert one(store, "SELECT count() FROM {db}.dead_letters;") == 1
    cols, rows = _run(
        store, f"SELECT tenant, count() AS n FROM {store.database}.requests_v GROUP BY tenant ORDER BY tenant"
    )
    assert cols == ["tenant", "n"] and rows == [("acme", 2), ("globex", 2), ("initech", 2)]
    for bad, why in [
        (f"INSERT INTO {store.database}.prices (model) VALUES ('x')", "one SELECT"),
        (f"DROP TABLE {store.database}.prices", "one SELECT"),
        ("SELECT 1; SELECT 2", "Multi-statements"),
        ("SELECT * FROM file('/etc/hostname', 'LineAsString')", "table function file"),
        ("SELECT 1 FORMAT JSON", "FORMAT"),
        ("", "no SQL"),
    ]:
        with pytest.raises(QueryError, match=why):
            _run(store, bad)


def test_a_tenant_sees_only_its_rows_through_every_name(store: Store) -> None:
    acme = ("acme",)
    assert one(store, "SELECT count() FROM {db}.requests", acme) == 2
    assert one(store, "SELECT count() FROM {db}.requests_v", acme) == 2
    assert one(store, "SELECT uniqExact(tenant) FROM {db}.request_costs_v", acme) == 1
    assert one(store, "SELECT count() FROM (SELECT * FROM {db}.requests FINAL) AS r", acme) == 2
    assert one(store, "WITH x AS (SELECT tenant FROM {db}.requests) SELECT count() FROM x", acme) == 2
    assert one(store, "SELECT count() FROM {db}.usage_1m", acme) == 1
    # child rows: only its requests' (the admin sees every request's)
    mine = one(store, "SELECT uniqExact(request_uid) FROM {db}.token_segments", acme)
    every = one(store, "SELECT uniqExact(request_uid) FROM {db}.token_segments")
    assert mine == 2 and every == 6
    assert one(store, "SELECT countIf(tenant != 'acme') FROM {db}.kv_blocks_v", acme) == 0
    # the pipeline's tables: nothing; prices: the list
    for table in ("dead_letters", "schema_migrations"):
        with pytest.raises(QueryError, match="all-tenant token only"):
            one(store, "SELECT count() FROM {db}." + table, acme)
    assert one(store, "SELECT count() > 0 FROM {db}.prices", acme) == 1
    # a setting of its own is refused, so it cannot lift the filters
    with pytest.raises(QueryError, match="SETTINGS"):
        one(store, "SELECT count() FROM {db}.requests SETTINGS additional_table_filters = {{}}", acme)
    assert one(store, "SELECT count() FROM {db}.requests", ()) == 0  # no tenants: nothing


def test_a_tenant_cannot_read_around_the_filters(store: Store) -> None:
    db = store.database
    for bad, why in [
        (f"SELECT count() FROM merge('{db}', '^requests$')", "table function merge"),
        ("SELECT count() FROM system.query_log", "store's tables"),
        ("SELECT count() FROM system.settings", "store's tables"),
        (f"SELECT count() FROM {db}.requests WHERE request_uid IN {db}.requests", "IN"),
        ("SELECT file('/etc/hostname')", "function file"),
        ("SELECT count() FROM numbers(10)", "table function numbers"),
        ("SELECT * FROM (", "does not parse"),
    ]:
        with pytest.raises(QueryError, match=why):
            _run(store, bad, ("acme",))


def test_the_store_stays_writable_after_a_read_only_query(owner: Store, store: Store) -> None:
    _run(store, f"SELECT count() FROM {store.database}.requests", ("acme",))
    set_prices(owner, [Price("own-sql", "input", Decimal("1"), 0)])
    assert [p["model"] for p in list_prices(store, "own-sql")] == ["own-sql"]
    assert one(store, "SELECT count() FROM {db}.requests") == 6  # and no filter left behind
