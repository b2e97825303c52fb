"""Versioned schema migrations: ``migrations/NNN_name.sql``, applied in order, recorded in
``schema_migrations``; then the repeatable ``migrations/views.sql``, the current definition of
every view, applied again whenever it changed (recorded as version 0 with its checksum).

Tables change through numbered migrations, which never change once applied; views change in
``views.sql`` only, so a view's definition lives in one place. The numbered files keep the
views' history as it was applied (their checksums guard existing stores).

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


def _bootstrap(store: Store) -> None:
    db, cl = store.database, on_cluster(store.cluster)
    store.command(f"CREATE DATABASE IF NOT EXISTS {db}{cl}")
    for statement in render(SCHEMA_MIGRATIONS, database=db, cluster=store.cluster):
        store.command(statement)


def status(store: Store, migrations: list[Migration] | None = None) -> list[MigrationStatus]:
    """Every known migration with its state in ``store`` (nothing is created); without an
    explicit list, the views migration last (applied: its current text is)."""
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
            m.version not in applied or applied[m.version][1] == m.checksum,
        )
        for m in migrations
    ]
    if views is not None:
        current = applied.get(VIEWS_VERSION, ("", "", 0))[1] == views.checksum
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
    """Apply the pending migrations in order, then ``views.sql`` when it changed (only without
    an explicit list); return those applied (empty when up to date).

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
            if checksum != m.checksum:
                raise MigrationError(
                    f"migration {m.version:03d}_{m.name} was changed after it was applied to "
                    f"{store.database}; add a new migration instead of editing an applied one",
                    version=m.version,
                )
            continue
        _apply(store, m)
        done.append(m)
    if views is not None and applied.get(VIEWS_VERSION, ("", "", 0))[1] != views.checksum:
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
