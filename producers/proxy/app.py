"""OpenAI-compatible proxy producer: request-level events for engines without hooks.

Every request is forwarded to the upstream unchanged (method, path, query, headers, body) and
every response comes back unchanged, streamed as it arrives. For ``POST /v1/chat/completions``
and ``/v1/completions`` the proxy also records a RequestStarted + RequestFinished pair
(``engine_kind = proxy``) once the response is complete: prompt, completion and cached tokens
from ``usage`` (``prompt_tokens_details.cached_tokens`` where the engine reports it), the finish
reason, and for streams the wall clock of each chunk. Two exceptions to "unchanged", both on
accounted endpoints: the proxy asks for ``identity`` encoding so it can read the stream, and a
streaming request without ``stream_options.include_usage`` gets it added, with the resulting
usage-only chunk withheld from the client (every other chunk passes byte for byte).

Tenancy (:func:`~sparseety.producers.proxy.accounting.tenant_of`): with API keys configured the
key's tenant is the tenant and a request without a known key is refused (401); the tenant header
and ``vllm_xargs.tenant`` count only with ``proxy.trust_tenant_header`` (a gateway sets them).
An upstream answer whose usage cannot be accounted still reaches the client unchanged; its
accounting goes to the dlq topic. Errors of the proxy itself (401, 502 upstream unreachable, 504
upstream timed out after ``proxy.read_timeout_s``) are OpenAI-style JSON errors.

The proxy's own Prometheus metrics are at ``/sparseety/metrics`` (``/metrics`` goes upstream).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sparseety import __version__
from sparseety import events as ev
from sparseety.config import Config
from sparseety.tenants import shown, tenant_problem

from ..emitter import Emitter, new_epoch
from .accounting import (
    ACCOUNTED_PATHS,
    Exchange,
    UnaccountableResponseError,
    event_data,
    session_of,
    split_events,
    tenant_of,
)

log = logging.getLogger("sparseety.producer.proxy")
COMPONENT = "proxy"


def error_response(status: int, message: str, type_: str, code: str) -> JSONResponse:
    """An OpenAI-style error body, so OpenAI clients report the proxy's own errors properly."""
    return JSONResponse({"error": {"message": message, "type": type_, "code": code}}, status_code=status)


def _upstream_error(exc: httpx.HTTPError) -> JSONResponse:
    if isinstance(exc, httpx.TimeoutException):
        return error_response(504, f"upstream timed out: {exc!r}", "upstream_error", "upstream_timeout")
    return error_response(502, f"upstream unreachable: {exc!r}", "upstream_error", "upstream_unreachable")


_UNAUTHORIZED = ("missing or unknown API key", "invalid_request_error", "invalid_api_key")

#: Hop-by-hop headers (RFC 9110 §7.6.1) and those httpx/uvicorn recompute.
_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}


def _forward_headers(headers: Mapping[str, str], *, identity: bool) -> dict[str, str]:
    out = {k: v for k, v in headers.items() if k.lower() not in _HOP}
    if identity:
        out = {k: v for k, v in out.items() if k.lower() != "accept-encoding"}
        out["accept-encoding"] = "identity"
    return out


def _response_headers(headers: httpx.Headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP}


class ProxyProducer:
    """The proxy's state: upstream client, emitter, tenant rules.

    Args:
        cfg: Configuration (kafka, topics, producer sections).
        upstream: Base URL of the OpenAI-compatible server (``http://host:port``).
        api_keys: API key -> tenant.
        tenant_header: Header naming the tenant (set by a gateway).
        engine_name: Stable name of this proxy (the Kafka key).
        trust_tenant_header: Believe the tenant header and ``vllm_xargs.tenant`` (default
            ``cfg.proxy.trust_tenant_header``).
        read_timeout_s: Upstream read timeout (default ``cfg.proxy.read_timeout_s``).
    """

    def __init__(
        self,
        cfg: Config,
        upstream: str,
        *,
        api_keys: Mapping[str, str] | None = None,
        tenant_header: str = "X-Sparseety-Tenant",
        engine_name: str,
        trust_tenant_header: bool | None = None,
        read_timeout_s: float | None = None,
    ) -> None:
        self.cfg = cfg
        self.trust_tenant_header = (
            cfg.proxy.trust_tenant_header if trust_tenant_header is None else trust_tenant_header
        )
        self.read_timeout_s = cfg.proxy.read_timeout_s if read_timeout_s is None else read_timeout_s
        self._dlq: Any = None
        self.upstream = upstream.rstrip("/")
        self.api_keys = dict(api_keys or {})
        self.tenant_header = tenant_header.lower()
        self.engine_name = engine_name
        self.emitter: Emitter | None = None
        self.client: httpx.AsyncClient | None = None
        self._n = itertools.count()
        self._recent: OrderedDict[str, None] = OrderedDict()

    async def start(self) -> None:
        self.client = httpx.AsyncClient(
            base_url=self.upstream, timeout=httpx.Timeout(None, connect=10.0, read=self.read_timeout_s)
        )
        self.emitter = Emitter(self.cfg, engine_name=self.engine_name, epoch=new_epoch())
        served = await self._served_model()
        self.emitter.announce(
            ev.ENGINE_STARTED,
            ev.with_defaults(  # an HTTP proxy knows no engine shape: the schema's defaults stand
                ev.ENGINE_STARTED,
                {
                    "model": self.upstream,
                    "served_model_name": served,
                    "engine_kind": "proxy",
                    "sparseety_version": __version__,
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "kv_cache_dtype": "",
                    "privacy_mode": "none",
                },
            ),
        )
        log.info("sparseety proxy: forwarding to %s as engine %s", self.upstream, self.emitter.engine_id)

    async def stop(self) -> None:
        if self.emitter is not None:
            self.emitter.emit_record(ev.ENGINE_STOPPED, {"reason": "shutdown"})
            self.emitter.close()
        if self.client is not None:
            await self.client.aclose()
        if self._dlq is not None:
            self._dlq.flush(10)

    async def _served_model(self) -> str:
        assert self.client is not None
        try:
            r = await self.client.get("/v1/models", timeout=5.0)
            data = r.json().get("data") or []
            return str(data[0].get("id", "")) if data else ""
        except Exception:
            return ""

    def _request_id(self, response_id: str) -> str:
        rid = response_id or f"proxy-{next(self._n)}"
        if rid in self._recent:  # clients may reuse X-Request-Id; ids must be unique per epoch
            rid = f"{rid}#{next(self._n)}"
        self._recent[rid] = None
        if len(self._recent) > 100_000:
            self._recent.popitem(last=False)
        return rid

    def record(self, exchange: Exchange, finish_reason: str | None = None) -> None:
        """Emit the exchange's events, or dead-letter its accounting when it has none."""
        assert self.emitter is not None
        rid = self._request_id(exchange.response_id)
        try:
            payloads = exchange.payloads(rid, finish_reason)
        except UnaccountableResponseError as exc:
            self.dead_letter(exc, exchange, rid)
            return
        for payload_type, payload in payloads:
            self.emitter.emit_record(payload_type, payload)

    def dead_letter(self, exc: UnaccountableResponseError, exchange: Exchange, rid: str) -> None:
        """The accounting facts of ``exchange`` (never the prompt or the answer) to the dlq topic."""
        from sparseety.kafka import make_encoder, make_producer

        log.warning("sparseety proxy: request %s not accounted: %s", rid, exc)
        facts = {
            "request_id": rid,
            "status": exchange.status,
            "tenant": exchange.tenant,
            "usage": exchange.usage,
        }
        try:
            if self._dlq is None:
                self._dlq = make_producer(self.cfg)
                self._dlq_encoder = make_encoder(self.cfg, "DeadLetter", self.cfg.topics.dlq)
            record = ev.dead_letter(
                type(exc).__name__,
                str(exc),
                COMPONENT,
                topic=self.upstream,
                partition=-1,
                offset=-1,
                key=self.engine_name.encode(),
                value=json.dumps(facts, default=str).encode(),
            )
            self._dlq.produce(
                self.cfg.topics.dlq, key=self.engine_name.encode(), value=self._dlq_encoder.encode(record)
            )
            self._dlq.poll(0)
        except Exception:  # the client's answer matters more than its dead letter
            log.exception("sparseety proxy: cannot dead-letter request %s", rid)

    # --- forwarding ------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        assert self.client is not None
        path = request.url.path
        body = await request.body()
        headers = {k.lower(): v for k, v in request.headers.items()}
        accounted = request.method == "POST" and path in ACCOUNTED_PATHS
        parsed: Any = None
        if accounted:
            try:
                parsed = json.loads(body) if body else {}
            except (ValueError, RecursionError):
                parsed = None
        tenant = tenant_of(
            headers,
            parsed if isinstance(parsed, dict) else {},
            self.api_keys,
            self.tenant_header,
            trust_header=self.trust_tenant_header,
        )
        if tenant is None:
            return error_response(401, *_UNAUTHORIZED)
        rule = tenant_problem(tenant)
        if rule is not None:  # a gateway (or a key's table) named a tenant no report could show
            return error_response(
                400, f"tenant {shown(tenant)}: {rule}", "invalid_request_error", "invalid_tenant"
            )
        if not isinstance(parsed, dict):
            return await self._plain(request, body)
        exchange = Exchange(
            arrival_ts_ns=time.time_ns(), body=parsed, tenant=tenant, session=session_of(headers, parsed)
        )
        if exchange.prepare_stream_usage():
            body = json.dumps(exchange.body).encode()
        try:
            resp = await self._send(request, body, identity=True)
        except httpx.HTTPError as exc:
            return self._failed(exchange, exc)
        is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        if not is_sse:
            try:
                data = await resp.aread()
            except httpx.HTTPError as exc:
                return self._failed(exchange, exc)
            finally:
                await resp.aclose()
            try:
                exchange.on_json(resp.status_code, json.loads(data))
            except (ValueError, RecursionError):
                exchange.status = resp.status_code
            self.record(exchange)
            return Response(data, status_code=resp.status_code, headers=_response_headers(resp.headers))
        exchange.status = resp.status_code
        return StreamingResponse(
            self._relay(resp, exchange), status_code=resp.status_code, headers=_response_headers(resp.headers)
        )

    def _failed(self, exchange: Exchange, exc: httpx.HTTPError) -> Response:
        """The upstream never answered: the request is accounted as an error, the client told why."""
        out = _upstream_error(exc)
        exchange.status = out.status_code
        self.record(exchange, "error")
        return out

    async def _relay(self, resp: httpx.Response, exchange: Exchange) -> AsyncIterator[bytes]:
        buffer = bytearray()
        finished = False
        try:
            async for raw in resp.aiter_raw():
                buffer += raw
                for event in split_events(buffer):
                    data = event_data(event)
                    if data is None or exchange.on_event(data):
                        yield event
            if buffer:
                yield bytes(buffer)
            finished = True
        finally:
            await resp.aclose()
            self.record(exchange, None if finished else "abort")

    async def _send(self, request: Request, body: bytes, *, identity: bool) -> httpx.Response:
        """Forward ``request`` upstream; the response streams (raises httpx.HTTPError)."""
        assert self.client is not None
        upstream_req = self.client.build_request(
            request.method,
            request.url.path,
            params=request.query_params,
            headers=_forward_headers(request.headers, identity=identity),
            content=body,
        )
        return await self.client.send(upstream_req, stream=True)

    async def _plain(self, request: Request, body: bytes) -> Response:
        try:
            resp = await self._send(request, body, identity=False)
        except httpx.HTTPError as exc:
            return _upstream_error(exc)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for raw in resp.aiter_raw():
                    yield raw
            finally:
                await resp.aclose()

        return StreamingResponse(
            relay(), status_code=resp.status_code, headers=_response_headers(resp.headers)
        )


def create_app(proxy: ProxyProducer) -> FastAPI:
    """The FastAPI application around ``proxy`` (started and stopped with the app)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/sparseety/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def forward(request: Request, path: str) -> Response:
        return await proxy.handle(request)

    return app
