"""The query library over HTTP, for when another process owns the store.

:class:`RemoteQueries` has the methods of :class:`~sparseety.api.queries.ApiQueries` (the query
library plus listings and health) and returns the same values (Decimal money, UTC datetimes), so
the CLI's ``sparseety query ...`` and the dashboard work unchanged against the store process's API.
:func:`open_queries` picks: the store itself when this process can open it, else the API of the
process that owns it — found in ``<data_dir>/api/endpoint.json`` and reached with the admin token
``<data_dir>/api/admin-token`` that process wrote (both documented in ``docs/api.md``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from sparseety.api.auth import api_dir, read_admin_token
from sparseety.api.encode import decode_rows, decode_value
from sparseety.api.endpoints import Endpoint, endpoint
from sparseety.api.params import MAX_DASHBOARD_REQUESTS
from sparseety.api.queries import EVERYTHING
from sparseety.api.server import client_url, read_endpoint
from sparseety.config import Config
from sparseety.errors import AmbiguousIdError, SparseetyError, StoreLockedError
from sparseety.lifecycle import pid_alive
from sparseety.queries.export import check_format, rows_file
from sparseety.queries.registry import (
    REQUEST,
    Param,
    QueryError,
    QueryMethods,
    QuerySpec,
    Rows,
    Scope,
)


class RemoteApiError(SparseetyError):
    """The API did not answer, refused the caller, or failed."""


def _scope_params(scope: Scope) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if scope.since_ns is not None:
        out["since_ns"] = scope.since_ns
    if scope.until_ns is not None:
        out["until_ns"] = scope.until_ns
    if scope.tenants is not None:
        out["tenant"] = list(scope.tenants)
    return out


def _sees_nothing(scope: Scope) -> bool:
    """An empty tenant list sees nothing (the API would read no tenant parameter as "all")."""
    return scope.tenants is not None and not scope.tenants


class RemoteQueries(QueryMethods):
    """Query methods served by a SparSEEty API.

    Args:
        base_url: ``http://host:port`` of the API.
        token: Bearer token (None when the API is open).
        client: An httpx client to use (tests pass the app's TestClient).
        timeout_s: Per-request timeout.
        data_dir: The data dir whose admin token is used (named in errors).
        why: Why the API is used rather than the store (said when the API does not answer).
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        client: httpx.Client | None = None,
        timeout_s: float = 60.0,
        data_dir: str | None = None,
        why: str = "",
    ) -> None:
        self.data_dir = data_dir
        self.why = why
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._own = client is None
        self.client = (
            client if client is not None else httpx.Client(base_url=self.base_url, timeout=timeout_s)
        )
        self.headers = headers

    @classmethod
    def from_config(cls, cfg: Config, *, why: str = "") -> RemoteQueries:
        """The API of the process that serves this data dir (endpoint record, else ``api.*``)."""
        found = read_endpoint(cfg.data_path)
        pid = found.get("pid") if found else None
        if found and isinstance(pid, int) and pid_alive(pid):
            url = str(found["url"])
        else:
            url = client_url(cfg.api.host, cfg.api.port)
        return cls(url, read_admin_token(cfg.data_path), data_dir=str(cfg.data_path), why=why)

    def close(self) -> None:
        if self._own:
            self.client.close()

    def __enter__(self) -> RemoteQueries:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get(self, path: str, params: dict[str, Any], *, missing_ok: bool = False, raw: bool = False) -> Any:
        return self._call("GET", path, params=params, missing_ok=missing_ok, raw=raw)

    def _call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        json_body: Any = None,
        missing_ok: bool = False,
        raw: bool = False,
    ) -> Any:
        try:
            r = self.client.request(method, path, params=params, json=json_body, headers=self.headers)
        except httpx.HTTPError as exc:
            raise RemoteApiError(
                (f"{self.why}; " if self.why else "")
                + f"the SparSEEty API at {self.base_url} does not answer ({type(exc).__name__}: {exc}): "
                f"only `sparseety store` and `sparseety api` serve queries from the store they own",
                url=self.base_url,
            ) from None
        if r.status_code == 404 and missing_ok:
            return None
        if raw and r.status_code == 200:
            return r.content
        try:
            body = r.json()
        except ValueError:
            body = {}
        message = body.get("message", r.text[:200]) if isinstance(body, dict) else r.text[:200]
        if r.status_code == 400:
            raise QueryError(message)
        if r.status_code == 409 and isinstance(body, dict) and "candidates" in body:
            raise AmbiguousIdError(message, candidates=list(body["candidates"]))
        if r.status_code in (401, 403):
            raise RemoteApiError(
                f"the SparSEEty API at {self.base_url} refused the request ({r.status_code}: {message})"
                + (
                    f"; the CLI uses the admin token in {api_dir(Path(self.data_dir))}"
                    if self.data_dir
                    else ""
                ),
                status=r.status_code,
            )
        if r.status_code >= 400:
            raise RemoteApiError(f"the SparSEEty API at {self.base_url} answered {r.status_code}: {message}")
        return body

    # --- the store's administration, through the process that owns it (admin token) -------------

    def prices_list(self, model: str | None = None) -> list[dict[str, Any]]:
        """Like :func:`~sparseety.sinks.clickhouse.prices.list_prices` (``GET /api/v1/prices``)."""
        body = self._get("/api/v1/prices", {} if model is None else {"model": model})
        return decode_rows(body["rows"])

    def prices_set(self, prices: Sequence[Any]) -> int:
        """Like :func:`~sparseety.sinks.clickhouse.prices.set_prices` (``POST /api/v1/prices``)."""
        entries = [
            {
                "model": p.model,
                "token_class": p.token_class,
                "usd": str(p.usd),
                "effective_from_ns": p.effective_from_ns,
                "note": p.note,
                "qualifier": p.qualifier,
            }
            for p in prices
        ]
        return int(self._call("POST", "/api/v1/prices", json_body={"prices": entries})["set"])

    def prices_unseen(self, models: Sequence[str]) -> list[str]:
        """Like :func:`~sparseety.sinks.clickhouse.prices.unseen_models`
        (``GET /api/v1/prices/unseen``)."""
        return list(self._get("/api/v1/prices/unseen", {"model": list(models)})["models"])

    def prices_delete(
        self,
        model: str,
        token_class: str | None = None,
        effective_from_ns: int | None = None,
        qualifier: str | None = None,
    ) -> int:
        """Like :func:`~sparseety.sinks.clickhouse.prices.delete_prices` (``DELETE /api/v1/prices``)."""
        params: dict[str, Any] = {"model": model}
        if token_class is not None:
            params["token_class"] = token_class
        if effective_from_ns is not None:
            params["effective_from_ns"] = effective_from_ns
        if qualifier is not None:
            params["qualifier"] = qualifier
        return int(self._call("DELETE", "/api/v1/prices", params=params)["deleted"])

    def db_status(self) -> list[dict[str, Any]]:
        """The migrations and whether each is applied (``GET /api/v1/db/status``)."""
        return list(self._get("/api/v1/db/status", {})["rows"])

    def sql(self, sql: str) -> tuple[list[str], list[list[Any]]]:
        """One read-only query of your own (``POST /api/v1/sql``): column names and rows."""
        body = self._call("POST", "/api/v1/sql", json_body={"sql": sql})
        return list(body["columns"]), [list(r) for r in body["rows"]]

    def _rows(self, path: str, params: dict[str, Any], scope: Scope) -> list[dict[str, Any]]:
        if _sees_nothing(scope):
            return []
        body = self._get(path, {**params, **_scope_params(scope)})
        return decode_rows(body["rows"])

    # --- the query library's methods (QueryMethods) run through these ---------------------------

    def ask(
        self,
        spec: QuerySpec,
        *,
        by: Sequence[str] | None = None,
        bucket: str | None = None,
        scope: Scope = EVERYTHING,
        **arguments: Any,
    ) -> Rows:
        """Like :meth:`Queries.ask`: one registry query, through its route."""
        params = _wire_params(spec, spec.params, arguments)
        if spec.group_by is not None:
            params["group_by"] = ",".join((spec.group_by,) if by is None else by)
        if spec.bucket and bucket is not None:
            params["bucket"] = bucket
        return self._rows(f"/api/v1/{endpoint(spec).route}", params, scope)

    def export(
        self,
        spec: QuerySpec,
        fmt: str,
        *,
        key: str | None = None,
        by: Sequence[str] | None = None,
        bucket: str | None = None,
        scope: Scope = EVERYTHING,
        **arguments: Any,
    ) -> bytes | None:
        """Like :meth:`Queries.export`: the file the route streams (``?format=``)."""
        check_format(fmt)
        arguments.pop("allowed", None)  # the server decides from the caller's token
        if _sees_nothing(scope):
            return None if spec.key is not None else rows_file([], fmt)
        params = {**_wire_params(spec, spec.params, arguments), "format": fmt}
        path = endpoint(spec).api_path
        if spec.key is not None:
            if key is None:
                raise QueryError(f"{spec.name} needs its {spec.key}")
            path = self._key_path(endpoint(spec), key, params)
        else:
            if spec.group_by is not None:
                params["group_by"] = ",".join((spec.group_by,) if by is None else by)
            if spec.bucket and bucket is not None:
                params["bucket"] = bucket
        return self._get(path, {**params, **_scope_params(scope)}, missing_ok=True, raw=True)  # type: ignore[no-any-return]

    @staticmethod
    def _key_path(spec: Endpoint, key: str, params: dict[str, Any]) -> str:
        """A lookup's path with its id in it (or the id added to ``params``)."""
        name = spec.query.key
        assert name is not None
        if spec.key_in_path:
            return re.sub(r"\{" + name + r"(:[a-z]+)?\}", quote(key, safe=""), spec.api_path)
        params[name] = key
        return spec.api_path

    def fetch(self, spec: QuerySpec, key: str, *, scope: Scope = EVERYTHING, **arguments: Any) -> Any:
        """Like :meth:`Queries.fetch`: one lookup through its route (None when unknown or not
        visible)."""
        assert spec.key is not None
        if _sees_nothing(scope):
            return None
        arguments.pop("allowed", None)  # the server decides from the caller's token
        params = _wire_params(spec, spec.params, arguments)
        path = self._key_path(endpoint(spec), key, params)
        body = self._get(path, {**params, **_scope_params(scope)}, missing_ok=True)
        if body is None:
            return None
        return _decode_lookup(endpoint(spec), body)

    def requests_by_uid(
        self, request_uids: Sequence[str], *, scope: Scope = EVERYTHING
    ) -> dict[str, dict[str, Any]]:
        """Like :meth:`Queries.requests_by_uid`: one API call per
        :data:`~sparseety.api.params.MAX_DASHBOARD_REQUESTS` uids."""
        uids = list(dict.fromkeys(request_uids))
        if _sees_nothing(scope):
            return {}
        spec = endpoint(REQUEST)
        out = {}
        for i in range(0, len(uids), MAX_DASHBOARD_REQUESTS):
            chunk = uids[i : i + MAX_DASHBOARD_REQUESTS]
            body = self._get("/api/v1/requests/batch", {"request_id": chunk, **_scope_params(scope)})
            for raw in body["rows"]:
                r = _decode_lookup(spec, raw)
                out[r["request_uid"]] = r
        return {u: out[u] for u in uids if u in out}

    # --- ApiQueries' additions ---------------------------------------------------------------

    def health(self, *, scope: Scope = EVERYTHING, now_ns: int | None = None) -> dict[str, Any]:
        """Like :meth:`ApiQueries.health` (measured on the server's clock)."""
        if _sees_nothing(scope):
            return {
                "requests": 0,
                "incomplete_requests": 0,
                "inconsistent_requests": 0,
                "seq_gap_requests": 0,
                "earliest_finished_ts_ns": 0,
                "latest_finished_ts_ns": 0,
                "freshness_s": None,
            }
        body = self._get("/api/v1/health", _scope_params(scope))
        return dict(body["store"])

    def pipeline(self) -> dict[str, Any]:
        """The serving process's pipeline counters (needs an all-tenant token)."""
        body = self._get("/api/v1/health", {})
        return dict(body.get("pipeline") or {})

    def dead_letters(self, *, limit: int = 100, component: str | None = None) -> list[dict[str, Any]]:
        """Like :meth:`ApiQueries.dead_letters` (``GET /api/v1/dead-letters``, admin only)."""
        params: dict[str, Any] = {"limit": limit, **({"component": component} if component else {})}
        return decode_rows(self._get("/api/v1/dead-letters", params)["rows"])


def _wire_params(spec: QuerySpec, declared: Sequence[Param], arguments: dict[str, Any]) -> dict[str, Any]:
    """The query string of ``arguments`` (each declared param by its wire name, defaults filled,
    None left out); an argument the spec does not declare is a TypeError, as in the library."""
    params: dict[str, Any] = {}
    for p in declared:
        value = arguments.pop(p.name, p.default)
        if value is not None:
            params[p.wire] = value
    if arguments:
        raise TypeError(f"{spec.name}() got unexpected arguments {sorted(arguments)}")
    return params


def _decode_lookup(spec: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
    """A lookup's answer as the API serves it, typed as the library returns it."""
    out: dict[str, Any] = {}
    for k, v in body.items():
        if spec.echo_key and k == spec.query.key:
            continue
        if k in spec.money_objects:
            out[k] = {m: (x if isinstance(x, bool) else decode_value(f"{m}_usd", x)) for m, x in v.items()}
        else:
            out[k] = decode_value(k, v)
    return out


def _owner_text(exc: StoreLockedError) -> str:
    who = f"process {exc.owner_pid} ({exc.owner_command})" if exc.owner_pid else "another process"
    return f"the embedded store at {exc.path} is open in {who}"


@contextlib.contextmanager
def open_queries(cfg: Config, owner: str) -> Iterator[Any]:
    """Queries over the store: opened here when possible, else through the owner's API.

    Yields:
        An :class:`ApiQueries` (store opened here, migrations checked) or a
        :class:`RemoteQueries` (the store is open in another process).
    """
    from sparseety.api.queries import ApiQueries
    from sparseety.sinks.clickhouse.client import Store, require_store
    from sparseety.sinks.clickhouse.migrate import ensure_migrated

    why = ""
    require_store(cfg)  # before opening: opening an embedded path creates it
    try:
        store = Store.open(cfg, owner=owner)
    except StoreLockedError as exc:
        store, why = None, _owner_text(exc)
    if store is None:
        remote = RemoteQueries.from_config(cfg, why=why)
        try:
            yield remote
        finally:
            remote.close()
        return
    try:
        ensure_migrated(store)
        yield ApiQueries(store, tokenizers=cfg.api.tokenizers)
    finally:
        store.close()
