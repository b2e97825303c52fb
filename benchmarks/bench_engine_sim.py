"""The plugin's CPU against vLLM's own, in vLLM's real engine loop, where the model costs nothing.

On the CPU build of vLLM with a tiny model the plugin's cost drowns in the model's noise
(``bench_engine.py``). Here vLLM's real ``EngineCore`` runs in its GPU-default mode (async
scheduling, Model Runner V2's output shape) with the simulated executor of ``tests/harness``:
what is left on the engine-core thread is vLLM's own scheduling and bookkeeping, the plugin's
hooks, and the simulated executor (timed and taken out). The plugin publishes to a real broker
(embedded Tansu) through its real emitter thread and librdkafka.

For each batch size (steady decode: every request in the batch decodes one token a step) the
rounds alternate plugin on / plugin off in one process, each on a freshly built engine core.
Per step it reports, medians over rounds:

* ``vllm``: the engine-core thread's CPU less the simulated executor's (and, when on, the hooks');
* ``hooks``: CPU inside the plugin's hooks on the step loop (``EngineSession.on_*``), also per
  request;
* ``emitter``: the plugin's emitter thread (payload build, Avro, hand-off to librdkafka);
* ``rdkafka``: librdkafka's own threads (compression, sends), for completeness;
* ``on-off``: the engine thread's CPU with the plugin on less with it off (a cross-check of
  ``hooks`` that includes the wrappers themselves).

Targets (DESIGN §9): hooks ≤ 1 µs per request per step + 20 µs per step; hooks + emitter ≤ 5 % of
vLLM's own engine-core CPU per step at batch 256.

    .venv/bin/python benchmarks/bench_engine_sim.py [--quick] [--batches 1,64,256] [--steps 400]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HOOKS = ("on_schedule", "before_update", "after_update", "on_free", "on_kv_batch")


def _thread_cpu_ns(thread: threading.Thread) -> int:
    assert thread.ident is not None
    return time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))


def _rdkafka_cpu_s() -> float:
    """CPU seconds of this process's librdkafka threads (``rdk:*``), from /proc."""
    total = 0
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            if not comm.startswith("rdk:"):
                continue
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            continue
    return total / tick


class _Timed:
    """Wraps methods of one object with thread-CPU accumulators."""

    def __init__(self, obj: Any, names: tuple[str, ...]) -> None:
        self.ns = 0
        for name in names:
            setattr(obj, name, self._wrap(getattr(obj, name)))

    def _wrap(self, fn: Any) -> Any:
        clock = time.thread_time_ns

        def timed(*a: Any, **k: Any) -> Any:
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                self.ns += clock() - t0

        return timed


def one_round(model: Path, batch: int, steps: int, on: bool) -> dict[str, float]:
    from tests.harness.engine import Mode, build, request

    mode = Mode(async_scheduling=True, v2=True, pressure=False)
    h = build(
        mode,
        model,
        truth=False,  # the recorder is test instrumentation, not vLLM's own work
        max_num_seqs=batch,
        max_model_len=4096,
        max_num_batched_tokens=max(2048, batch * 40),
        num_gpu_blocks_override=batch * 4096 // mode.block_size + 64,
    )
    core = h.core
    session = core.scheduler._sparseety
    if not on and session is not None:
        core.scheduler._sparseety = None  # the hooks call straight through
        session.stop("bench-off")
        session = None
    sim = _Timed(h.executor, ("execute_model", "sample_tokens"))
    hooks = _Timed(session, HOOKS) if session is not None else None
    for i in range(batch):
        ecr = request(f"b{i}", list(range(10, 42)), max_tokens=100_000, ignore_eos=True)
        req, wave = core.preprocess_add_request(ecr)
        core.add_request(req, wave)
    for _ in range(20):  # admissions and prefill out of the way
        core.step_fn()
    emitter = session.emitter if session is not None else None
    em_thread = emitter._supervisor.thread if emitter is not None else None
    sim.ns = 0
    if hooks is not None:
        hooks.ns = 0
    e0 = _thread_cpu_ns(em_thread) if em_thread is not None else 0
    k0 = _rdkafka_cpu_s()
    t0 = time.thread_time_ns()
    for _ in range(steps):
        _, executed = core.step_fn()
        core.post_step(executed)
    engine_ns = time.thread_time_ns() - t0
    if emitter is not None:
        deadline = time.monotonic() + 30
        while emitter.queued and time.monotonic() < deadline:  # what the steps handed over
            time.sleep(0.01)
    emit_ns = (_thread_cpu_ns(em_thread) - e0) if em_thread is not None else 0
    rdk_s = _rdkafka_cpu_s() - k0
    hook_ns = hooks.ns if hooks is not None else 0
    core.shutdown()
    return {
        "engine_us": engine_ns / steps / 1e3,
        "vllm_us": (engine_ns - sim.ns - hook_ns) / steps / 1e3,
        "hooks_us": hook_ns / steps / 1e3,
        "emitter_us": emit_ns / steps / 1e3,
        "rdkafka_us": rdk_s * 1e6 / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 200 steps (about a minute)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 3, 200
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from sparseety.broker import EmbeddedBroker
    from sparseety.config import load_config, to_env
    from sparseety.kafka import ensure_topics
    from sparseety.stack.tiny_models import build_tiny_model
    from tests.e2e.conftest import MODEL_CACHE, environ
    from tests.helpers import free_port

    model = build_tiny_model("llama", MODEL_CACHE / "llama")
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"bench_engine_sim: vLLM {__import__('vllm').__version__} EngineCore (async scheduling, "
        f"Model Runner V2 shape), simulated executor; {platform.machine()}, {os.cpu_count()} cores; "
        f"{args.rounds} rounds x {args.steps} steps per batch size, plugin on/off interleaved",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="sparseety-bench-sim-") as tmp:
        cfg = load_config(data_dir=tmp, broker={"port": free_port()})
        broker = EmbeddedBroker(cfg)
        broker.start(create_topics=False)
        try:
            ecfg = broker.client_config().replace(
                data_dir=tmp,
                topics={
                    **cfg.topics.model_dump(),
                    "engine_events": "bench-sim.engine-events",
                    "partitions": 1,
                },
                producer={"engine_name": "bench-sim"},
            )
            ensure_topics(ecfg, [ecfg.topics.engine_events])
            with environ(to_env(ecfg)):
                for batch in batches:
                    on: list[dict[str, float]] = []
                    off: list[dict[str, float]] = []
                    for _ in range(args.rounds):
                        on.append(one_round(model, batch, args.steps, True))
                        off.append(one_round(model, batch, args.steps, False))

                    def med(runs: list[dict[str, float]], key: str) -> float:
                        return statistics.median(r[key] for r in runs)

                    row = {
                        "batch": batch,
                        "vllm_us": med(off, "vllm_us"),
                        "vllm_on_us": med(on, "vllm_us"),
                        "hooks_us": med(on, "hooks_us"),
                        "emitter_us": med(on, "emitter_us"),
                        "rdkafka_us": med(on, "rdkafka_us"),
                        "on_off_us": med(on, "engine_us") - med(off, "engine_us"),
                    }
                    row["hooks_per_req"] = row["hooks_us"] / batch
                    row["ratio"] = (row["hooks_us"] + row["emitter_us"]) / row["vllm_us"]
                    rows.append(row)
                    print(
                        f"batch {batch:4d}: vllm {row['vllm_us']:8.1f} us/step "
                        f"(on: {row['vllm_on_us']:.1f}); "
                        f"hooks {row['hooks_us']:7.1f} us/step = {row['hooks_per_req']:.2f} us/request; "
                        f"emitter {row['emitter_us']:7.1f}; rdkafka {row['rdkafka_us']:6.1f}; "
                        f"on-off {row['on_off_us']:+7.1f}; (hooks+emitter)/vllm {row['ratio']:.3f}",
                        flush=True,
                    )
        finally:
            broker.stop()
    big = max(rows, key=lambda r: r["batch"])
    print(
        f"bench_engine_sim: hooks {big['hooks_per_req']:.2f} us/request/step; "
        f"plugin/engine cpu {big['ratio']:.3f} at batch {big['batch']}"
    )


if __name__ == "__main__":
    main()
