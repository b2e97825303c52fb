"""Schema migrations: cluster DDL text, idempotent apply on chDB, and the Python table specs
agreeing with the DDL."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparseety.errors import MigrationError
from sparseety.sinks.clickhouse import migrate as mg
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.tables import SINK_TABLES
from tests.helpers import chdb_config, throwaway_store


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory, unique: str) -> Iterator[Store]:
    """A fresh, unmigrated database on the process's one chDB path."""
    with throwaway_store(chdb_config(tmp_path_factory, f"t{unique}")) as s:
        yield s


def test_split_statements_drops_comments_and_splits_at_line_end() -> None:
    sql = "-- head\nCREATE TABLE a (x String DEFAULT ';')\nENGINE = Log;\n\n-- two\nSELECT 1;\n"
    assert mg.split_statements(sql) == ["CREATE TABLE a (x String DEFAULT ';')\nENGINE = Log", "SELECT 1"]


def test_render_without_cluster_keeps_plain_engines() -> None:
    (m,) = [m for m in mg.load_migrations() if m.name == "tables"]
    statements = mg.render(m.template, database="acct")
    assert statements[0] == "CREATE DATABASE IF NOT EXISTS acct"
    requests = next(s for s in statements if "acct.requests\n" in s)
    assert "ENGINE = ReplacingMergeTree(_version)" in requests
    assert "ON CLUSTER" not in "\n".join(statements)
    assert "Replicated" not in "\n".join(statements)


def test_render_for_a_cluster_uses_on_cluster_and_replicated_engines() -> None:
    (m,) = [m for m in mg.load_migrations() if m.name == "tables"]
    statements = mg.render(m.template, database="acct", cluster="prod")
    assert statements[0] == "CREATE DATABASE IF NOT EXISTS acct ON CLUSTER 'prod'"
    creates = [s for s in statements if s.startswith("CREATE TABLE")]
    assert len(creates) == 7
    assert all(" ON CLUSTER 'prod'\n" in s for s in creates)
    requests = next(s for s in creates if "acct.requests ON CLUSTER" in s)
    assert (
        "ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', "
        "'{replica}', _version)\nORDER BY (tenant, model, request_uid)"
    ) in requests
    usage = next(s for s in creates if "acct.usage_1m ON CLUSTER" in s)
    assert (
        "ENGINE = ReplicatedReplacingMergeTree("
        "'/clickhouse/tables/{shard}/{database}/{table}', '{replica}')\n" in usage
    )
    assert not any("ENGINE = ReplacingMergeTree" in s for s in creates)
    (views,) = [m for m in mg.load_migrations() if m.name == "views"]
    assert all(
        " ON CLUSTER 'prod' AS" in s for s in mg.render(views.template, database="acct", cluster="prod")
    )
    (boot,) = mg.render(mg.SCHEMA_MIGRATIONS, database="acct", cluster="prod")
    assert "acct.schema_migrations ON CLUSTER 'prod'" in boot and "ReplicatedReplacingMergeTree(" in boot


def test_cluster_names_are_checked() -> None:
    with pytest.raises(MigrationError):
        mg.on_cluster("prod'; DROP")


def test_migration_files_need_contiguous_versions(tmp_path: Path) -> None:
    (tmp_path / "001_a.sql").write_text("SELECT 1;")
    (tmp_path / "003_c.sql").write_text("SELECT 1;")
    with pytest.raises(MigrationError, match="without gaps"):
        mg.load_migrations(tmp_path)
    (tmp_path / "2_b.sql").write_text("SELECT 1;")
    with pytest.raises(MigrationError, match="NNN_name"):
        mg.load_migrations(tmp_path)


def test_migrate_is_idempotent_and_recorded(store: Store) -> None:
    with pytest.raises(MigrationError, match="sparseety db migrate"):
        mg.ensure_migrated(store)
    assert all(not s.applied for s in mg.status(store))
    applied = mg.migrate(store)
    assert [m.version for m in applied] == [m.version for m in mg.load_migrations()] + [mg.VIEWS_VERSION]
    assert mg.migrate(store) == []
    assert all(s.applied and s.checksum_ok for s in mg.status(store))
    mg.ensure_migrated(store)


def test_the_views_file_is_applied_again_when_it_changes(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """views.sql is repeatable: a store whose views are older than the file is behind (status,
    ensure_migrated), and migrate applies the file again, not the numbered migrations."""
    mg.migrate(store)
    probe = "CREATE OR REPLACE VIEW {db}.probe_v{on_cluster} AS SELECT 1 AS x;"
    (tmp_path / mg.VIEWS_FILE).write_text(mg.load_views().template + "\n" + probe + "\n")
    edited = mg.load_views(tmp_path)
    monkeypatch.setattr(mg, "load_views", lambda folder=None: edited)
    assert not mg.status(store)[-1].applied
    with pytest.raises(MigrationError, match="sparseety db migrate"):
        mg.ensure_migrated(store)
    assert [m.version for m in mg.migrate(store)] == [mg.VIEWS_VERSION]
    assert store.query(f"SELECT x FROM {store.database}.probe_v") == [{"x": 1}]
    mg.ensure_migrated(store)
    assert mg.migrate(store) == []


def test_every_view_is_defined_in_the_views_file_as_its_last_numbered_definition() -> None:
    """views.sql holds each view's current definition: the last one a numbered migration gave
    it, until a view changes here (then the two differ on purpose; list such views here)."""
    changed_since = {"request_costs_v"}  # issue 31: warm-up out of the GPU bill
    last: dict[str, str] = {}
    for m in mg.load_migrations():
        for st in mg.split_statements(m.template):
            found = re.match(r"CREATE OR REPLACE VIEW \{db\}\.(\w+)", st)
            if found:
                last[found.group(1)] = st
    current = {}
    for st in mg.split_statements(mg.load_views().template):
        found = re.match(r"CREATE OR REPLACE VIEW \{db\}\.(\w+)", st)
        assert found, st[:80]
        current[found.group(1)] = st
    assert set(current) == set(last)
    assert {name for name in last if last[name] != current[name]} == changed_since


def test_table_specs_match_the_ddl(store: Store) -> None:
    mg.migrate(store)
    for table in SINK_TABLES:
        rows = store.query(
            "SELECT name FROM system.columns WHERE database = {db:String} AND table = {t:String} "
            "AND default_kind != 'MATERIALIZED' ORDER BY position",
            {"db": store.database, "t": table.name},
        )
        assert tuple(r["name"] for r in rows) == table.columns, table.name
        (key,) = store.query(
            "SELECT sorting_key FROM system.tables WHERE database = {db:String} AND name = {t:String}",
            {"db": store.database, "t": table.name},
        )
        assert key["sorting_key"] == ", ".join(table.key), table.name


def test_an_edited_migration_is_refused(store: Store) -> None:
    migrations = mg.load_migrations()
    mg.migrate(store, migrations)
    edited = [*migrations[:-1], mg.Migration(migrations[-1].version, migrations[-1].name, "SELECT 2;")]
    with pytest.raises(MigrationError, match="changed after it was applied"):
        mg.migrate(store, edited)
    assert not mg.status(store, edited)[-1].checksum_ok
