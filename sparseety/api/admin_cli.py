"""The store's administration and your own SQL: ``db``, ``prices`` and ``sql``.

Each opens the store here when no process holds it, and otherwise goes through the HTTP API of the
process that does (``sparseety store`` / ``up``), with the data dir's admin token: prices can be
set, the schema checked and SQL run while the stack serves (docs/clickhouse.md). ``db migrate``
alone needs the store itself (the store process migrates when it starts).

Mounted on ``sparseety`` by ``sparseety/cli.py``; heavy imports happen inside the commands.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import click

from sparseety.cli_context import CliContext, pass_ctx
from sparseety.config import Config
from sparseety.errors import StoreLockedError
from sparseety.sinks.cli import FORMAT, echo_rows
from sparseety.sinks.clickhouse.prices import PRICE_CLASSES  # the CLI's choices: one list for set and delete


@contextlib.contextmanager
def _store_or_api(cfg: Config, owner: str) -> Iterator[tuple[Any, Any]]:
    """``(store, None)`` opened here (migrations checked), else ``(None, remote)``: the API of the
    process that holds the store."""
    from sparseety.api.client import RemoteQueries, _owner_text
    from sparseety.sinks.clickhouse.client import Store, require_store
    from sparseety.sinks.clickhouse.migrate import ensure_migrated

    require_store(cfg)  # before opening: opening an embedded path creates it
    try:
        store = Store.open(cfg, owner=owner)
    except StoreLockedError as exc:
        remote = RemoteQueries.from_config(cfg, why=_owner_text(exc))
        try:
            yield None, remote
        finally:
            remote.close()
        return
    try:
        ensure_migrated(store)
        yield store, None
    finally:
        store.close()


# --- db ----------------------------------------------------------------------------------------


@click.group("db")
def db() -> None:
    """The store's schema (versioned migrations)."""


@db.command("migrate")
@pass_ctx
def db_migrate(c: CliContext) -> None:
    """Apply pending migrations (idempotent; ON CLUSTER when clickhouse.cluster is set).

    Needs the store itself: a running store process has migrated it when it started.
    """
    from sparseety.sinks.clickhouse.client import Store
    from sparseety.sinks.clickhouse.migrate import migrate

    store = Store.open(c.cfg, owner="sparseety db migrate")
    try:
        applied = migrate(store, ttl_days=c.cfg.clickhouse.ttl_days)
        where = f"{store!r}" + (f" on cluster {store.cluster}" if store.cluster else "")
        if applied:
            for m in applied:
                click.echo(f"applied {m.version:03d}_{m.name} to {where}")
        else:
            click.echo(f"{where} is up to date")
    finally:
        store.close()


@db.command("status")
@FORMAT
@pass_ctx
def db_status(c: CliContext, fmt: str) -> None:
    """List migrations and whether each is applied; exit 1 when some are pending.

    While a store process runs, through its API.
    """
    from sparseety.sinks.clickhouse.client import Store
    from sparseety.sinks.clickhouse.migrate import status_rows

    try:
        store = Store.open(c.cfg, owner="sparseety db status")
    except StoreLockedError as exc:
        from sparseety.api.client import RemoteQueries, _owner_text

        with RemoteQueries.from_config(c.cfg, why=_owner_text(exc)) as remote:
            rows = remote.db_status()
    else:
        try:
            rows = status_rows(store)  # no migration check: this is how one sees what is pending
        finally:
            store.close()
    echo_rows(rows, fmt)
    if not all(r["applied"] and r["checksum_ok"] for r in rows):
        raise SystemExit(1)


# --- prices ------------------------------------------------------------------------------------


@click.group("prices")
def prices() -> None:
    """Prices per model and class (USD per 1M tokens, or per GPU-hour), with effective dates
    (docs/cost-model.md, the file format); while the stack runs, through the store's API."""


@prices.command("set")
@click.option("--model", required=True)
@click.option("--class", "token_class", required=True, type=click.Choice(PRICE_CLASSES))
@click.option(
    "--usd",
    required=True,
    help="USD per 1M tokens (per GPU-hour for gpu_hour, per GiB-hour for kv) as a plain decimal, "
    "e.g. 0.15; at most six decimals and 1000000.",
)
@click.option("--effective-from", default="", help="ISO-8601 time (default: always).")
@click.option("--note", default="")
@click.option(
    "--qualifier",
    default="",
    help="For service_tier_multiplier the service tier (e.g. flex), for cache_write_ttl_multiplier "
    "the cache TTL (e.g. 1h); --usd is then the factor (docs/cost-model.md).",
)
@pass_ctx
def prices_set(
    c: CliContext, model: str, token_class: str, usd: str, effective_from: str, note: str, qualifier: str
) -> None:
    """Set one price."""
    from sparseety.sinks.clickhouse.prices import checked_price, set_prices, unseen_models

    price = checked_price(
        model, token_class, usd, effective_from, note, qualifier=qualifier, where="--usd/--effective-from"
    )
    with _store_or_api(c.cfg, "sparseety prices") as (store, remote):
        if store is not None:
            set_prices(store, [price])
            unseen = unseen_models(store, [model])
        else:
            remote.prices_set([price])
            unseen = remote.prices_unseen([model])
    what = f"x{price.usd:f} for {qualifier}" if qualifier else f"${price.usd:f}"
    click.echo(f"{model} {token_class}: {what} from {effective_from or 'always'}")
    _warn_unseen(unseen)


@prices.command("load")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@pass_ctx
def prices_load(c: CliContext, path: str) -> None:
    """Set prices from a TOML or CSV file (docs/cost-model.md, "Price files")."""
    from sparseety.sinks.clickhouse.prices import load_prices_file, set_prices, unseen_models

    entries = load_prices_file(path)
    models = [p.model for p in entries]
    with _store_or_api(c.cfg, "sparseety prices") as (store, remote):
        if store is not None:
            n, unseen = set_prices(store, entries), unseen_models(store, models)
        else:
            n, unseen = remote.prices_set(entries), remote.prices_unseen(models)
    click.echo(f"{n} prices set from {path}")
    _warn_unseen(unseen)


@prices.command("delete")
@click.option("--model", required=True)
@click.option(
    "--class", "token_class", default=None, type=click.Choice(PRICE_CLASSES), help="Only this class."
)
@click.option("--effective-from", default=None, help="Only the price from this ISO-8601 time ('' = always).")
@click.option("--qualifier", default=None, help="Only the multiplier of this service tier or cache TTL.")
@pass_ctx
def prices_delete(
    c: CliContext, model: str, token_class: str | None, effective_from: str | None, qualifier: str | None
) -> None:
    """Delete the stored prices of a model (of one class, of one effective time); exits 1 when
    none matched."""
    from sparseety.sinks.clickhouse.prices import delete_prices, parse_time

    eff = None if effective_from is None else parse_time(effective_from, where="--effective-from")
    with _store_or_api(c.cfg, "sparseety prices") as (store, remote):
        if store is not None:
            n = delete_prices(store, model, token_class, eff, qualifier)
        else:
            n = remote.prices_delete(model, token_class, eff, qualifier)
    click.echo(f"{n} prices deleted")
    if not n:
        raise SystemExit(1)


def _warn_unseen(models: list[str]) -> None:
    for model in models:
        click.echo(
            f"warning: no stored request has model {model!r} (a typo?): its prices apply from the "
            f"first one that does; `sparseety prices delete --model {model}` removes them",
            err=True,
        )


@prices.command("list")
@click.option("--model", default=None)
@FORMAT
@pass_ctx
def prices_list(c: CliContext, model: str | None, fmt: str) -> None:
    """List stored prices."""
    from sparseety.sinks.clickhouse.prices import list_prices

    with _store_or_api(c.cfg, "sparseety prices") as (store, remote):
        rows = list_prices(store, model) if store is not None else remote.prices_list(model)
    echo_rows(rows, fmt)


# --- your own SQL ------------------------------------------------------------------------------


@click.command("sql")
@click.argument("query")
@click.option(
    "--token",
    envvar="SPARSEETY_API_TOKEN",
    default=None,
    help="Run it through the store's API as this token (a tenant's token reads its tenants' rows "
    "only). Default: the store here, else its API with the data dir's admin token.",
)
@FORMAT
@pass_ctx
def sql_cmd(c: CliContext, query: str, token: str | None, fmt: str) -> None:
    """Run one read-only SELECT of your own on the store (docs/clickhouse.md, "Your own SQL");
    name tables with the database (``sparseety.requests_v``)."""
    from sparseety.api.client import RemoteQueries
    from sparseety.queries.sql import run_sql

    rows: Sequence[Sequence[Any]]  # the API's lists or the store's tuples
    if token is not None:
        remote = RemoteQueries.from_config(c.cfg)
        remote.headers = {"Authorization": f"Bearer {token}"}
        with remote:
            columns, rows = remote.sql(query)
    else:
        with _store_or_api(c.cfg, "sparseety sql") as (store, api):
            if store is not None:
                # the store opened here: an admin's query on a read-only client, admin limits
                with store.readers(1) as readers:
                    limits = c.cfg.api.limits.admin.sql_settings()
                    columns, rows = run_sql(readers.store(), query, limits=limits)
            else:
                columns, rows = api.sql(query)
    echo_rows([dict(zip(columns, r, strict=True)) for r in rows], fmt)


COMMANDS = [db, prices, sql_cmd]
