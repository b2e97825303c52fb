"""Issue 31: a restart never changes a bill without a flag, on a real engine.

One vLLM server run (a sliding-window model, prefix caching, the plugin with its relay)
publishes to the embedded stack while the stack's broker restarts (``broker stop`` +
``broker start``: the in-memory log is gone, the engine spills meanwhile) and, later, its worker
is SIGKILLed in the middle of a batch and started again by ``sparseety up``. Every request of
the run must then be stored once, with the engine's own prompt, output and cached tokens; and
every request whose accounting is degraded (no attention window, no KV memory-time, no sliding
release, a cached block without its source) must say so in a flag. Requests admitted after the
configuration came back, and every request around the worker's kill (its state comes back from
the changelog), must be whole.

Real everything: Tansu, the Faust worker, the store process (chDB), vLLM's server with the
plugin, the CLI as processes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from sparseety.api.auth import read_admin_token
from sparseety.config import load_config
from sparseety.sinks.clickhouse.client import Store
from tests.e2e.conftest import EnginePool, ServerEngine, tiny_model
from tests.e2e.test_first_day import cli
from tests.helpers import free_port, wait_for

WINDOW = 64  # tiny_model("mistral-sw")'s sliding window
#: A prompt well past the window: its first blocks are released while it runs.
PROMPT = "The tenant who computed this prefix pays for it once; " * 5


def _complete(
    client: httpx.Client, tag: str, prompt: str, tenant: str, max_tokens: int = 8
) -> dict[str, Any]:
    r = client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "vllm_xargs": {"tenant": tenant},
        },
        headers={"X-Request-Id": tag},
    )
    assert r.status_code == 200, f"{tag}: {r.status_code} {r.text[:500]}"
    return dict(r.json())


def _rows(data: Path) -> dict[str, dict[str, Any]]:
    """The stored requests by the client's X-Request-Id (read after ``down``: the rows themselves,
    every copy, so a doubled request shows)."""
    cfg = load_config(data_dir=str(data))
    with Store.open(cfg) as store:
        db = store.database
        rows = store.query(
            "SELECT r.request_uid AS uid, r.external_request_id AS ext, r.prompt_tokens AS prompt, "
            "r.output_tokens AS output, r.engine_cached_tokens AS engine_cached, "
            "r.cache_read_tokens AS cache_read, r.window_released_tokens AS released, "
            "r.attention_window AS window, r.kv_byte_ms AS kv_byte_ms, r.seq_gap AS seq_gap, "
            "r.consistent AS consistent, r.complete AS complete, "
            "r.source_history_lost_ts_ns AS history_lost, ifNull(g.unsourced, 0) AS unsourced "
            f"FROM {db}.requests AS r LEFT JOIN (SELECT request_uid, "
            "countIf(status = 'cached' AND ifNull(source_request_uid, '') = '') AS unsourced "
            f"FROM {db}.token_segments FINAL GROUP BY request_uid) AS g ON r.request_uid = g.request_uid"
        )
    by_tag: dict[str, dict[str, Any]] = {}
    for row in rows:
        tag = str(row["ext"]).removeprefix("cmpl-").removesuffix("-0")  # the choice index
        assert tag not in by_tag, f"{tag} stored twice"
        by_tag[tag] = row
    return by_tag


def _degraded(row: dict[str, Any]) -> list[str]:
    """What of the request's accounting is missing."""
    return [
        what
        for what, missing in (
            ("attention window", row["window"] != WINDOW),
            ("KV memory-time", row["kv_byte_ms"] is None),
            ("window release", row["prompt"] > WINDOW and row["released"] == 0),
            ("cache source", row["unsourced"] > 0),
        )
        if missing
    ]


def _flagged(row: dict[str, Any]) -> bool:
    return bool(row["seq_gap"] or not row["consistent"] or not row["complete"] or row["history_lost"])


def test_a_broker_restart_and_a_worker_kill_in_one_engine_run(
    engine_pool: EnginePool, tmp_path: Path
) -> None:
    engine_pool.close_all()  # this test runs its own server: at most one engine at a time
    data = tmp_path / "stack"
    broker_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
    env |= {
        "SPARSEETY_DATA_DIR": str(data),
        "SPARSEETY_BROKER_PORT": str(broker_port),
        "SPARSEETY_KAFKA_BOOTSTRAP": f"127.0.0.1:{broker_port}",
        "SPARSEETY_API_PORT": str(free_port()),
        "SPARSEETY_WORKER_SESSION_TIMEOUT_S": "6",
    }
    up = cli(env, "up")
    assert up.returncode == 0, up.stderr
    srv = None
    answers: dict[str, dict[str, Any]] = {}
    tag = f"r{random.randrange(1 << 30):x}"
    try:
        cfg = load_config(env=env, producer={"engine_name": "restarts", "heartbeat_interval_s": 2.0})
        srv = ServerEngine(
            cfg,
            [
                "--model", str(tiny_model("mistral-sw")), "--served-model-name", "tiny",
                "--enable-prefix-caching", "--block-size", "32", "--max-model-len", "512",
                "--max-num-seqs", "8", "--enforce-eager", "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "null"}),
                "--shutdown-timeout", "10",
            ],
            tmp_path / "server.log",
        )  # fmt: skip
        api = f"http://127.0.0.1:{env['SPARSEETY_API_PORT']}"
        admin = {"Authorization": f"Bearer {read_admin_token(data)}"}

        def stored(n: int) -> bool:
            rows = httpx.get(f"{api}/api/v1/requests", params={"limit": 100}, headers=admin, timeout=10)
            return rows.status_code == 200 and len(rows.json()["rows"]) >= n

        with httpx.Client(base_url=srv.url, timeout=120) as client:

            def send(name: str, prompt: str = PROMPT, tenant: str = "acme") -> None:
                answers[f"{tag}-{name}"] = _complete(client, f"{tag}-{name}", prompt, tenant)

            # 1. before anything happens: a prompt, then its repeat (a prefix-cache hit)
            send("first")
            send("repeat")
            wait_for(lambda: stored(2), 120, 1.0, "the first two requests")

            # 2. the broker restarts behind the engine's back; the engine serves meanwhile
            assert cli(env, "broker", "stop").returncode == 0
            send("during", PROMPT.upper(), "globex")
            start = cli(env, "broker", "start")
            assert start.returncode == 0, start.stderr
            time.sleep(5)  # the relay drains its journal and announces the configuration again
            send("after")  # its cached blocks were computed before the restart
            send("fresh", "A prompt nobody sent before the restart. " * 5, "globex")
            wait_for(lambda: stored(5), 180, 1.0, "the requests around the broker restart")

            # 3. the worker is SIGKILLed while a batch runs, and `up` starts it again
            worker = int((data / "run" / "worker-0.pid").read_text())
            with ThreadPoolExecutor(4) as pool:
                jobs = [
                    pool.submit(
                        send, f"kill-{i}", f"Request {i} of the batch the worker dies in. " * 5, "initech"
                    )
                    for i in range(4)
                ]
                time.sleep(0.5)
                os.killpg(worker, signal.SIGKILL)
                for job in jobs:
                    job.result()
            again = cli(env, "up")
            assert again.returncode == 0, again.stderr
            assert "worker-0: starting the assembler" in again.stderr, again.stderr
            send("last", "The last prompt of the run, after the worker came back. " * 4, "initech")
            wait_for(lambda: stored(10), 180, 1.0, "every request")
    finally:
        if srv is not None:
            srv.close()
        down = cli(env, "down")
        assert down.returncode == 0, down.stderr

    rows = _rows(data)
    assert set(rows) == set(answers), f"stored {sorted(rows)}, sent {sorted(answers)}"
    for name, answer in answers.items():
        row, usage = rows[name], answer["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        assert (row["prompt"], row["output"], row["engine_cached"]) == (
            usage["prompt_tokens"],
            usage["completion_tokens"],
            cached,
        ), name
        degraded = _degraded(row)
        print(f"{name}: degraded {degraded or '-'}, flagged {_flagged(row)}, {row}")
        assert _flagged(row) or not degraded, f"{name} lost {degraded} without a flag: {row}"
    assert rows[f"{tag}-repeat"]["cache_read"] > 0 and not _degraded(rows[f"{tag}-repeat"])
    # admitted after the configuration came back: whole; the source of its cache hit (blocks
    # computed before the restart) is named, or said lost with the broker's history
    after = rows[f"{tag}-after"]
    assert after["cache_read"] > 0, after
    assert set(_degraded(after)) <= {"cache source"} and (after["unsourced"] == 0 or after["history_lost"]), (
        after
    )
    for name in ("fresh", "last", *(f"kill-{i}" for i in range(4))):
        assert not _degraded(rows[f"{tag}-{name}"]), rows[f"{tag}-{name}"]
