"""Multimodal prompts on the real CPU engine (issue 36, part 4): a tiny random Idefics3 built here
(``sparseety.stack.tiny_models``, kind ``idefics3``) served by vLLM's OpenAI API server with the
plugin, images sent as data URLs (nothing is downloaded).

Per request, through the plugin, the broker, the fold and the store:

* image placeholder positions equal vLLM's own ``usage.prompt_tokens_details.multimodal_tokens``
  (and ``prompt_tokens`` includes them);
* encoder tokens computed and encoder-cache hits equal a ground truth recorded inside the engine
  core by a test-only instrument (``tests/e2e/mm_truth/sitecustomize.py``: every item the scheduler
  sent to the encoder, every True answer of ``EncoderCacheManager.check_and_update_cache``);
  vLLM has no per-request count of either. The workload is built so that each kind happens: a
  first image (computed), the same image after another prefix (an encoder-cache hit, nothing
  computed), an old and a new image in one prompt (one of each), one image twice in a prompt
  (computed once; vLLM's scheduler then finds the second copy in its encoder cache: a hit), a text
prompt (none), and a prompt sent twice whose image lies in its first
block: the second time the prefix cache serves the image's positions (``image_cached_tokens``)
and the encoder is not asked at all.

The proxy producer in front of the same server records the image tokens the usage reports.

The model has no audio or video input: audio and video counts are 0 for every request, and the
test says so.
"""

from __future__ import annotations

import base64
import io
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sparseety.config import Config
from sparseety.schema_store import SchemaStore
from sparseety.serde import Decoder, Encoder
from tests.e2e.conftest import EnginePool, ServerEngine, engine_config, environ, server_args, tiny_model
from tests.e2e.engine_events import engine_events, engine_rid, finished_ids
from tests.harness.pipeline import fold
from tests.helpers import accounting_store, serving
from tests.recorded import reconstruct

REPO = Path(__file__).resolve().parents[2]
TRUTH_DIR = Path(__file__).parent / "mm_truth"


def _image(seed: int, size: tuple[int, int] = (32, 32)) -> dict[str, Any]:
    """An OpenAI ``image_url`` content part holding a random PNG."""
    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


_LONG = (
    " Every request has an identifier, an arrival time, a prompt, a set of sampling parameters and a budget."
)

#: name -> (content parts, what the encoder must do: "run" / "hit" items). Sent in this order,
#: one at a time, so the encoder cache's state is the one each name says.
WORKLOAD: list[tuple[str, list[dict[str, Any]], dict[str, int]]] = [
    ("first", [_text("The serving fleet runs "), _image(1), _text(" many copies.")], {"run": 1, "hit": 0}),
    ("again", [_text("Good morning. How are you today? "), _image(1)], {"run": 0, "hit": 1}),
    (
        "old_and_new",
        [_image(1), _text(" and "), _image(2, (40, 24)), _text(" side by side.")],
        {"run": 1, "hit": 1},
    ),
    # the second copy is served by the encoder cache the first copy's run filled
    ("twice", [_image(3), _text(" then "), _image(3)], {"run": 1, "hit": 1}),
    ("text", [_text("List three colours: red, green and blue.")], {"run": 0, "hit": 0}),
    ("long", [_image(4), _text(_LONG)], {"run": 1, "hit": 0}),
    # the same prompt: its first block (the image inside) comes from the prefix cache, so the
    # encoder is not even asked for the image
    ("long_again", [_image(4), _text(_LONG)], {"run": 0, "hit": 0, "image_cached": 7}),
]


@pytest.fixture(scope="module")
def mm_server(engine_pool: EnginePool, broker: Config, e2e_dir: Path) -> Iterator[tuple[ServerEngine, Path]]:
    engine_pool.close_all()  # one real engine at a time
    cfg = engine_config(broker, e2e_dir / "mm", "mm")
    truth = e2e_dir / f"mm-truth-{uuid.uuid4().hex[:8]}.jsonl"
    args = server_args(
        tiny_model("idefics3"),
        "--limit-mm-per-prompt",
        json.dumps({"image": 2}),
        "--shutdown-timeout",
        "10",
    )
    path = os.pathsep.join([str(TRUTH_DIR), str(REPO)])
    with environ({"PYTHONPATH": path, "TEST_MM_TRUTH_FILE": str(truth)}):
        srv = ServerEngine(cfg, args, e2e_dir / "mm-server.log")
    try:
        yield srv, truth
    finally:
        srv.close()


def _truth(path: Path) -> dict[str, dict[str, int]]:
    """Per engine request id: encoder tokens run, and hit tokens (each (request, item) once, never
    for an item the request's own encoder run computed)."""
    runs: dict[str, dict[int, int]] = {}
    hits: dict[str, dict[int, int]] = {}
    for line in path.read_text().splitlines():
        fact = json.loads(line)
        if "run" in fact:
            runs.setdefault(fact["run"], {})
            runs[fact["run"]][fact["index"]] = runs[fact["run"]].get(fact["index"], 0) + fact["embeds"]
        else:
            hits.setdefault(fact["hit"], {})[fact["index"]] = fact["embeds"]
    out = {}
    for rid in runs.keys() | hits.keys():
        own = runs.get(rid, {})
        out[rid] = {
            "compute": sum(own.values()),
            "runs": len(own),
            "hit": sum(n for i, n in hits.get(rid, {}).items() if i not in own),
            "hits": sum(1 for i in hits.get(rid, {}) if i not in own),
        }
    return out


def test_multimodal_tokens_and_encoder_work_equal_vllms_own_and_the_truth(
    mm_server: tuple[ServerEngine, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    server, truth_file = mm_server
    tag = uuid.uuid4().hex[:8]
    responses: dict[str, dict[str, Any]] = {}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for name, content, _ in WORKLOAD:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 4,
                "temperature": 0,
            }
            r = client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": f"{tag}-{name}"})
            assert r.status_code == 200, r.text
            responses[name] = r.json()
    externals = {f"chatcmpl-{tag}-{name}" for name, _, _ in WORKLOAD}

    def complete(events: list[dict[str, Any]]) -> bool:
        return externals <= {rid.rsplit("-", 1)[0] for rid in finished_ids(events)}

    events = engine_events(server.cfg, complete, timeout=90)
    per_request = reconstruct(events)
    accounts = fold(events)
    truth = _truth(truth_file)
    for name, content, expect in WORKLOAD:
        rid = engine_rid(events, f"chatcmpl-{tag}-{name}")
        usage = responses[name]["usage"]
        details = usage.get("prompt_tokens_details") or {}
        vllm_mm = details.get("multimodal_tokens") or {}
        started, finished = per_request[rid]["started"], per_request[rid]["finished"]
        images = sum(1 for part in content if part["type"] == "image_url")
        # vLLM's own counts
        assert started["prompt_len"] == usage["prompt_tokens"], name
        assert finished["prompt_tokens_by_modality"] == vllm_mm, name
        assert len(started["mm_inputs"]) == images, name
        assert sum(i["length"] for i in started["mm_inputs"]) == vllm_mm.get("image", 0), name
        assert all(
            i["modality"] == "image" and 0 < i["num_embeds"] <= i["length"] for i in started["mm_inputs"]
        )
        # the engine's encoder work, instrumented
        t = truth.get(rid, {"compute": 0, "runs": 0, "hit": 0, "hits": 0})
        assert (t["runs"], t["hits"]) == (expect["run"], expect["hit"]), (name, t)
        assert finished["num_encoder_compute_tokens"] == t["compute"], name
        assert finished["num_encoder_cache_hit_tokens"] == t["hit"], name
        # the fold's record
        acc = accounts[rid]
        assert acc["image_tokens"] == vllm_mm.get("image", 0), name
        assert acc["audio_tokens"] == acc["video_tokens"] == 0, name  # Idefics3 has no audio/video input
        assert acc["image_cached_tokens"] == expect.get("image_cached", 0), name
        assert acc["encoder_compute_tokens"] == t["compute"], name
        assert acc["encoder_cache_hit_tokens"] == t["hit"], name
        assert acc["consistent"], name
    assert accounts[engine_rid(events, f"chatcmpl-{tag}-again")]["encoder_cache_hit_tokens"] > 0
    assert accounts[engine_rid(events, f"chatcmpl-{tag}-first")]["encoder_compute_tokens"] > 0
    # The store's rows carry them (the sink's write path, chDB), from the records as the worker's
    # topic carries them (Avro: a field the fold does not fill reads its default).
    store_schemas = SchemaStore.load()
    enc, dec = Encoder(store_schemas, "RequestAccounting"), Decoder(store_schemas)
    columns = ("image_tokens", "image_cached_tokens", "audio_tokens", "video_tokens")
    columns += ("encoder_compute_tokens", "encoder_cache_hit_tokens")
    ours = [
        dec.decode(enc.encode(a))[1]
        for a in accounts.values()
        if a["external_request_id"].startswith(f"chatcmpl-{tag}-")
    ]
    assert len(ours) == len(WORKLOAD)
    with accounting_store(tmp_path_factory, ours) as store:
        rows = store.query(f"SELECT request_uid, {', '.join(columns)} FROM {store.database}.requests FINAL")
    assert {r["request_uid"]: {c: int(r[c]) for c in columns} for r in rows} == {
        a["request_uid"]: {c: a[c] for c in columns} for a in ours
    }


def test_the_proxy_reads_the_servers_multimodal_tokens(
    mm_server: tuple[ServerEngine, Path], broker: Config, e2e_dir: Path
) -> None:
    """The request-level path: ``sparseety proxy`` in front of the same server records the image
    tokens vLLM's usage reports, and the fold carries them (no items: none known to be cached)."""
    from sparseety.producers.proxy.app import ProxyProducer, create_app

    server, _ = mm_server
    cfg = engine_config(broker, e2e_dir / "mm-proxy", "mm-proxy")
    producer = ProxyProducer(cfg, server.url, engine_name="e2e-mm-proxy")
    content = [_text("Describe "), _image(5), _text(" and "), _image(6, (24, 40))]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 3}
    with serving(create_app(producer), "proxy") as url:
        via = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    vllm_mm = via["usage"]["prompt_tokens_details"]["multimodal_tokens"]
    assert vllm_mm["image"] == 14  # two images, 7 placeholders each
    events = engine_events(cfg, lambda evs: len(finished_ids(evs)) >= 1, timeout=30)
    got = reconstruct(events)[via["id"]]
    assert got["finished"]["prompt_tokens_by_modality"] == vllm_mm
    (acc,) = fold(events).values()
    assert (acc["image_tokens"], acc["image_cached_tokens"], acc["audio_tokens"]) == (14, 0, 0)
    assert acc["prompt_tokens"] == via["usage"]["prompt_tokens"]
