"""The query registry is the one place a query is declared: every entry is a library method, an
API route, a `sparseety query` command and a remote-client method, with the same parameters.

The query (SQL, params) is declared in sparseety/queries/registry.py, how it is served in
sparseety/api/endpoints.py; the methods are written out in ``QueryMethods``, none attached at
import time."""

from __future__ import annotations

from fastapi import FastAPI

from sparseety.api.app import _router
from sparseety.api.cli import query
from sparseety.api.client import RemoteQueries
from sparseety.api.endpoints import ENDPOINTS, endpoint, lookups, routes
from sparseety.queries.registry import QUERIES, Queries, QueryMethods


def test_every_query_has_one_endpoint_and_a_written_out_method() -> None:
    assert sorted(e.name for e in ENDPOINTS) == sorted(q.name for q in QUERIES)
    for spec in QUERIES:
        assert endpoint(spec).query is spec, spec.name
        # defined in the class body (so a reader and mypy find it), not attached later
        assert spec.name in vars(QueryMethods), spec.name
        assert spec.name not in vars(Queries) and spec.name not in vars(RemoteQueries), spec.name
        # a gated lookup is served with the permission that decides its ``allowed``
        assert spec.gated == bool(endpoint(spec).permission), spec.name


def test_every_registry_entry_is_a_method_a_route_a_command_and_a_remote_method() -> None:
    api_paths = {getattr(r, "path", "") for r in _router().routes}
    for ep in ENDPOINTS:
        spec = ep.query
        assert callable(getattr(Queries, spec.name, None)), spec.name
        assert callable(getattr(RemoteQueries, spec.name, None)), spec.name
        assert ep.api_path in api_paths, ep.route
        command = query.commands.get(ep.cli_name)
        assert command is not None, ep.cli_name
        options = {p.name for p in command.params}
        assert {p.name for p in ep.params} <= options, spec.name
        if spec.key is not None:
            assert spec.key in options or spec.key.upper() in {p.human_readable_name for p in command.params}
        if spec.group_by is not None and ep.selected_by is None:
            assert {"by"} <= options
        if spec.bucket:
            assert {"bucket"} <= options


def test_routes_serve_their_variants_after_the_plain_query() -> None:
    for route, specs in routes().items():
        assert specs[0].selected_by is None, route
        assert all(s.selected_by in {p.name for p in s.params} for s in specs[1:]), route


def _openapi_parameters() -> dict[str, dict[str, dict[str, object]]]:
    """Path -> parameter name -> its OpenAPI entry, as the app publishes them."""
    app = FastAPI()
    app.include_router(_router())
    return {
        path: {p["name"]: p for p in ops["get"].get("parameters", [])}
        for path, ops in app.openapi()["paths"].items()
        if "get" in ops
    }


def test_api_route_parameters_come_from_the_declaration() -> None:
    published = _openapi_parameters()
    for route, specs in routes().items():
        names = published[f"/api/v1/{route}"]
        assert {p.wire for s in specs for p in s.params} <= set(names), route
        assert ("group_by" in names) == (specs[0].query.group_by is not None), route
        assert ("bucket" in names) == specs[0].query.bucket, route
        assert {"since", "until", "tenant", "format"} <= set(names), route
        for p in (p for s in specs for p in s.params):
            entry = names[p.wire]
            assert entry["in"] == "query" and entry["description"] == p.doc, (route, p.wire)
            schema: dict[str, object] = entry["schema"]  # type: ignore[assignment]
            bounds = {k: v for k, v in schema.items() if k in ("minimum", "maximum")}
            for s in schema.get("anyOf", []):  # type: ignore[attr-defined]
                bounds.update({k: v for k, v in s.items() if k in ("minimum", "maximum")})
            expected = {k: v for k, v in (("minimum", p.ge), ("maximum", p.le)) if v is not None}
            assert bounds == expected, (route, p.wire)


def test_lookup_routes_take_their_id_and_come_before_the_catch_all_paths() -> None:
    published = _openapi_parameters()
    order = [getattr(r, "path", "") for r in _router().routes]
    for spec in lookups():
        where = "path" if spec.key_in_path else "query"
        names = published[spec.api_path.replace(":path}", "}")]
        assert names[spec.query.key]["in"] == where and names[spec.query.key]["required"], spec.name
        assert {p.wire for p in spec.query.params} <= set(names), spec.name
        if spec.api_path.endswith(":path}"):
            prefix = spec.api_path.split("{")[0]
            longer = [p for p in order if p.startswith(prefix) and p != spec.api_path and "{" in p]
            assert all(order.index(p) < order.index(spec.api_path) for p in longer), spec.api_path
