"""The SGLang producer against a real SGLang engine on this CPU (one server for the module).

The server runs in SGLang's own environment (``.venv-sglang``, scripts/setup_sglang.sh) with the
producer loaded through its ``sglang.srt.plugins`` entry point and the test's radix-cache truth
(``tests/e2e/sglang_launch.py``) in the scheduler process. One workload: a shared system prompt
across tenants, identical prompts, long prompts on a small ``--max-total-tokens`` (radix
evictions, then a prompt sent again), several tenants, one abort. What is checked:

* per request: prompt, output and cached tokens on RequestFinished and in the fold's accounting
  equal SGLang's ``meta_info`` (``prompt_tokens``, ``completion_tokens``, ``cached_tokens``);
* engine totals equal SGLang's ``/metrics`` (``sglang:realtime_tokens_total`` by mode);
* the identical prompt's cached positions point to the request that computed them;
* recompute after eviction equals the radix-cache truth, and the workload does produce some;
* the events are recorded under ``tests/data/sglang_radix/`` when ``RECORD_SGLANG_FIXTURE=1``
  (the replay test, ``tests/unit/test_sglang_recorded.py``, folds them without an engine).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sparseety import events as ev
from sparseety.config import Config, to_env
from sparseety.stack.sglang_engine import SglangServer, realtime_tokens
from tests.e2e.conftest import engine_config, tiny_model
from tests.e2e.engine_events import engine_events
from tests.helpers import read_topic
from tests.sglang_checks import ABORT_TRIES, ABORTED_MAX_NEW, check_run

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
MAX_TOTAL_TOKENS = 640
MAX_NEW = 8  # output tokens per workload request
DATA = ROOT / "tests" / "data" / "sglang_radix"


def _ids(seed: int, n: int) -> list[int]:
    """Deterministic token ids inside the tiny model's vocabulary (no special tokens)."""
    return [4 + (seed * 131 + i * 37 + (i * i) % 11) % 500 for i in range(n)]


SYSTEM = _ids(1, 48)
WORKLOAD: list[tuple[str, str, list[int]]] = [
    ("sys-a1", "acme", SYSTEM + _ids(2, 20)),
    ("sys-a2", "acme", SYSTEM + _ids(3, 20)),
    ("sys-b1", "globex", SYSTEM + _ids(4, 20)),
    ("same-1", "initech", _ids(5, 40)),
    ("same-2", "initech", _ids(5, 40)),
    ("long-1", "acme", _ids(6, 260)),
    ("long-2", "globex", _ids(7, 260)),
    ("long-3", "initech", _ids(8, 260)),
    ("long-1-again", "acme", _ids(6, 260)),
]


def start_server(cfg: Config, workdir: Path, **options: Any) -> tuple[SglangServer, Path]:
    """The product's launcher (``sparseety.stack.sglang_engine.SglangServer``) running
    ``tests/e2e/sglang_launch.py`` (SGLang's server plus the radix-cache truth recorder) on the
    tiny Llama with this module's KV pool, and ``options`` (``tree_core``, ``extra_args``);
    returns the server and where its truth goes."""
    truth_path = workdir / "truth.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
    env.update({**to_env(cfg), "E2E_SGLANG_TRUTH": str(truth_path)})
    server = SglangServer(
        SGLANG_PYTHON,
        tiny_model("llama"),
        env,
        workdir / "sglang.log",
        max_total_tokens=MAX_TOTAL_TOKENS,
        module="tests.e2e.sglang_launch",
        cwd=ROOT,
        **options,
    )
    return server, truth_path


def _abort_one(server: SglangServer, rid: str) -> dict[str, Any]:
    """A long generation aborted while it decodes (SGLang's /abort_request).

    The request streams, and the abort is sent once its first tokens arrived: a fixed sleep was
    too long on a fast machine (all 400 tokens came before it, finish_reason ``length``). On a
    loaded machine SGLang's scheduler still outran its tokenizer process, which streams the tokens
    and takes the abort: it asks for 500 tokens (of the 640 the pool holds) and the abort is sent
    again every 20 ms until the stream ends, so one that came too early is not the last. Even so
    the scheduler can finish all 500 before the first token reaches the client (seen in a CI run,
    the Rust core's server and the plugin-less one both): :func:`run_workload` tries again."""
    result: dict[str, Any] = {}
    decoding = threading.Event()
    body = {
        "rid": rid,
        "input_ids": _ids(9, 30),
        "stream": True,
        "sampling_params": {
            "max_new_tokens": ABORTED_MAX_NEW,
            "temperature": 0,
            "ignore_eos": True,
            "custom_params": {"tenant": "globex"},
        },
    }

    def run() -> None:
        url = f"{server.url}/generate"
        with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", url, json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    result.update(json.loads(line[len("data: ") :]))
                    decoding.set()
        decoding.set()

    t = threading.Thread(target=run)
    t.start()
    assert decoding.wait(120), f"{rid} never started decoding"
    deadline = time.monotonic() + 120
    while t.is_alive() and time.monotonic() < deadline:
        httpx.post(f"{server.url}/abort_request", json={"rid": rid}, timeout=30).raise_for_status()
        t.join(0.02)
    t.join(1)
    return result


def engine_workdir(broker: Config, e2e_dir: Path, name: str) -> tuple[Config, Path]:
    """The engine ``name``'s config (its own topic) and directory; SGLang's venv must exist."""
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} is missing: run scripts/setup_sglang.sh (scripts/setup.sh does)")
    workdir = e2e_dir / name
    workdir.mkdir(exist_ok=True)
    return engine_config(broker, workdir, name), workdir


def settled_realtime_tokens(url: str) -> dict[str, float]:
    """``sglang:realtime_tokens_total`` once it stops moving. SGLang streams a request's last
    output before it adds that batch's decode count (``stream_output`` comes before
    ``report_decode_stats``), and under overlap an aborted request's batch in flight is
    processed after the abort's answer: a read right after the workload can be a batch short."""
    now = realtime_tokens(url)
    for _ in range(20):
        time.sleep(0.5)
        now, before = realtime_tokens(url), now
        if now == before:
            break
    return now


def run_workload(server: SglangServer) -> dict[str, dict[str, Any]]:
    """:data:`WORKLOAD`, then the abort; SGLang's answer per request, with its tenant.

    An abort attempt that ran out its budget first is an ordinary request (``abort-1``, ...,
    checked as any other by ``check_run``) and the next one is tried, at most
    :data:`ABORT_TRIES`; the last attempt is the one that must have been aborted."""
    answers = {rid: {"tenant": t, **server.generate(rid, t, ids, MAX_NEW)} for rid, t, ids in WORKLOAD}
    for attempt in range(1, ABORT_TRIES + 1):
        rid = f"abort-{attempt}"
        answers[rid] = {"tenant": "globex", **_abort_one(server, rid)}
        if answers[rid].get("meta_info", {}).get("completion_tokens", ABORTED_MAX_NEW) < ABORTED_MAX_NEW:
            break
    return answers


@pytest.fixture(scope="module")
def sglang_run(broker: Config, e2e_dir: Path) -> Iterator[dict[str, Any]]:
    cfg, workdir = engine_workdir(broker, e2e_dir, "sglang")
    server, truth_path = start_server(cfg, workdir)
    try:
        answers = run_workload(server)
        metrics = settled_realtime_tokens(server.url)
        metrics_text = httpx.get(f"{server.url}/metrics", timeout=10).text
    finally:
        server.close()
    n = len(answers)
    events = engine_events(
        cfg, lambda es: sum(ev.payload_type(e) == ev.REQUEST_FINISHED for e in es) >= n, timeout=60
    )
    lines = [json.loads(line) for line in truth_path.read_text().splitlines()]
    truth = {t["rid"]: t for t in lines if "rid" in t}
    loops = [t["event_loop"] for t in lines if "event_loop" in t]
    if os.environ.get("RECORD_SGLANG_FIXTURE") == "1":
        from tests.recorded import pack

        DATA.mkdir(parents=True, exist_ok=True)
        raw = [r[3] for r in read_topic(cfg, cfg.topics.engine_events, decode=False, quiet_s=0.5)]
        (DATA / "events.bin").write_bytes(pack(raw))
        meta = {rid: a.get("meta_info", {}) for rid, a in answers.items()}
        (DATA / "truth.json").write_text(
            json.dumps({"requests": meta, "tenants": {r: a["tenant"] for r, a in answers.items()},
                        "radix_truth": truth, "metrics": metrics}, indent=1, sort_keys=True)
        )  # fmt: skip
    yield {
        "answers": answers,
        "metrics": metrics,
        "events": events,
        "truth": truth,
        "loops": loops,
        "metrics_text": metrics_text,
    }


def test_sglang_accounting_equals_sglang(sglang_run: dict[str, Any]) -> None:
    """Every check of ``tests/sglang_checks.check_run`` on the live run."""
    meta = {rid: a.get("meta_info", {}) for rid, a in sglang_run["answers"].items()}
    tenants = {rid: a["tenant"] for rid, a in sglang_run["answers"].items()}
    check_run(sglang_run["events"], meta, tenants, sglang_run["truth"], sglang_run["metrics"])


def test_sglang_engine_identity(sglang_run: dict[str, Any]) -> None:
    """EngineStarted names the engine family and version; the stream has no seq gap."""
    started = [ev.payload(e) for e in sglang_run["events"] if ev.payload_type(e) == ev.ENGINE_STARTED]
    assert len(started) == 1
    assert started[0]["engine_kind"] == "sglang"
    assert started[0]["engine_version"] == "0.5.23"
    assert started[0]["block_size"] == 16 and started[0]["enable_prefix_caching"]
    # the server runs the Python TreeCore: the producer read that from the cache SGLang built
    assert started[0]["kv_events_observed"] is True
    # ... and SGLang's GPU-default scheduler: batch N+1 launched before batch N's result
    assert sglang_run["loops"] == ["event_loop_overlap"]
    stopped = [ev.payload(e) for e in sglang_run["events"] if ev.payload_type(e) == ev.ENGINE_STOPPED]
    assert len(stopped) == 1, stopped
    seqs = sorted(e["seq"] for e in sglang_run["events"] if e["stream"] == ev.CORE_STREAM)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def metric_families(text: str) -> set[str]:
    """The metric families a Prometheus text exposition declares (its ``# TYPE`` lines)."""
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def test_sglang_metrics_same_without_the_plugin(sglang_run: dict[str, Any], e2e_dir: Path) -> None:
    """SGLang's ``/metrics`` declares the same ``sglang:`` families with the plugin loaded as
    without it (the plugin adds only its own ``sparseety:`` ones).

    SGLang's launcher imports the scheduler module before it sets ``PROMETHEUS_MULTIPROC_DIR``;
    the plugin's hook on that module once loaded ``prometheus_client`` there, and the launcher's
    tokenizer metrics (``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total``, ...)
    were then missing from ``/metrics``. A server without the plugin (no ``SPARSEETY_*``) runs
    the same workload and is compared with the module's server, which has it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
    server = SglangServer(
        SGLANG_PYTHON, tiny_model("llama"), env, e2e_dir / "bare.log", max_total_tokens=MAX_TOTAL_TOKENS
    )
    try:
        run_workload(server)
        bare = metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text)
    finally:
        server.close()
    with_plugin = metric_families(sglang_run["metrics_text"])
    assert "sglang:prompt_tokens" in bare or "sglang:prompt_tokens_total" in bare, sorted(bare)
    ours = {name for name in with_plugin if name.startswith("sparseety:")}
    assert ours and not {name for name in bare if name.startswith("sparseety:")}
    assert with_plugin - ours == bare, {
        "missing": sorted(bare - with_plugin),
        "extra": sorted(with_plugin - ours - bare),
    }


def test_the_plugin_leaves_prometheus_client_to_sglangs_launcher(tmp_path: Path) -> None:
    """The cause, without a server: in a launcher with the plugin configured, importing SGLang's
    engine entry point (which imports the scheduler module, firing the plugin's hook) leaves
    ``prometheus_client`` unimported, so SGLang can still set ``PROMETHEUS_MULTIPROC_DIR`` first."""
    code = (
        "import sys\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "import sglang.srt.entrypoints.http_server\n"
        "assert 'sglang.srt.managers.scheduler' in sys.modules\n"
        "print('prometheus_client' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
    env.update({"SPARSEETY_KAFKA_BOOTSTRAP": "127.0.0.1:1", "SGLANG_USE_CPU_ENGINE": "1"})
    run = subprocess.run(
        [str(SGLANG_PYTHON), "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "False", run.stdout
