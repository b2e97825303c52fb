"""Capture a real ``vllm serve`` request log (and the plugin's events of the same run) as fixtures.

Writes ``tests/data/vllm_log/``:

* ``server.log`` — the API server's stdout/stderr with ``--enable-log-requests
  --enable-log-outputs`` at ``VLLM_LOGGING_LEVEL=DEBUG`` (DEBUG adds the prompt and output token
  ids), exactly as vLLM wrote it;
* ``plugin-events.bin`` — the SparSEEty plugin's engine events of the same run (the same requests
  accounted twice: the dedup fixture);
* ``truth.json`` — what the HTTP API answered per request (ids, usage, token ids, finish reason),
  the vLLM version and the server arguments.

Usage: ``.venv/bin/python scripts/capture_vllm_log.py`` (a tiny local model; nothing is downloaded).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "vllm_log"


def main() -> None:
    sys.path.insert(0, str(ROOT))
    import vllm

    from tests.e2e.conftest import ServerEngine, engine_config, server_args, tiny_model
    from tests.helpers import read_topic, running_broker
    from tests.recorded import pack

    os.environ["VLLM_LOGGING_LEVEL"] = "DEBUG"
    os.environ["VLLM_LOGGING_COLOR"] = "0"
    os.environ["NO_COLOR"] = "1"
    model = tiny_model("llama")
    args = server_args(
        model,
        "--enable-log-requests",
        "--enable-log-outputs",
        "--shutdown-timeout",
        "10",
        max_num_seqs=4,
    )
    system = "You answer questions about invoices, tenants and token prices, in one short paragraph. " * 3
    truth: list[dict[str, object]] = []
    with (
        tempfile.TemporaryDirectory(prefix="sparseety-vllm-log-") as tmp,
        running_broker(Path(tmp) / "b") as broker,
    ):
        cfg = engine_config(broker.client_config(), Path(tmp) / "engine", "vllm-log")
        log = Path(tmp) / "server.log"
        srv = ServerEngine(cfg, args, log)
        try:
            with httpx.Client(base_url=srv.url, timeout=120) as client:

                def chat(i: int) -> dict[str, object]:
                    body: dict[str, object] = {
                        "model": "tiny",
                        "messages": [
                            {"role": "system", "content": system},
                            {
                                "role": "user",
                                "content": f"Question {i}: what is the price of " + "a token, " * i,
                            },
                        ],
                        "max_tokens": 5 + 3 * i,
                        "temperature": 0,
                        "return_token_ids": True,
                    }
                    if i == 4:
                        body["stop"] = ["\n"]
                    r = client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": f"log-{i}"})
                    r.raise_for_status()
                    resp = r.json()
                    return {
                        "request_id": resp["id"],
                        "endpoint": "chat",
                        "usage": resp["usage"],
                        "prompt_token_ids": resp.get("prompt_token_ids"),
                        "output_token_ids": resp["choices"][0].get("token_ids"),
                        "finish_reason": resp["choices"][0]["finish_reason"],
                    }

                # three clients at once: the log interleaves their lines, as a busy server's does
                with ThreadPoolExecutor(3) as pool:
                    truth.extend(pool.map(chat, range(6)))
                # a completion (not chat) and a streamed chat: the other two logging paths
                r = client.post(
                    "/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": "Once upon a time",
                        "max_tokens": 7,
                        "temperature": 0,
                        "return_token_ids": True,
                    },
                    headers={"X-Request-Id": "log-cmpl"},
                )
                r.raise_for_status()
                resp = r.json()
                truth.append(
                    {
                        "request_id": resp["id"],
                        "endpoint": "completions",
                        "usage": resp["usage"],
                        "prompt_token_ids": resp["choices"][0].get("prompt_token_ids"),
                        "output_token_ids": resp["choices"][0].get("token_ids"),
                        "finish_reason": resp["choices"][0]["finish_reason"],
                    }
                )
                usage = None
                with client.stream(
                    "POST",
                    "/v1/chat/completions",
                    json={
                        "model": "tiny",
                        "messages": [{"role": "user", "content": "Stream please."}],
                        "max_tokens": 6,
                        "temperature": 0,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    },
                    headers={"X-Request-Id": "log-stream"},
                ) as s:
                    rid, reason = "", None
                    for line in s.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        rid = chunk["id"]
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for ch in chunk.get("choices", []):
                            reason = ch.get("finish_reason") or reason
                truth.append(
                    {"request_id": rid, "endpoint": "chat-stream", "usage": usage, "finish_reason": reason}
                )
                # a client that goes away mid-stream: vLLM logs "Aborted request(s)"
                with client.stream(
                    "POST",
                    "/v1/chat/completions",
                    json={
                        "model": "tiny",
                        "messages": [{"role": "user", "content": "Tell a long story."}],
                        "max_tokens": 900,
                        "min_tokens": 900,
                        "temperature": 0,
                        "stream": True,
                    },
                    headers={"X-Request-Id": "log-abort"},
                ) as s:
                    for _line in s.iter_lines():
                        break
                truth.append({"request_id": "chatcmpl-log-abort", "endpoint": "chat-abort"})
            time.sleep(3)
        finally:
            srv.close()
        values = [r[3] for r in read_topic(cfg, cfg.topics.engine_events, decode=False, quiet_s=3.0)]
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "server.log").write_bytes(log.read_bytes())
        (OUT / "plugin-events.bin").write_bytes(pack(values))
        (OUT / "truth.json").write_text(
            json.dumps(
                {
                    "vllm_version": vllm.__version__,
                    "server_args": [a if a != str(model) else "<tiny llama>" for a in args],
                    "env": {"VLLM_LOGGING_LEVEL": "DEBUG"},
                    "engine_name": cfg.producer.engine_name,
                    "requests": truth,
                },
                indent=1,
            )
            + "\n"
        )
    print(f"{len(truth)} requests, {len(values)} events, log {(OUT / 'server.log').stat().st_size} bytes")


if __name__ == "__main__":
    main()
