"""Versioned schema migrations: ``migrations/NNN_name.sql``, applied in order, recorded in
``schema_migrations``; then the repeatable ``migrations/views.sql``, the one definition of every
view, applied again whenever it changed or a numbered migration was applied after it (recorded as
version 0 with its checksum; a view that selects ``*`` so reads the columns a migration adds).

Numbered migrations hold table changes and data moves only, and never change once applied; no
statement of theirs defines, drops or reads a view (a fresh store has no view until ``views.sql``
runs, after them). Views change in ``views.sql`` only, so a view's definition lives in one place;
a MATERIALIZED VIEW feeding a table would be table plumbing and belong in a numbered migration
(there is none). Until issue 34 the numbered files also held every view's history; those bodies
were removed, and :data:`REPLACED_CHECKSUMS` keeps valid the checksums of stores that applied the
earlier texts, which end in the same schema (``tests/unit/test_sink_migrate.py`` compares a store
migrated step by step from 001 with a fresh one).

Migration files are templates: ``{db}`` is the database and ``{on_cluster}`` is empty or
`` ON CLUSTER '<name>'``. With a cluster configured, every ``ENGINE = X(...)`` of the MergeTree
family becomes ``ReplicatedX('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', ...)``
(``{shard}``/``{replica}`` are the server's macros). Every statement is idempotent (``IF NOT
EXISTS`` / ``OR REPLACE``), so a migration interrupted half-way is simply applied again.

Rendering is pure (:func:`render`), so the cluster DDL is checked by tests without a cluster.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparseety.config import RETENTION
from sparseety.errors import MigrationError

if TYPE_CHECKING:
    from .client import Store

_FILE = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")
#: The repeatable migration: every view's current definition.
VIEWS_FILE = "views.sql"
VIEWS_VERSION = 0
_ENGINE = re.compile(
    r"ENGINE\s*=\s*(ReplacingMergeTree|MergeTree|SummingMergeTree|AggregatingMergeTree)(\(([^)]*)\))?"
)
REPLICA_PATH = "'/clickhouse/tables/{shard}/{database}/{table}', '{replica}'"

SCHEMA_MIGRATIONS = """
CREATE TABLE IF NOT EXISTS {db}.schema_migrations{on_cluster}
(
    version UInt32,
    name String,
    checksum String,
    applied_ns Int64
)
ENGINE = ReplacingMergeTree(applied_ns)
ORDER BY version
"""


#: Checksums of numbered migrations as they were before issue 34 removed their view bodies (every
#: view is defined in views.sql since), by version: {checksum of the earlier text: checksum of the
#: text that replaced it}. A store that applied the earlier text passes the checksum check while
#: the file is still that replacement; its views come from views.sql as everyone's do. The earlier
#: texts are in git (``git show 4acb7f3:sinks/clickhouse/migrations/NNN_name.sql``).
REPLACED_CHECKSUMS: dict[int, dict[str, str]] = {
    2: {
        "052ff7186e5aafadcfc246665b004269cbdcbfdba1dc23d95863837c0d83fbcc": (
            "2ebf1afa5c144fce508c1f942f9152f6acb234fbd552378cc15c4a5ea67015d6"
        ),
    },
    3: {
        "ac89d734c8efab66d34426796c0e5bb50c240a0d3f7903d08a9fd27aa54ab521": (
            "d2ada518f9583782f02eed878e5f2ff307671a08ccd746d987896fd9422780f7"
        ),
    },
    5: {
        "24042d6773f1c652e8f47e9365cb0a93dacad6f2b93c1f0d3b1e88663bab69af": (
            "1b66182707063927cbe2abf51da664d0756bd2111854e4a56000bc3cc519061b"
        ),
    },
    6: {
        "6e024558040ce8bf8e2bafeba90529e9c1f3a0e77dd2c2486313bb930991e4a1": (
            "a822fc6f238e76bf2f54c3795af83cf6038dcf9b64a886708a39307914c40e84"
        ),
    },
    7: {
        "0f4b58f11fe7c450e8b5a4f10dcaea0c6ae20842226743da269bae0501cf0521": (
            "22ec313fb4dcc77fa24eb8faaec660652f7a96f8920213c54a80e619b5a0c27f"
        ),
    },
    8: {
        "622ba3fcada6647d6fa2bdcd72e46814fff1667a95e1506fa3a93b1be5c6dcb6": (
            "03b02a7d831e4262b28c1ddc93652bb0c2380277cd1dd6e726d5a0d14a2a053e"
        ),
    },
    9: {
        "286184afe138808688a3762b729dc5fd45539b1a3e6fe60dd408fa15db87eea3": (
            "19ac1aed850fd061b36312dc8a8b393e95fa98223169ae0c8137af942b758eff"
        ),
    },
    10: {
        "3a8218d99043a4022b7c0ead1d95088520db3dae61e1e6292cd738ba95ec8e8e": (
            "6bcf34178c3c5e7f8dc30ccb7751bfb5759f50a8f684390ed85d2af4a5fd1551"
        ),
    },
    11: {
        "76f3da5f66c001dab3c8cd8bcc5b44d26d9471d46220c108c6fa09251580a88d": (
            "62deea2d0f9418c9a824a902cad23175e64b4e502cc377f934200d0e7ba412d7"
        ),
    },
    12: {
        "6dd0995f53ee052a3b14346e4f371e66d1a81faa886f57fc33f7a4d3f812ffe7": (
            "b8f73629be723f60870ee386fc96f55e025dcfb09e39d61adc131f04a0259155"
        ),
    },
    # 013 was replaced twice: by issue 34 (view bodies out), then by issue 36, whose text lists
    # migration 017's price classes in its enum so that applying it again never shrinks the
    # sorting key's enum (the schema after 017 is the same either way).
    13: {
        "a937dacfa0726e32e1aa2795150c45a117275750b88d62e129f5d753dd5b2a6f": (
            "b02fc35971f1fa14e0d03a4df7c45e61e95c997a9cc85b7d338b010439b550d6"
        ),
        "c319c16c0162a498d8c5e9dcbaa0c67ea173b337f7b6bcd482eea53eaaeac3ee": (
            "b02fc35971f1fa14e0d03a4df7c45e61e95c997a9cc85b7d338b010439b550d6"
        ),
    },
}


@dataclass(frozen=True)
class Migration:
    """One migration file."""

    version: int
    name: str
    template: str

    @property
    def checksum(self) -> str:
        """sha256 of the template: an applied migration must never change."""
        return hashlib.sha256(self.template.encode()).hexdigest()

    def accepts(self, recorded: str) -> bool:
        """Whether a store that recorded ``recorded`` for this version applied this text, or an
        earlier one this text replaced without changing the schema (:data:`REPLACED_CHECKSUMS`)."""
        return (
            recorded == self.checksum
            or REPLACED_CHECKSUMS.get(self.version, {}).get(recorded) == self.checksum
        )


@dataclass(frozen=True)
class MigrationStatus:
    """A known migration and whether (and when) it was applied."""

    version: int
    name: str
    applied: bool
    applied_ns: int | None
    checksum_ok: bool


def migrations_dir() -> Path:
    """The installed ``migrations/`` folder."""
    return Path(str(resources.files("sparseety.sinks.clickhouse") / "migrations"))


def load_migrations(folder: Path | None = None) -> list[Migration]:
    """Every ``NNN_name.sql`` in ``folder``, by version.

    Raises:
        MigrationError: a badly named file, or versions that are not 1, 2, 3, ... without gaps.
    """
    folder = folder or migrations_dir()
    found = []
    for path in sorted(folder.glob("*.sql")):
        if path.name == VIEWS_FILE:
            continue
        m = _FILE.match(path.name)
        if m is None:
            raise MigrationError(f"migration file {path.name} is not named NNN_name.sql", path=str(path))
        found.append(Migration(int(m.group(1)), m.group(2), path.read_text()))
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(
            f"migration versions must be 1..n without gaps, found {versions}", versions=versions
        )
    return found


def load_views(folder: Path | None = None) -> Migration:
    """The repeatable views migration (``views.sql``), as version 0."""
    path = (folder or migrations_dir()) / VIEWS_FILE
    return Migration(VIEWS_VERSION, "views_current", path.read_text())


def split_statements(sql: str) -> list[str]:
    """Statements of a migration: ``--`` comment lines dropped, split at ``;`` ending a line."""
    statements, current = [], []
    for line in sql.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("--"):
            continue
        current.append(line.rstrip())
        if stripped.endswith(";"):
            statements.append("\n".join(current).rstrip().rstrip(";").strip())
            current = []
    if current:
        statements.append("\n".join(current).strip())
    return statements


def on_cluster(cluster: str) -> str:
    """The ``ON CLUSTER`` clause for ``cluster`` (empty string for none)."""
    if not cluster:
        return ""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", cluster):
        raise MigrationError(f"cluster name {cluster!r} has characters ClickHouse would not accept")
    return f" ON CLUSTER '{cluster}'"


def replicated_engine(match: re.Match[str]) -> str:
    """``ENGINE = XMergeTree(args)`` -> ``ENGINE = ReplicatedXMergeTree(<path>, <replica>, args)``."""
    engine, args = match.group(1), (match.group(3) or "").strip()
    return f"ENGINE = Replicated{engine}({REPLICA_PATH}{', ' + args if args else ''})"


def render(template: str, *, database: str, cluster: str = "") -> list[str]:
    """The statements of a migration for ``database``, in cluster form when ``cluster`` is set."""
    text = template.replace("{db}", database).replace("{on_cluster}", on_cluster(cluster))
    if cluster:
        text = _ENGINE.sub(replicated_engine, text)
    return split_statements(text)


def _applied(store: Store) -> dict[int, tuple[str, str, int]]:
    rows = store.query(
        f"SELECT version, name, checksum, applied_ns FROM {store.database}.schema_migrations FINAL"
    )
    return {int(r["version"]): (r["name"], r["checksum"], int(r["applied_ns"])) for r in rows}


def _views_current(applied: Mapping[int, tuple[str, str, int]], views: Migration) -> bool:
    """``views.sql`` as it is now was applied, and no numbered migration since."""
    if VIEWS_VERSION not in applied:
        return False
    _, checksum, at = applied[VIEWS_VERSION]
    last = max((ns for v, (_, _, ns) in applied.items() if v != VIEWS_VERSION), default=0)
    return checksum == views.checksum and at >= last


def _bootstrap(store: Store) -> None:
    db, cl = store.database, on_cluster(store.cluster)
    store.command(f"CREATE DATABASE IF NOT EXISTS {db}{cl}")
    for statement in render(SCHEMA_MIGRATIONS, database=db, cluster=store.cluster):
        store.command(statement)


def status(store: Store, migrations: list[Migration] | None = None) -> list[MigrationStatus]:
    """Every known migration with its state in ``store`` (nothing is created); without an
    explicit list, the views migration last (applied: its current text is, after every numbered
    migration the store has)."""
    views = load_views() if migrations is None else None
    migrations = migrations if migrations is not None else load_migrations()
    exists = store.query(
        "SELECT count() AS n FROM system.tables WHERE database = {db:String} AND name = 'schema_migrations'",
        {"db": store.database},
    )
    applied = _applied(store) if exists and int(exists[0]["n"]) else {}
    out = [
        MigrationStatus(
            m.version,
            m.name,
            m.version in applied,
            applied[m.version][2] if m.version in applied else None,
            m.version not in applied or m.accepts(applied[m.version][1]),
        )
        for m in migrations
    ]
    if views is not None:
        current = _views_current(applied, views)
        at = applied[VIEWS_VERSION][2] if current else None
        out.append(MigrationStatus(VIEWS_VERSION, views.name, current, at, True))
    return out


def status_rows(store: Store) -> list[dict[str, Any]]:
    """:func:`status` as rows: version, name, applied, applied_at (ISO-8601 UTC), checksum_ok."""
    return [
        {
            "version": s.version,
            "name": s.name,
            "applied": s.applied,
            "applied_at": None
            if s.applied_ns is None
            else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.applied_ns / 1e9)),
            "checksum_ok": s.checksum_ok,
        }
        for s in status(store)
    ]


def migrate(
    store: Store, migrations: list[Migration] | None = None, *, ttl_days: Mapping[str, int] | None = None
) -> list[Migration]:
    """Apply the pending migrations in order, then ``views.sql`` when it changed or a numbered
    migration was applied after it (only without an explicit list); return those applied (empty
    when up to date).

    ``ttl_days`` (``clickhouse.ttl_days``) then sets each table's retention (:func:`set_retention`).

    Raises:
        MigrationError: an applied migration's file changed since, or a statement failed.
    """
    views = load_views() if migrations is None else None
    migrations = migrations if migrations is not None else load_migrations()
    _bootstrap(store)
    applied = _applied(store)
    done = []
    for m in migrations:
        if m.version in applied:
            _, checksum, _ = applied[m.version]
            if not m.accepts(checksum):
                raise MigrationError(
                    f"migration {m.version:03d}_{m.name} was changed after it was applied to "
                    f"{store.database}; add a new migration instead of editing an applied one",
                    version=m.version,
                )
            continue
        _apply(store, m)
        done.append(m)
    if views is not None and (done or not _views_current(applied, views)):
        _apply(store, views)
        done.append(views)
    if ttl_days:
        set_retention(store, ttl_days)
    return done


def _apply(store: Store, m: Migration) -> None:
    for statement in render(m.template, database=store.database, cluster=store.cluster):
        try:
            store.command(statement)
        except Exception as exc:
            raise MigrationError(
                f"migration {m.version:03d}_{m.name} failed: {exc}",
                version=m.version,
                statement=statement[:200],
            ) from exc
    store.insert(
        f"{store.database}.schema_migrations",
        [[m.version], [m.name], [m.checksum], [time.time_ns()]],
        ["version", "name", "checksum", "applied_ns"],
    )


def retention_sql(database: str, table: str, days: int, cluster: str = "") -> str:
    """The statement that gives ``table`` a TTL of ``days`` on its time column (0: no TTL)."""
    on_cluster = f" ON CLUSTER '{cluster}'" if cluster else ""
    if days == 0:
        return f"ALTER TABLE {database}.{table}{on_cluster} REMOVE TTL"
    column = RETENTION[table]
    return (
        f"ALTER TABLE {database}.{table}{on_cluster} MODIFY TTL toDateTime({column}) + toIntervalDay({days})"
    )


def set_retention(store: Store, ttl_days: Mapping[str, int]) -> dict[str, int]:
    """Make each table's TTL ``ttl_days[table]`` days (0 = none); returns those changed.

    A table whose TTL already says so is left alone: MODIFY TTL rewrites the table's parts.
    """
    changed: dict[str, int] = {}
    for table, days in ttl_days.items():
        rows = store.query(
            "SELECT engine_full FROM system.tables WHERE database = {db:String} AND name = {t:String}",
            {"db": store.database, "t": table},
        )
        if not rows:
            continue
        engine = str(rows[0]["engine_full"])
        has_ttl = " TTL " in f" {engine} "
        if (days == 0 and not has_ttl) or (days and f"toIntervalDay({days})" in engine):
            continue
        store.command(retention_sql(store.database, table, days, store.cluster))
        changed[table] = days
    return changed


def ensure_migrated(store: Store) -> None:
    """Raise a clear error when the store's schema is missing or behind this code.

    Raises:
        MigrationError: pending migrations (run ``sparseety db migrate``).
    """
    pending = [s for s in status(store) if not s.applied]
    if pending:
        raise MigrationError(
            f"database {store.database} is missing migrations "
            f"{', '.join(f'{s.version:03d}_{s.name}' for s in pending)}: run `sparseety db migrate`",
            database=store.database,
        )
