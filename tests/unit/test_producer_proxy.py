"""The proxy producer's accounting: SSE framing, the usage chunk it asked for, tenants, payloads."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sparseety import events as ev
from sparseety.producers.proxy.accounting import (
    Exchange,
    UnaccountableResponseError,
    event_data,
    session_of,
    split_events,
    tenant_of,
)
from sparseety.validate import MAX_TOKENS


def _chunk(**body: object) -> bytes:
    return json.dumps({"id": "chatcmpl-1", **body}).encode()


def test_split_events_keeps_bytes_and_waits_for_complete_events() -> None:
    buf = bytearray(b"data: a\n\ndata: b\r\n\r\ndata: c")
    assert split_events(buf) == [b"data: a\n\n", b"data: b\r\n\r\n"]
    assert buf == bytearray(b"data: c")
    buf += b"\n\n"
    assert split_events(buf) == [b"data: c\n\n"] and not buf
    assert event_data(b"event: x\ndata: {1}\n\n") == b"{1}" and event_data(b": ping\n\n") is None


def test_stream_accounting_hides_only_the_usage_chunk_it_asked_for() -> None:
    x = Exchange(arrival_ts_ns=1, body={"model": "m", "stream": True, "max_tokens": 3}, tenant="t")
    assert x.prepare_stream_usage() and x.body["stream_options"] == {"include_usage": True}
    role = _chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}])
    tok = _chunk(choices=[{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}])
    last = _chunk(choices=[{"index": 0, "delta": {"content": "!"}, "finish_reason": "length"}])
    usage = _chunk(
        choices=[],
        usage={"prompt_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}},
    )
    shown = [x.on_event(d, now_ns=t) for t, d in enumerate([role, tok, last, usage, b"[DONE]"], start=10)]
    assert shown == [True, True, True, False, True]
    started, finished = x.payloads("r1")
    assert started == (ev.REQUEST_STARTED, started[1]) and finished[0] == ev.REQUEST_FINISHED
    assert (started[1]["prompt_len"], started[1]["num_cached_tokens"], started[1]["tenant"]) == (7, 4, "t")
    assert started[1]["max_tokens"] == 3 and started[1]["model"] == "m"
    f = finished[1]
    assert (f["num_output_tokens"], f["finish_reason"], f["chunk_arrival_ns"], f["first_token_ts_ns"]) == (
        2,
        "length",
        [11, 12],
        11,
    )


def test_client_asked_for_usage_sees_it() -> None:
    x = Exchange(arrival_ts_ns=1, body={"stream": True, "stream_options": {"include_usage": True}}, tenant="")
    assert not x.prepare_stream_usage()
    assert x.on_event(_chunk(choices=[], usage={"prompt_tokens": 1, "completion_tokens": 1}))


def test_non_streamed_and_failed_requests() -> None:
    x = Exchange(arrival_ts_ns=1, body={}, tenant="")
    x.on_json(
        200,
        {
            "id": "cmpl-9",
            "usage": {"prompt_tokens": 5, "completion_tokens": 1},
            "choices": [{"finish_reason": "stop"}],
        },
    )
    (_, s), (_, f) = x.payloads("cmpl-9")
    assert (s["prompt_len"], f["num_output_tokens"], f["finish_reason"], f["first_token_ts_ns"]) == (
        5,
        1,
        "stop",
        0,
    )
    y = Exchange(arrival_ts_ns=1, body={}, tenant="")
    y.on_json(400, {"error": "bad"})
    assert y.payloads("r")[1][1]["finish_reason"] == "error"


@pytest.mark.parametrize("bad", [MAX_TOKENS + 1, 2**31 - 1, -1, "abc", 1.5, True])
def test_usage_outside_the_contracts_bounds_is_unaccountable(bad: object) -> None:
    """The proxy applies the contract's bound (sparseety.validate), not one of its own."""
    x = Exchange(arrival_ts_ns=1, body={}, tenant="")
    x.on_json(200, {"id": "c", "usage": {"prompt_tokens": 5, "completion_tokens": bad}})
    with pytest.raises(UnaccountableResponseError):
        x.payloads("c")
    ok = Exchange(arrival_ts_ns=1, body={}, tenant="")
    ok.on_json(200, {"id": "c", "usage": {"prompt_tokens": MAX_TOKENS, "completion_tokens": 0}})
    assert ok.payloads("c")[1][1]["num_prompt_tokens"] == MAX_TOKENS


def test_tenant_precedence() -> None:
    keys = {"k1": "from-key"}
    body = {"vllm_xargs": {"tenant": "from-body"}}
    h = {"x-tenant": "h", "authorization": "Bearer k1"}
    # a trusted gateway names the tenant: its header, else vllm_xargs
    assert tenant_of(h, body, keys, "X-Tenant", trust_header=True) == "h"
    assert tenant_of({}, body, keys, "X-Tenant", trust_header=True) == "from-body"
    # otherwise the key's tenant is the tenant, whatever the client says
    assert tenant_of(h, body, keys, "X-Tenant") == "from-key"
    assert tenant_of({"x-api-key": "k1"}, {}, keys, "X-Tenant") == "from-key"
    # with keys configured, no known key: refused
    assert tenant_of({"authorization": "Bearer other"}, body, keys, "X-Tenant") is None
    assert tenant_of({"x-tenant": "h"}, body, keys, "X-Tenant") is None
    assert tenant_of({}, {}, keys, "X-Tenant") is None
    # no keys and no gateway: forwarded, billed to nobody
    assert tenant_of({"x-tenant": "h"}, body, {}, "X-Tenant") == ""


def test_session_comes_from_the_header_else_vllm_xargs_and_rides_on_request_started() -> None:
    body = {"vllm_xargs": {"session": "from-body"}}
    assert session_of({"x-sparseety-session": "h"}, body) == "h"
    assert session_of({}, body) == "from-body"
    assert session_of({"x-session-id": "vllm-header"}, body) == "vllm-header"  # vLLM's own header
    assert session_of({}, {"session_id": "field", **body}) == "field"  # vLLM's own body field
    assert session_of({}, {"vllm_xargs": {"session_id": "x"}}) == "x"
    assert session_of({}, {"vllm_xargs": {"session": 3}}) == session_of({}, {}) == ""
    x = Exchange(arrival_ts_ns=1, body={"model": "m"}, tenant="acme", session="conv-1")
    x.on_json(200, {"id": "c", "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    started = x.payloads("r")[0][1]
    assert (started["tenant"], started["session_id"]) == ("acme", "conv-1")


def test_proxy_command_is_mounted() -> None:
    from sparseety.cli import main

    result = CliRunner().invoke(main, ["proxy", "--help"])
    assert result.exit_code == 0 and "--upstream" in result.output and "--api-keys" in result.output
