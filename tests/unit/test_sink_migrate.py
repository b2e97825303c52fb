"""Schema migrations: cluster DDL text, idempotent apply on chDB, the Python table specs
agreeing with the DDL, views defined once (views.sql), and an old store migrating to what a
fresh one is."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparseety import events as ev
from sparseety.errors import MigrationError
from sparseety.sinks.clickhouse import migrate as mg
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.tables import SINK_TABLES
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from tests import factories as f
from tests.helpers import chdb_config, throwaway_store

#: A fresh store's tables, views and columns (see test_a_fresh_store_has_the_recorded_schema).
SCHEMA_FILE = Path(__file__).parent.parent / "data" / "store_schema.txt"
_VIEW_STATEMENT = re.compile(r"^(CREATE OR REPLACE VIEW|DROP VIEW IF EXISTS) \{db\}\.(\w+)\{on_cluster\}")


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
    assert all(
        " ON CLUSTER 'prod' AS" in s
        for s in mg.render(mg.load_views().template, database="acct", cluster="prod")
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


def view_names() -> list[str]:
    """The views views.sql defines (a DROP VIEW IF EXISTS in it removes one), in its order."""
    names = []
    for st in mg.split_statements(mg.load_views().template):
        found = _VIEW_STATEMENT.match(st)
        assert found, st[:80]
        if found.group(1).startswith("CREATE"):
            names.append(found.group(2))
    return names


def test_every_view_is_defined_once_in_the_views_file() -> None:
    """Issue 34: views.sql holds only view statements, one per view; a numbered migration holds
    table changes and data moves only: it neither defines nor drops a view, nor reads one (a
    fresh store has no view before views.sql runs, after every numbered migration)."""
    names = [
        m.group(2) for m in map(_VIEW_STATEMENT.match, mg.split_statements(mg.load_views().template)) if m
    ]
    assert len(names) == len(set(names)) and len(names) >= 11
    reads_a_view = re.compile(r"\{db\}\.(" + "|".join(view_names()) + r")\b")
    for m in mg.load_migrations():
        for st in mg.split_statements(m.template):
            assert not re.search(r"\b(CREATE|DROP)\s+(OR\s+REPLACE\s+)?VIEW\b", st, re.I), (m.name, st[:80])
            assert not reads_a_view.search(st), (m.name, st[:80])


def test_replaced_checksums_name_the_current_files() -> None:
    """A store that applied a migration's text from before issue 34 passes the checksum check
    while the file is the text that replaced it, and only then."""
    migrations = {m.version: m for m in mg.load_migrations()}
    for version, replaced in mg.REPLACED_CHECKSUMS.items():
        m = migrations[version]
        for earlier, replacement in replaced.items():
            assert replacement == m.checksum, f"{version:03d}_{m.name} changed after issue 34"
            assert m.accepts(earlier) and m.accepts(m.checksum)
            edited = mg.Migration(m.version, m.name, m.template + "-- edited\n")
            assert not edited.accepts(earlier) and not edited.accepts(m.checksum)
    assert not migrations[1].accepts(next(iter(mg.REPLACED_CHECKSUMS[2])))


def describe(store: Store) -> dict[str, str]:
    """Every table and view of the store's database (its CREATE statement), and every column
    (type, default), the database's name left out."""
    db = store.database
    out = {}
    for r in store.query(
        "SELECT name, engine, create_table_query FROM system.tables WHERE database = {db:String}", {"db": db}
    ):
        out[r["name"]] = f"{r['engine']}: {r['create_table_query'].replace(db + '.', '{db}.')}"
    for r in store.query(
        "SELECT table, name, type, default_kind, default_expression FROM system.columns "
        "WHERE database = {db:String} ORDER BY table, position",
        {"db": db},
    ):
        default = f" {r['default_kind']} {r['default_expression']}" if r["default_kind"] else ""
        out[f"{r['table']}.{r['name']}"] = f"{r['type']}{default}"
    return out


def recorded_schema(store: Store) -> str:
    """The schema as SCHEMA_FILE holds it: each table and view (its engine), then its columns
    in order, with type and default. View bodies are left out (views.sql is their text)."""
    lines = []
    tables = store.query(
        "SELECT name, engine FROM system.tables WHERE database = {db:String} ORDER BY name",
        {"db": store.database},
    )
    for t in tables:
        lines.append(f"{t['name']} ({t['engine']})")
        for c in store.query(
            "SELECT name, type, default_kind, default_expression FROM system.columns "
            "WHERE database = {db:String} AND table = {t:String} ORDER BY position",
            {"db": store.database, "t": t["name"]},
        ):
            default = f" {c['default_kind']} {c['default_expression']}" if c["default_kind"] else ""
            lines.append(f"    {c['name']} {c['type']}{default}")
    return "\n".join(lines) + "\n"


def test_a_fresh_store_has_the_recorded_schema(store: Store) -> None:
    """A fresh store's tables, views and columns are tests/data/store_schema.txt, recorded before
    issue 34 moved the view bodies out of the numbered migrations (it must not have changed any).
    A migration or view that changes the schema on purpose records it again:
    SPARSEETY_RECORD_SCHEMA=1 pytest tests/unit/test_sink_migrate.py -k recorded_schema (review the diff)."""
    mg.migrate(store)
    schema = recorded_schema(store)
    if os.environ.get("SPARSEETY_RECORD_SCHEMA"):
        SCHEMA_FILE.write_text(schema)
    assert schema == SCHEMA_FILE.read_text()
    assert {line.split()[0] for line in schema.splitlines() if line.endswith("(View)")} == set(view_names())


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


S = 1_000_000_000
T0 = 1_700_000_000 * S
MIN = 60 * S
W = 5 * MIN  # the usage windows' length
WS = T0 - T0 % W  # their start
_REQUEST_COLUMNS = (
    "request_uid, engine_name, engine_id, request_id, tenant, model, lora_name, engine_kind, finished_ts_ns, "
    "finish_reason, complete, prompt_tokens, output_tokens, cache_read_tokens, uncached_computed_tokens, "
    "recomputed_tokens, draft_accepted_tokens, draft_rejected_tokens, scheduled_tokens, gpu_time_ns, "
    "engine_cached_tokens, attention_pairs, attention_pairs_skipped, _version"
)


def rows_of_a_store_from_001(store: Store, *, before_013: bool) -> None:
    """Rows in the columns of migration 001, by plain INSERTs: requests (one of them a hidden
    vllm_log copy, one an adapter request), their segments and blocks, usage windows, prices,
    expert load and dead letters. ``before_013``: the adapter request and its usage window as
    they were written before issue 23 (the adapter in `model`; migration 013 rewrites them), and
    window release in `evicted_tokens` as schema v1 wrote it (migration 016 moves it), else as the
    writer writes them now (the base model in `model`, window release in window_released_tokens)."""
    db = store.database
    adapter_model = "ad1" if before_013 else "m1"
    released = "evicted_tokens" if before_013 else "window_released_tokens"
    store.command(
        f"INSERT INTO {db}.requests ({_REQUEST_COLUMNS}, {released}) VALUES "
        f"('e1@1/r1', 'e1', 'e1@1', 'x1', 'A', 'm1', NULL, 'vllm', {T0 + MIN}, 'stop', 1, "
        f"4000, 500, 0, 4499, 0, 0, 0, 4499, {2 * S}, 0, 100, 0, 1, 0), "
        f"('e1@1/r2', 'e1', 'e1@1', 'x2', 'B', '{adapter_model}', 'ad1', 'vllm', {T0 + 2 * MIN}, 'abort', 0, "
        f"3000, 200, 2000, 1000, 300, 50, 30, 1580, {S}, 2000, 100, 40, 2, 0), "
        f"('log1@1/x1', 'log1', 'log1@1', 'x1', 'A', 'm1', NULL, 'vllm_log', {T0 + MIN}, 'stop', 1, "
        f"4000, 500, 0, 4000, 0, 0, 0, 0, 0, -1, 0, 0, 3, 0), "
        f"('e2@1/r3', 'e2', 'e2@1', 'x3', 'C', 'm2', NULL, 'vllm', {T0 + 3 * MIN}, 'length', 1, "
        f"1000, 10, 0, 1009, 0, 0, 0, 1009, {S // 2}, 0, 0, 0, 4, 600)"
    )
    store.command(
        f"INSERT INTO {db}.token_segments (request_uid, idx, _version, start, end, kind, status, "
        "draft_accepted, source_request_uid) VALUES "
        "('e1@1/r1', 0, 1, 0, 4000, 'prompt', 'computed', 0, NULL), "
        "('e1@1/r1', 1, 1, 4000, 4500, 'output', 'computed', 0, NULL), "
        "('e1@1/r2', 0, 2, 0, 2000, 'prompt', 'cached', 0, 'e1@1/r1'), "
        "('e1@1/r2', 1, 2, 2000, 3000, 'prompt', 'recomputed', 0, NULL)"
    )
    store.command(
        f"INSERT INTO {db}.kv_blocks (request_uid, idx, _version, block_hash, lifetime_seq, role, tokens) "
        "VALUES "
        "('e1@1/r1', 0, 1, 'b1', 10, 'computed', 1000), ('e1@1/r1', 1, 1, 'b2', 11, 'computed', 1000), "
        "('e1@1/r2', 0, 2, 'b1', 10, 'cached', 1000), ('e1@1/r2', 1, 2, 'b2', 20, 'recomputed', 1000), "
        "('e2@1/r3', 0, 4, 'c1', 7, 'computed', 1000)"
    )
    usage = (
        "tenant, model, window_start_ns, engine_name, usage_id, kind, window_ns, requests, "
        "incomplete_requests, prompt_tokens, output_tokens, cache_read_tokens, uncached_computed_tokens, "
        "recomputed_tokens, "
        f"draft_accepted_tokens, draft_rejected_tokens, skipped_tokens, {released}, gpu_time_ns, est_flops"
    )
    adapter_window = (
        f"('B', '{adapter_model}', {WS}, 'e1', 'u2', 'final', {W}, 1, 1, 3000, 200, 2000, 1000, 300, "
        f"50, 30, 0, 0, {S}, 2.5"
    )
    store.command(
        f"INSERT INTO {db}.usage_1m ({usage}) VALUES "
        f"('A', 'm1', {WS}, 'e1', 'u1', 'final', {W}, 1, 0, 4000, 500, 0, 4499, 0, 0, 0, 0, 0, {S}, 1.5), "
        f"('A', 'm1', {WS}, 'log1', 'u3', 'final', {W}, 1, 0, 4000, 500, 0, 4000, 0, 0, 0, 0, 0, 0, 0), "
        f"('C', 'm2', {WS}, 'e2', 'u4', 'correction', {W}, 1, 0, 1000, 10, 0, 1009, 0, 0, 0, 0, 600, 0, 0)"
    )
    if before_013:
        store.command(f"INSERT INTO {db}.usage_1m ({usage}) VALUES {adapter_window})")
    else:
        store.command(f"INSERT INTO {db}.usage_1m ({usage}, lora_name) VALUES {adapter_window}, 'ad1')")
    store.command(
        f"INSERT INTO {db}.prices (model, token_class, effective_from_ns, price_micro, note, set_ns) VALUES "
        "('m1', 'input', 0, 10000000, '', 1), ('m1', 'cached_input', 0, 2500000, '', 1), "
        "('m1', 'output', 0, 40000000, '', 1), ('m1', 'gpu_hour', 0, 3600000, '', 1), "
        f"('m2', 'input', 0, 20000000, '', 1), ('m2', 'input', {T0 + 2 * MIN}, 30000000, 'later', 2), "
        "('m2', 'output', 0, 60000000, '', 1)"
    )
    store.command(
        f"INSERT INTO {db}.expert_load (model, request_uid, _version, tenant, engine_name, finished_ts_ns, "
        f"num_layers, num_experts, counts) VALUES ('m2', 'e2@1/r3', 4, 'C', 'e2', {T0 + 3 * MIN}, 1, 4, "
        "[3, 0, 5, 2])"
    )
    store.command(
        f"INSERT INTO {db}.dead_letters (dlq_topic, dlq_partition, dlq_offset, error_type, reason, "
        "component, topic, partition, offset, key, value, ts_ns) VALUES "
        "('dlq', 0, 0, 'schema', 'bad', 'worker', 'timelines', 1, 7, NULL, 'v', 1), "
        "('dlq', 0, 1, 'schema', 'bad again', 'worker', 'timelines', 1, 7, NULL, 'v', 2), "
        "('dlq', 0, 2, 'decode', 'no position', 'ingest', '', -1, -1, 'k', NULL, 3)"
    )


def written_now(store: Store) -> None:
    """A request written by the real writer after the store is migrated."""
    sink = ClickHouseSink(store)
    rec = f.accounting(
        "e3@1/w1", engine_name="e3", engine_id="e3@1", tenant="A", model="m1", finished_ts_ns=T0
    )
    sink.add(ev.REQUEST_ACCOUNTING, rec, topic="timelines", partition=0, offset=0)
    sink.flush()


def answers(store: Store) -> dict[str, list[str]]:
    """Every table (FINAL) and view of the store, its rows as text, sorted."""
    db = store.database
    names = store.query(
        "SELECT name, engine FROM system.tables WHERE database = {db:String} AND name != 'schema_migrations'",
        {"db": db},
    )
    out = {}
    for t in names:
        final = "" if t["engine"] == "View" else " FINAL"
        out[t["name"]] = sorted(repr(r) for r in store.query(f"SELECT * FROM {db}.{t['name']}{final}"))
    return out


def test_a_store_migrated_from_001_is_a_fresh_store(
    tmp_path_factory: pytest.TempPathFactory, unique: str
) -> None:
    """Issue 34: a store that had migration 001 only, with rows, migrates to what a fresh store
    is: the same tables, columns, types and views, and for the same rows the same answers (013's
    rewrite of adapter rows and 014's rebuild of dead_letters included)."""
    migrations = mg.load_migrations()
    with (
        throwaway_store(chdb_config(tmp_path_factory, f"old{unique}")) as old,
        throwaway_store(chdb_config(tmp_path_factory, f"new{unique}")) as new,
    ):
        assert [m.version for m in mg.migrate(old, migrations[:1])] == [1]
        rows_of_a_store_from_001(old, before_013=True)
        assert [m.version for m in mg.migrate(old)] == [m.version for m in migrations[1:]] + [
            mg.VIEWS_VERSION
        ]
        mg.migrate(new)
        rows_of_a_store_from_001(new, before_013=False)
        for store in (old, new):
            written_now(store)
            mg.ensure_migrated(store)
        assert describe(old) == describe(new)
        got = answers(old)
        assert got == answers(new)
        assert set(view_names()) <= set(got)
        assert len(got["requests_v"]) == 4 and len(got["log_duplicates_v"]) == 1
        (log_window,) = old.query(f"SELECT requests FROM {old.database}.usage_v WHERE engine_name = 'log1'")
        assert log_window["requests"] == 0  # the hidden copy is subtracted
        assert len(got["dead_letters"]) == 2  # one per refused input (014)
        (adapter,) = old.query(
            f"SELECT model, lora_name FROM {old.database}.requests_v WHERE request_id = 'x2'"
        )
        assert adapter == {"model": "m1", "lora_name": "ad1"}
        # schema v1's window release: the views added evicted_tokens to it, 016 moved it (same answer)
        (released,) = old.query(
            f"SELECT window_released_tokens FROM {old.database}.request_costs_v WHERE request_uid = 'e2@1/r3'"
        )
        (window,) = old.query(f"SELECT window_released_tokens FROM {old.database}.usage_v WHERE tenant = 'C'")
        assert released["window_released_tokens"] == window["window_released_tokens"] == 600
        assert all(
            got[name] for name in ("request_costs_v", "usage_v", "amortized_delta_v", "sparsity_signals_v")
        )


def test_evicted_tokens_move_once_however_often_016_runs(store: Store) -> None:
    """Migration 016 adds an old row's evicted_tokens to window_released_tokens (every version of
    a request) and drops the column; a run interrupted after the update, or after the drop, and
    applied again adds nothing twice."""
    migrations = mg.load_migrations()
    (m016,) = [m for m in migrations if m.name == "evicted_tokens_folded"]
    mg.migrate(store, migrations[: m016.version - 1])
    db = store.database
    for version, evicted, released in ((1, 7, 2), (2, 9, 0)):
        store.command(
            f"INSERT INTO {db}.requests (request_uid, tenant, model, evicted_tokens, window_released_tokens, "
            f"_version) VALUES ('u1', 'A', 'm', {evicted}, {released}, {version})"
        )
    store.command(
        f"INSERT INTO {db}.requests (request_uid, tenant, model, window_released_tokens, _version) "
        "VALUES ('u2', 'A', 'm', 4, 1)"
    )
    store.command(
        f"INSERT INTO {db}.usage_1m (tenant, model, window_start_ns, engine_name, usage_id, evicted_tokens, "
        "window_released_tokens) VALUES ('A', 'm', 0, 'e', 'w', 5, 1)"
    )

    def released() -> list[tuple[str, int, int]]:
        rows = store.query(f"SELECT request_uid, _version, window_released_tokens AS w FROM {db}.requests")
        (usage,) = store.query(f"SELECT window_released_tokens AS w FROM {db}.usage_1m FINAL")
        return [*sorted((r["request_uid"], r["_version"], r["w"]) for r in rows), ("usage", 0, usage["w"])]

    expected = [("u1", 1, 9), ("u1", 2, 9), ("u2", 1, 4), ("usage", 0, 6)]
    statements = mg.render(m016.template, database=db)
    for statement in statements[:2]:  # requests: the column ensured, then the update
        store.command(statement)
    assert [m.version for m in mg.migrate(store)] == [
        m016.version,
        *range(m016.version + 1, len(migrations) + 1),
        mg.VIEWS_VERSION,
    ]
    assert released() == expected
    for statement in statements:  # after the drop: applied again
        store.command(statement)
    assert released() == expected
    columns = store.query(
        f"SELECT table FROM system.columns WHERE database = '{db}' AND name = 'evicted_tokens'"
    )
    assert columns == []


def earlier_checksums(store: Store, versions: set[int]) -> None:
    """Make ``store`` look like one that applied the texts of ``versions`` from before issue 34:
    schema_migrations rewritten in the order it was applied, those versions with their earlier
    checksums."""
    db = store.database
    rows = store.query(f"SELECT version, name, checksum, applied_ns FROM {db}.schema_migrations FINAL")
    store.command(f"TRUNCATE TABLE {db}.schema_migrations")
    for r in rows:
        if r["version"] in versions and r["version"] in mg.REPLACED_CHECKSUMS:
            r["checksum"] = next(iter(mg.REPLACED_CHECKSUMS[r["version"]]))  # the earliest text
    store.insert(
        f"{db}.schema_migrations",
        [[r[k] for r in rows] for k in ("version", "name", "checksum", "applied_ns")],
        ["version", "name", "checksum", "applied_ns"],
    )


def test_a_store_with_the_earlier_checksums_migrates(store: Store) -> None:
    """A store that applied the numbered migrations as they were before issue 34 (their view
    bodies included) passes the checksum check; one that stopped half-way gets the rest and the
    views."""
    migrations = mg.load_migrations()
    mg.migrate(store, migrations[:8])
    earlier_checksums(store, set(range(1, 9)))
    assert [s.checksum_ok for s in mg.status(store)] == [True] * (len(migrations) + 1)
    assert [m.version for m in mg.migrate(store)] == [m.version for m in migrations[8:]] + [mg.VIEWS_VERSION]
    mg.ensure_migrated(store)

    earlier_checksums(store, set(mg.REPLACED_CHECKSUMS))
    status = mg.status(store)
    assert all(s.applied and s.checksum_ok for s in status), status
    assert mg.migrate(store) == []
    (row,) = store.query(f"SELECT checksum FROM {store.database}.schema_migrations FINAL WHERE version = 3")
    assert row["checksum"] in mg.REPLACED_CHECKSUMS[3]
    # 013 was replaced twice (issues 34 and 36): a store that applied either earlier text passes
    m13 = next(m for m in migrations if m.version == 13)
    assert len(mg.REPLACED_CHECKSUMS[13]) == 2 and all(m13.accepts(c) for c in mg.REPLACED_CHECKSUMS[13])


def test_views_are_applied_again_after_a_numbered_migration(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A migration that adds a column to requests needs no view statement: views.sql is applied
    again after it (requests_v selects *), also when the run stopped before the views."""
    migrations = mg.load_migrations()
    mg.migrate(store)
    probe = "ALTER TABLE {db}.requests{on_cluster} ADD COLUMN IF NOT EXISTS probe_col Int32 DEFAULT 7;\n"
    extra = [*migrations, mg.Migration(len(migrations) + 1, "probe", probe)]
    monkeypatch.setattr(mg, "load_migrations", lambda folder=None: extra)
    assert [m.version for m in mg.migrate(store)] == [len(extra), mg.VIEWS_VERSION]
    columns = f"SELECT name FROM system.columns WHERE database = '{store.database}' AND table = 'requests_v'"
    assert "probe_col" in {r["name"] for r in store.query(columns)}

    again = [*extra, mg.Migration(len(extra) + 1, "probe_again", probe.replace("probe_col", "probe_two"))]
    mg.migrate(store, again)  # an explicit list: the views are not applied (a run that stopped)
    monkeypatch.setattr(mg, "load_migrations", lambda folder=None: again)
    assert not mg.status(store)[-1].applied
    with pytest.raises(MigrationError, match="sparseety db migrate"):
        mg.ensure_migrated(store)
    assert [m.version for m in mg.migrate(store)] == [mg.VIEWS_VERSION]
    assert "probe_two" in {r["name"] for r in store.query(columns)}
    mg.ensure_migrated(store)
