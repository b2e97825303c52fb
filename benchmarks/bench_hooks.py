"""Cost of the vLLM plugin's hooks on the engine's step loop, with synthetic scheduler outputs.

The real patched ``Scheduler.schedule`` / ``update_from_output`` / ``_free_request`` wrappers
(``producers/vllm/plugin.py``) are installed on a stand-in scheduler whose own methods return
prebuilt vLLM objects (``SchedulerOutput``, ``CachedRequestData``, ``NewRequestData``,
``EngineCoreOutput`` from vLLM 0.32) in ~0 time, so the measured time is what the hooks add to
a step. The emitter is real (background thread, Avro encoding) with a Kafka client that
acknowledges at once; its thread competes for the GIL as it would in the engine.

Step shapes, at batch sizes 1/16/64/256:

* ``decode``: every request decodes one token (the steady state);
* ``decode+spec``: every request verifies 3 ngram drafts (accepted counts read before vLLM trims);
* ``admit+finish``: every request is admitted in the step and another finishes (worst case:
  per-request work on the hot path).

Also reported: the emitter thread's CPU per step (building the payloads, envelopes, validation,
Avro encoding, the ledger, the GIL courtesy), off the step loop but, on a CPU-only host, taken
from the engine's cores. Target (DESIGN §9): hot path ≤ 1 µs per request per step + ≤ 20 µs per step.

    .venv/bin/python benchmarks/bench_hooks.py [--steps 3000]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import tempfile
import time
from types import SimpleNamespace
from typing import Any

from sparseety.config import load_config
from sparseety.producers.emitter import Emitter
from sparseety.producers.privacy import PromptPolicy
from sparseety.producers.vllm import plugin
from sparseety.producers.vllm.records import Admission, RecordBuilder
from sparseety.producers.vllm.session import EngineSession


class _Instant:
    """A Kafka client that acknowledges every message at the next poll."""

    def __init__(self, conf: dict[str, Any]) -> None:
        self.queue: list[Any] = []

    def produce(self, topic: str, value: bytes, key: bytes, on_delivery: Any) -> None:
        self.queue.append((value, on_delivery))

    def poll(self, timeout: float = 0) -> int:
        q, self.queue = self.queue, []
        for value, cb in q:
            cb(None, SimpleNamespace(value=lambda v=value: v))
        if not q and timeout:
            time.sleep(timeout)
        return len(q)

    def purge(self) -> None:
        pass

    def flush(self, timeout: float = 0) -> int:
        return self.poll()

    def __len__(self) -> int:
        return len(self.queue)


def _request(rid: str, prompt_len: int) -> Any:
    req = SimpleNamespace(
        request_id=rid,
        prompt_token_ids=list(range(prompt_len)),
        num_prompt_tokens=prompt_len,
        block_hashes=[bytes([i % 256]) * 32 for i in range(prompt_len // 32)],
        sampling_params=SimpleNamespace(max_tokens=128, extra_args={"tenant": "acme"}),
        lora_request=None,
        priority=0,
        arrival_time=time.time(),
        prefill_stats=SimpleNamespace(num_cached_tokens=64),
        stop_reason=None,
        num_output_tokens=16,
        num_preemptions=0,
    )
    req.is_finished = lambda: False
    req.get_finished_reason = lambda: "FinishReason.LENGTH"
    return req


def _step(shape: str, batch: int, generation: int) -> tuple[Any, Any, Any, list[Any]]:
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput

    rids = [f"g{generation}-r{i}" for i in range(batch)]
    admit = shape == "admit+finish"
    spec = shape == "decode+spec"
    new = [
        NewRequestData(
            req_id=r,
            prompt_token_ids=list(range(256)),
            mm_features=[],
            sampling_params=None,
            pooling_params=None,
            block_ids=([],),
            num_computed_tokens=64,
            lora_request=None,
        )
        for r in (rids if admit else [])
    ]
    cached = CachedRequestData(
        req_ids=[] if admit else list(rids),
        resumed_req_ids=set(),
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[None] * (0 if admit else batch),
        num_computed_tokens=[] if admit else [300 + i for i in range(batch)],
        num_output_tokens=[] if admit else [10] * batch,
    )
    n = 192 if admit else (4 if spec else 1)
    so = SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict.fromkeys(rids, n),
        total_num_scheduled_tokens=n * batch,
        scheduled_spec_decode_tokens={r: [1, 2, 3] for r in rids} if spec else {},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[0],
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )
    sampled = [[7, 8, 9][: 1 + i % 3] for i in range(batch)] if spec else [[7] for _ in range(batch)]
    mro = ModelRunnerOutput(
        req_ids=list(rids),
        req_id_to_index={r: i for i, r in enumerate(rids)},
        sampled_token_ids=sampled,
    )
    outs = {
        0: EngineCoreOutputs(
            outputs=[
                EngineCoreOutput(request_id=r, new_token_ids=s) for r, s in zip(rids, sampled, strict=True)
            ]
        )
    }
    requests = [_request(r, 256) for r in rids]
    return so, mro, outs, requests


class _Scheduler:
    """Stand-in for vLLM's Scheduler: its methods hand back prebuilt objects."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.next: tuple[Any, Any] = (None, None)
        self.finishing: list[Any] = []

    def schedule(self, throttle_prefills: bool = False) -> Any:
        return self.next[0]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        for req in self.finishing:
            self._free_request(req)
        return self.next[1]

    def _free_request(self, request: Any, delay_free_blocks: bool = False) -> Any:
        return None, None

    def shutdown(self) -> None:
        pass


def measure(shape: str, batch: int, steps: int, tmp: str) -> tuple[float, float, float]:
    """(median hot-path µs per step, p90, emitter thread CPU µs per step)."""
    cfg = load_config(data_dir=tmp, producer={"heartbeat_interval_s": 3600, "queue_max_events": 1_000_000})
    emitter = Emitter(cfg, engine_name="bench", epoch="1", producer_factory=_Instant)
    plain = _Scheduler()
    hooked_cls = type("HookedScheduler", (_Scheduler,), {})
    plugin._patch_scheduler(hooked_cls)
    hooked = object.__new__(hooked_cls)
    _Scheduler.__init__(hooked)
    builder = RecordBuilder(
        policy=PromptPolicy(cfg.privacy),
        served_model_name="m",
        block_size=32,
        hash_block_size=32,
        group_kinds=["full_attention"],
        spec_enabled=shape == "decode+spec",
    )
    session = EngineSession(cfg, hooked, emitter, builder)
    hooked._sparseety = session
    pool = [_step(shape, batch, g) for g in range(16)]
    admit = shape == "admit+finish"
    costs = []
    gc.collect()
    for i in range(steps):
        so, mro, outs, requests = pool[i % len(pool)]
        so.__dict__.pop("sparseety_step", None)
        for s in (plain, hooked):
            s.next = (so, outs)
            if admit:
                s.requests = {r.request_id: r for r in requests}
                s.finishing = requests
        t0 = time.perf_counter_ns()
        plain.update_from_output(plain.schedule(), mro)
        t1 = time.perf_counter_ns()
        if admit:
            session._live.update(r.request_id for r in requests)
        t2 = time.perf_counter_ns()
        hooked.update_from_output(hooked.schedule(), mro)
        t3 = time.perf_counter_ns()
        costs.append((t3 - t2) - (t1 - t0))
    costs.sort()
    emitter.wait_idle(120)
    emitter.close()
    # The emitter thread's CPU per step, single-threaded: the hand-offs one step makes (its
    # admissions, its StepBatch, its finishes) through the real background path (build, envelope,
    # validation, Avro encoding, the ledger, the GIL courtesy, the delivery callbacks), timed
    # with the thread's CPU clock: on a CPU-only host each of these CPU-seconds is one the
    # engine's processes lose (the wall clock would also count the yields' sleeping).
    # A stopped emitter of its own (no spill left by the loop above, no thread competing).
    bg_emitter = Emitter(cfg, engine_name="bench-bg", epoch="1", producer_factory=_Instant)
    supervisor = bg_emitter._supervisor
    while supervisor._encoder is None or not supervisor.link.connected:
        time.sleep(0.01)
    bg_emitter.close()
    link = supervisor.link
    so, mro, outs, requests = pool[0]
    spec = session.before_update(so, mro)
    session._in_update = False
    step_item = (0, 0, 0, 0, builder.step, (so, outs, spec, 1, 0, 10, frozenset()))
    items = [step_item]
    if admit:
        started = (0, len(requests), 0, 0, builder.requests_started, ([Admission(r, 64) for r in requests],))
        finished = (0, len(requests), 0, 0, builder.requests_finished, (requests,))
        items = [started, step_item, finished]
    bg = []
    for _ in range(max(20, min(steps // 10, 300))):
        supervisor._yield_before_next = False  # the emitter keeps up: it waits between steps
        t0 = time.thread_time_ns()
        supervisor._handle_batch(items)
        link.poll(0)
        bg.append(time.thread_time_ns() - t0)
    return statistics.median(costs) / 1000, costs[int(len(costs) * 0.9)] / 1000, statistics.median(bg) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batches", default="1,16,64,256")
    args = parser.parse_args()
    import vllm

    print(f"python {platform.python_version()}, vllm {vllm.__version__}, {platform.machine()}")
    print(
        "| step shape | batch | hot path µs/step (median) | p90 | per request µs | budget µs "
        "(1/req + 20) | emitter thread CPU µs/step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in ("decode", "decode+spec", "admit+finish"):
            for batch in map(int, args.batches.split(",")):
                med, p90, bg = measure(shape, batch, args.steps, tmp)
                row = [shape, batch, f"{med:.1f}", f"{p90:.1f}", f"{med / batch:.2f}", batch + 20, round(bg)]
                print("| " + " | ".join(map(str, row)) + " |", flush=True)


if __name__ == "__main__":
    main()
