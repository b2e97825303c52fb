"""A hostile client against the proxy (issue 12): it cannot choose its tenant, an answer that
cannot be accounted still reaches it unchanged, and the proxy's own errors are OpenAI-style JSON.

A real upstream HTTP server on 127.0.0.1 and the real proxy app under uvicorn, with the session
broker behind the proxy's emitter.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from sparseety import events as ev
from sparseety.config import Config
from sparseety.producers.proxy.app import ProxyProducer, create_app
from tests.helpers import free_port, read_topic, serving, wait_for

#: The upstream answers by the request's model: these bodies go back byte for byte.
BAD_USAGE = b'{"id": "cmpl-abc", "choices": [{"finish_reason": "stop"}], "usage": {"prompt_tokens": "abc"}}'

BAD_STREAM = (
    b'data: {"id": "cmpl-s", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}'
    b"\n\n"
    b'data: {"id": "cmpl-s", "choices": [], "usage": {"prompt_tokens": -4, "completion_tokens": 1}}\n\n'
    b"data: [DONE]\n\n"
)


class Upstream(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(b'{"data": [{"id": "up"}]}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if body["model"] == "abc":
            self._send(BAD_USAGE)
            return
        if body["model"] == "abc-stream":
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", str(len(BAD_STREAM)))
            self.end_headers()
            self.wfile.write(BAD_STREAM)
            return
        if body["model"] == "slow":
            time.sleep(3)
        usage = {"prompt_tokens": 7, "completion_tokens": 2}
        rid = f"cmpl-{body['model']}"
        self._send(json.dumps({"id": rid, "choices": [{"finish_reason": "stop"}], "usage": usage}).encode())


@contextlib.contextmanager
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def proxy(cfg: Config, url: str, **kw: Any) -> Iterator[str]:
    producer = ProxyProducer(cfg, url, engine_name=f"chaos-proxy-{free_port()}", read_timeout_s=1.0, **kw)
    with serving(create_app(producer), "proxy") as url:
        yield url


def _chat(url: str, model: str, headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers or {}, timeout=30)


def _tenants(cfg: Config, n: int) -> dict[str, str]:
    def started() -> dict[str, str] | None:
        out = {
            ev.payload(e)["request_id"]: ev.payload(e)["tenant"]
            for *_, e in read_topic(cfg, cfg.topics.engine_events)
            if ev.payload_type(e) == ev.REQUEST_STARTED
        }
        return out if len(out) >= n else None

    result: dict[str, str] = wait_for(started, timeout=30, what=f"{n} accounted requests")
    return result


def _is_openai_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status and r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code"} and err["code"] == code and err["message"]


def test_a_key_holder_cannot_choose_its_tenant(kafka_cfg: Config) -> None:
    keys = {"key-acme": "acme"}
    with upstream() as up, proxy(kafka_cfg, up, api_keys=keys) as url:
        acme = {"Authorization": "Bearer key-acme"}
        assert _chat(url, "m1", {**acme, "X-Sparseety-Tenant": "globex"}).status_code == 200
        assert _chat(url, "m2", {**acme}, vllm_xargs={"tenant": "globex"}).status_code == 200
        refused = [
            _chat(url, "m3", {"Authorization": "Bearer stolen"}, vllm_xargs={"tenant": "globex"}),
            _chat(url, "m4", {"X-Sparseety-Tenant": "globex"}),
            _chat(url, "m5"),
            httpx.get(f"{url}/v1/models"),
        ]
        for r in refused:
            _is_openai_error(r, 401, "invalid_api_key")
        assert httpx.get(f"{url}/v1/models", headers=acme).json()["data"][0]["id"] == "up"
        tenants = _tenants(kafka_cfg, 2)
    assert tenants == {"cmpl-m1": "acme", "cmpl-m2": "acme"}


def test_only_a_trusted_gateway_names_the_tenant(kafka_cfg: Config) -> None:
    with upstream() as up, proxy(kafka_cfg, up, trust_tenant_header=True) as url:
        assert _chat(url, "g1", {"X-Sparseety-Tenant": "globex"}).status_code == 200
        assert _chat(url, "g2", vllm_xargs={"tenant": "initech"}).status_code == 200
        tenants = _tenants(kafka_cfg, 2)
    assert tenants == {"cmpl-g1": "globex", "cmpl-g2": "initech"}


def test_a_gateway_naming_no_tenant_name_is_answered_400(kafka_cfg: Config) -> None:
    """Issue 31: a tenant of 5,000 characters or with a newline is refused at the door, with the
    rule it breaks, in OpenAI's error shape; a good one goes on."""
    with upstream() as up, proxy(kafka_cfg, up, trust_tenant_header=True) as url:
        r = _chat(url, "m", {"X-Sparseety-Tenant": "x" * 5000})
        _is_openai_error(r, 400, "invalid_tenant")
        assert "at most 128 characters" in r.json()["error"]["message"] and len(r.text) < 500
        for bad in ("acme\nglobex", "a\tb", " acme"):  # headers cannot carry these: the body can
            _is_openai_error(_chat(url, "m", vllm_xargs={"tenant": bad}), 400, "invalid_tenant")
        assert _chat(url, "m", {"X-Sparseety-Tenant": "acme"}).status_code == 200


def test_unaccountable_answers_pass_through_and_are_dead_lettered(kafka_cfg: Config) -> None:
    with upstream() as up, proxy(kafka_cfg, up) as url:
        r = _chat(url, "abc")
        assert r.status_code == 200 and r.content == BAD_USAGE
        r = _chat(url, "abc-stream", stream=True, stream_options={"include_usage": True})
        assert r.status_code == 200 and r.content == BAD_STREAM
        assert _chat(url, "ok").status_code == 200
        _tenants(kafka_cfg, 1)

        def dead() -> list[Any] | None:
            out = [v for *_, v in read_topic(kafka_cfg, kafka_cfg.topics.dlq)]
            return out or None

        letters = wait_for(lambda: (d := dead()) and len(d) >= 2 and d, timeout=30, what="2 dead letters")
    assert len(letters) == 2
    assert all(x["component"] == "proxy" and "usage.prompt_tokens" in x["reason"] for x in letters)
    usages = sorted(json.dumps(json.loads(x["value"])["usage"]) for x in letters)
    assert usages == ['{"prompt_tokens": "abc"}', '{"prompt_tokens": -4, "completion_tokens": 1}']


def test_upstream_down_or_slow_is_a_json_502_or_504(kafka_cfg: Config) -> None:
    with upstream() as up, proxy(kafka_cfg, up) as url:
        _is_openai_error(_chat(url, "slow"), 504, "upstream_timeout")
        assert _chat(url, "fast").status_code == 200
    with proxy(kafka_cfg, f"http://127.0.0.1:{free_port()}") as url:
        _is_openai_error(_chat(url, "m"), 502, "upstream_unreachable")
        _is_openai_error(httpx.get(f"{url}/v1/models"), 502, "upstream_unreachable")


@pytest.mark.parametrize("timeout", [0.0, -1.0])
def test_the_read_timeout_must_be_positive(timeout: float) -> None:
    from sparseety.config import load_config
    from sparseety.errors import ConfigError

    with pytest.raises(ConfigError, match="read_timeout_s"):
        load_config(proxy={"read_timeout_s": timeout})
