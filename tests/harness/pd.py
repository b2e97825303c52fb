"""Prefill/decode disaggregation in the harness (issue 36, part 3): two real engine cores.

A prefill engine core and a decode engine core share vLLM's own ``ExampleConnector`` (a directory
both read; ``kv_producer`` and ``kv_consumer``). The simulated executor of the prefill engine does
the connector worker's save (the request's directory appears, ``tests/harness/sim_executor.py``);
the decode engine's scheduler side finds it and loads the prompt's KV (every full block of the
prompt but the last token). Requests go as vLLM's toy P/D proxy sends them: the same
``X-Request-Id`` to both, so both front ends make ``chatcmpl-<id>`` and both engine cores add
their own random suffix; the prefill request asks for one token and carries
``kv_transfer_params`` ``do_remote_decode``, the decode request ``do_remote_prefill`` and the
prefill engine's request id (``remote_request_id``, as NIXL's proxy passes it).

Both engines publish through the plugin to one real topic, as a fleet does.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparseety import events as ev
from sparseety.config import Config, to_env
from tests.e2e.conftest import environ
from tests.e2e.engine_events import engine_events
from tests.harness.engine import Harness, Mode, build, drive, request
from tests.harness.pipeline import fold

#: Prompt lengths of the client requests (block 16): whole blocks, a partial last block, one
#: shorter than a block (nothing to transfer) and two sharing a prefix (a local hit on each side).
#: 97 = 6 * 16 + 1 is never transferred: ExampleConnector saves it under 96 tokens and looks it up
#: under 80 (``align_to_block_size`` takes one off, and the lookup one more), so the decode engine
#: computes it whole; its bill says so.
PROMPTS = (40, 64, 97, 12, 130, 130)
OUTPUTS = (20, 7, 33, 5, 16, 9)


@dataclass
class PdRun:
    """Both engines' harnesses, the events both published and the fold's accounts."""

    prefill: Harness
    decode: Harness
    events: list[dict[str, Any]]
    #: X-Request-Id -> (prefill engine request id, decode engine request id), in PROMPTS order
    pairs: dict[str, tuple[str, str]] = field(default_factory=dict)
    accounts: dict[str, dict[str, Any]] = field(default_factory=dict)


def _prompt(i: int, n: int) -> list[int]:
    base = 5 if i >= 4 else 5 + 37 * i  # the last two share their whole prompt but one token
    out = [4 + (base + 7 * j) % 500 for j in range(n)]
    if i == 5:
        out[-1] = 4 + (out[-1] + 1) % 500
    return out


def tenant_of(i: int) -> str:
    """The tenant of client request ``i`` (the router passes it to both engines)."""
    return ("acme", "globex")[i % 2]


def _request(rid: str, prompt: list[int], max_tokens: int, transfer: dict[str, Any], tenant: str) -> Any:
    """The router's request to one engine: the client's id before the engine's suffix."""
    return request(
        rid,
        prompt,
        tenant=tenant,
        extra={"kv_transfer_params": transfer},
        external_req_id=rid.rsplit("-", 1)[0],
        max_tokens=max_tokens,
        ignore_eos=True,
    )


def _connector(role: str, shared: Path) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(shared)},
    }


def run_pd(model: Path, broker: Config, workdir: Path, *, async_scheduling: bool = False) -> PdRun:
    """Serve :data:`PROMPTS` disaggregated; both engines publish to one topic of ``broker``
    (both engines with the plain scheduler, or both with async scheduling, the GPU default)."""
    from sparseety.kafka import ensure_topics

    suffix = uuid.uuid4().hex[:8]
    shared = workdir / f"pd-{suffix}"
    shared.mkdir(parents=True)
    cfg = broker.replace(
        data_dir=str(workdir / f"pd-data-{suffix}"),
        topics={
            **broker.topics.model_dump(),
            "engine_events": f"harness-pd-{suffix}.engine-events",
            "partitions": 1,
        },
        producer={"heartbeat_interval_s": 2.0},
    )
    ensure_topics(cfg, [cfg.topics.engine_events])
    mode = Mode(async_scheduling=async_scheduling, hybrid_manager=False)  # ExampleConnector refuses HMA
    engines: dict[str, Harness] = {}
    for role, name in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
        ecfg = cfg.replace(producer={**cfg.producer.model_dump(), "engine_name": f"harness-pd-{name}"})
        with environ(to_env(ecfg)):
            engines[name] = build(mode, model, kv_transfer_config=_connector(role, shared))
    run = PdRun(prefill=engines["prefill"], decode=engines["decode"], events=[])
    try:
        prefills, decodes = [], []
        for i, (n, m) in enumerate(zip(PROMPTS, OUTPUTS, strict=True)):
            xid = uuid.uuid4().hex
            p_rid = f"chatcmpl-{xid}-{uuid.uuid4().hex[:8]}"
            d_rid = f"chatcmpl-{xid}-{uuid.uuid4().hex[:8]}"
            run.pairs[xid] = (p_rid, d_rid)
            prompt = _prompt(i, n)
            prefills.append(
                _request(
                    p_rid, prompt, 1, {"do_remote_decode": True, "do_remote_prefill": False}, tenant_of(i)
                )
            )
            decodes.append(
                _request(
                    d_rid, prompt, m, {"do_remote_prefill": True, "remote_request_id": p_rid}, tenant_of(i)
                )
            )
        # The proxy waits for the prefill's response before it sends the decode request.
        drive(run.prefill, [prefills])
        drive(run.decode, [decodes])
    finally:
        run.prefill.shutdown()
        run.decode.shutdown()
    n = 2 * len(PROMPTS)

    def done(events: list[dict[str, Any]]) -> bool:
        return sum(ev.payload_type(e) == ev.REQUEST_FINISHED for e in events) >= n

    run.events = engine_events(cfg, done)
    run.accounts = fold(run.events)
    return run
