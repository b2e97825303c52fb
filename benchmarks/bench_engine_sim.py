"""The plugin's CPU against vLLM's own, in vLLM's real engine loop, where the model costs nothing.

On the CPU build of vLLM with a tiny model the plugin's cost drowns in the model's noise
(``bench_engine.py``). Here vLLM's real ``EngineCore`` runs in its GPU-default mode (async
scheduling, Model Runner V2's output shape) with the simulated executor of ``tests/harness``:
what is left on the engine-core thread is vLLM's own scheduling and bookkeeping, the plugin's
hooks, and the simulated executor (timed and taken out). The plugin publishes to a real broker
(embedded Tansu) through its real relay (``producers/relay.py``, a child process) and librdkafka.

**CPU** (no modelled GPU): for each batch size (steady decode: every request in the batch decodes
one token a step) the rounds alternate plugin on / plugin off in one process, each on a freshly
built engine core. Per step, medians over rounds:

* ``vllm``: the engine-core thread's CPU less the simulated executor's (and, when on, the hooks');
* ``hooks``: CPU inside the plugin's hooks on the step loop (``EngineSession.on_*``);
* ``in-proc``: everything else the plugin runs in the engine process: the shipper thread
  (builds payloads, writes frames) and the thread that reads the relay's reports;
* ``relay``: the relay process's CPU (Avro, ledger, librdkafka), and its peak RSS;
* ``thread on/off``: the engine-core thread's CPU (less the executor's) with the plugin on over
  off, and the same for two plugin-off rounds (A/A).

**Wall clock** (a modelled GPU stream, ``SimSettings.gpu_stream_s``: a step's result is ready a
set time after the stream is free, and the wait releases the GIL): output tokens/s and TPOT
(the interval between steps that return outputs) with the plugin on, off, and off again (A/A).

Targets (issue 32): thread on/off ≤ 1.02 at every batch; (hooks + in-proc) / vllm ≤ 0.02 at batch
256 and ≤ 0.10 at batch 1; wall tokens/s on/off ≥ 0.99 at every point; hooks ≤ 1 µs per
request per step + 20 µs per step.

    .venv/bin/python benchmarks/bench_engine_sim.py [--quick] [--batches 1,64,256] [--steps 400]
"""

from __future__ import annotations

import argparse
import itertools
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


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid``, from /proc (10 ms ticks)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def one_round(model: Path, batch: int, steps: int, on: bool, gpu_ms: float = 0.0) -> dict[str, float]:
    from tests.harness.engine import Mode, build, request
    from tests.harness.sim_executor import SimSettings

    mode = Mode(async_scheduling=True, v2=True, pressure=False)
    h = build(
        mode,
        model,
        SimSettings(gpu_stream_s=gpu_ms / 1e3),
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
    emitter_idle = emitter.wait_idle(30) if emitter is not None else True  # the relay runs
    shipper = emitter._shipper if emitter is not None else None
    assert emitter is None or shipper is not None, "the plugin runs in thread mode"
    relay = shipper._relay if shipper is not None else None
    threads = [shipper.thread, relay.reader] if shipper is not None and relay is not None else []
    pid = relay.proc.pid if relay is not None else 0
    sim.ns = 0
    if hooks is not None:
        hooks.ns = 0
    c0 = sum(_thread_cpu_ns(t) for t in threads)
    r0 = _proc_cpu_s(pid) if pid else 0.0
    t0 = time.thread_time_ns()
    w0 = time.monotonic()
    out_at: list[float] = []
    for _ in range(steps):
        outputs, executed = core.step_fn()
        core.post_step(executed)
        if outputs:
            out_at.append(time.monotonic())
    engine_ns = time.thread_time_ns() - t0
    wall_s = time.monotonic() - w0
    if emitter is not None:  # what the steps handed over, through the relay to Kafka
        emitter_idle = emitter.wait_idle(60) and emitter_idle
    in_ns = sum(_thread_cpu_ns(t) for t in threads) - c0
    relay_s = (_proc_cpu_s(pid) - r0) if pid else 0.0
    rss = _peak_rss_mib(pid) if pid else 0.0
    hook_ns = hooks.ns if hooks is not None else 0
    dropped = emitter.counters()["dropped"] if emitter is not None else 0
    core.shutdown()
    gaps = [b - a for a, b in itertools.pairwise(out_at)]
    return {
        "engine_us": (engine_ns - sim.ns) / steps / 1e3,
        "vllm_us": (engine_ns - sim.ns - hook_ns) / steps / 1e3,
        "hooks_us": hook_ns / steps / 1e3,
        "inproc_us": in_ns / steps / 1e3,
        "relay_us": relay_s * 1e6 / steps,
        "relay_rss_mib": rss,
        "tokens_per_s": batch * len(out_at) / wall_s,
        "tpot_p50_ms": _pct(gaps, 0.5) * 1e3,
        "tpot_p99_ms": _pct(gaps, 0.99) * 1e3,
        "dropped": dropped,
        "delivered": float(emitter_idle),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--wall", default="8:6.5,256:25,256:1", help="batch:GPU-step-ms points for the wall-clock part"
    )
    parser.add_argument("--wall-rounds", type=int, default=7)
    parser.add_argument("--wall-steps", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 200 steps (a few minutes)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.wall_rounds, args.wall_steps = 3, 200, 3, 200
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from sparseety.config import to_env
    from sparseety.kafka import ensure_topics
    from sparseety.stack.tiny_models import build_tiny_model
    from tests.e2e.conftest import MODEL_CACHE, environ
    from tests.helpers import running_broker

    model = build_tiny_model("llama", MODEL_CACHE / "llama")
    batches = [int(b) for b in args.batches.split(",")]
    wall = [(int(b), float(ms)) for b, ms in (p.split(":") for p in args.wall.split(",") if p)]
    print(
        f"bench_engine_sim: vLLM {__import__('vllm').__version__} EngineCore (async scheduling, "
        f"Model Runner V2 shape), simulated executor; {platform.machine()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.1f}; {args.rounds} rounds x {args.steps} steps per batch size, "
        "plugin on/off/off interleaved",
        flush=True,
    )

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    rows, walls = [], []
    with (
        tempfile.TemporaryDirectory(prefix="sparseety-bench-sim-") as tmp,
        running_broker(Path(tmp)) as broker,
    ):
        cfg = broker.client_config()
        ecfg = cfg.replace(
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
                aa: list[dict[str, float]] = []
                for _ in range(args.rounds):
                    on.append(one_round(model, batch, args.steps, True))
                    off.append(one_round(model, batch, args.steps, False))
                    aa.append(one_round(model, batch, args.steps, False))
                row = {
                    "batch": batch,
                    "vllm_us": med(off, "vllm_us"),
                    "hooks_us": med(on, "hooks_us"),
                    "inproc_us": med(on, "inproc_us"),
                    "relay_us": med(on, "relay_us"),
                    "relay_rss_mib": max(r["relay_rss_mib"] for r in on),
                    "thread_ratio": med(on, "engine_us") / med(off, "engine_us"),
                    "aa_ratio": med(aa, "engine_us") / med(off, "engine_us"),
                    "dropped": sum(r["dropped"] for r in on),
                }
                row["hooks_per_req"] = row["hooks_us"] / batch
                row["ratio"] = (row["hooks_us"] + row["inproc_us"]) / row["vllm_us"]
                row["relay_per_k"] = row["relay_us"] / batch * 1000 / 1e3  # ms per 1,000 request-steps
                rows.append(row)
                print(
                    f"batch {batch:4d}: vllm {row['vllm_us']:8.1f} us/step; "
                    f"hooks {row['hooks_us']:6.1f} ({row['hooks_per_req']:.2f}/request); "
                    f"in-proc {row['inproc_us']:6.1f}; (hooks+in-proc)/vllm {row['ratio']:.3f}; "
                    f"thread on/off {row['thread_ratio']:.3f} (A/A {row['aa_ratio']:.3f}); "
                    f"relay {row['relay_us']:7.1f} us/step = {row['relay_per_k']:.2f} ms per 1k "
                    f"request-steps, peak RSS {row['relay_rss_mib']:.0f} MiB; "
                    f"dropped {row['dropped']:.0f}",
                    flush=True,
                )
            for batch, ms in wall:
                on, off, aa = [], [], []
                for _ in range(args.wall_rounds):
                    on.append(one_round(model, batch, args.wall_steps, True, ms))
                    off.append(one_round(model, batch, args.wall_steps, False, ms))
                    aa.append(one_round(model, batch, args.wall_steps, False, ms))
                w = {
                    "batch": batch,
                    "gpu_ms": ms,
                    "tps": med(on, "tokens_per_s") / med(off, "tokens_per_s"),
                    "aa": med(aa, "tokens_per_s") / med(off, "tokens_per_s"),
                    "p50": (med(on, "tpot_p50_ms"), med(off, "tpot_p50_ms"), med(aa, "tpot_p50_ms")),
                    "p99": (med(on, "tpot_p99_ms"), med(off, "tpot_p99_ms"), med(aa, "tpot_p99_ms")),
                    "dropped": sum(r["dropped"] for r in on),
                    "delivered": all(r["delivered"] for r in on),
                }
                walls.append(w)
                print(
                    f"wall batch {batch:4d}, GPU step {ms:g} ms: tokens/s on/off {w['tps']:.3f} "
                    f"(A/A {w['aa']:.3f}); TPOT p50 on/off/A-A "
                    + "/".join(f"{x:.2f}" for x in w["p50"])
                    + " ms, p99 "
                    + "/".join(f"{x:.2f}" for x in w["p99"])
                    + f" ms; dropped {w['dropped']:.0f}, all delivered {w['delivered']}",
                    flush=True,
                )
    big = max(rows, key=lambda r: r["batch"])
    cpu_bound = min(walls, key=lambda w: w["gpu_ms"]) if walls else None
    tail = (
        f"; wall tokens/s on/off {cpu_bound['tps']:.3f} (A/A {cpu_bound['aa']:.3f}) at a "
        f"{cpu_bound['gpu_ms']:g} ms GPU step"
        if cpu_bound
        else ""
    )
    print(
        f"bench_engine_sim: hooks {big['hooks_per_req']:.2f} us/request/step; "
        f"plugin/engine cpu {big['ratio']:.3f} at batch {big['batch']}; "
        f"engine thread on/off {big['thread_ratio']:.3f} at batch {big['batch']}{tail}"
    )


if __name__ == "__main__":
    main()
