"""vLLM's real engine core in its GPU-default modes, on this CPU, with the simulated executor.

:func:`build` makes a ``VllmConfig`` the way ``vllm serve`` does (``EngineArgs``), then sets
what the CPU platform overrides (``vllm/platforms/cpu.py`` turns async scheduling off; without
Triton ``VllmConfig.use_v2_model_runner`` is False) back to the GPU defaults the mode asks for,
and constructs ``vllm.v1.engine.core.EngineCore`` with :class:`~tests.harness.sim_executor.
SimExecutor`. ``EngineCore.__init__`` loads the ``vllm.general_plugins`` entry points, which is
how the SparSEEty plugin gets in, exactly as in a served engine. :func:`drive` then plays the
role of ``EngineCoreProc.run_busy_loop``: add requests, call ``step_fn`` (``step`` or
``step_with_batch_queue``) while there is work, collect the outputs.

Test and benchmark code only: the overrides would be wrong on a real CPU engine.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness.sim_executor import PENDING, SHAPES, SimExecutor, SimSettings
from tests.harness.truth import HarnessTruth


@dataclass(frozen=True)
class Mode:
    """One point of the harness matrix (``docs/vllm-plugin.md``, "Modes verified")."""

    async_scheduling: bool = True
    v2: bool = True  # Model Runner V2's output shape: resumed requests in scheduled_new_reqs
    spec: str | None = None  # None, "ngram", "eagle"
    pressure: bool = False  # a KV cache small enough to preempt and evict
    shape: str = "full"  # tests.harness.sim_executor.SHAPES
    hybrid_manager: bool = True  # False: --disable-hybrid-kv-cache-manager
    pd_consumer: bool = False  # decode side of P/D: a KV connector with external hits
    block_size: int = 16
    num_spec_tokens: int = 3

    @property
    def name(self) -> str:
        parts = [
            "async" if self.async_scheduling else "sync",
            "v2" if self.v2 else "v1",
            self.spec or "nospec",
            "pressure" if self.pressure else "roomy",
            self.shape,
        ]
        if not self.hybrid_manager:
            parts.append("nohybrid")
        if self.pd_consumer:
            parts.append("pd")
        return "-".join(parts)


@dataclass
class Harness:
    """A built engine core, its executor and the truth recorded in it."""

    mode: Mode
    core: Any
    executor: SimExecutor
    truth: HarnessTruth
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    steps: int = 0
    #: What vLLM itself reported: per request the PrefillStats of its first admission, and the
    #: engine's spec-decoding counters and preemption events summed over the run.
    prefill: dict[str, Any] = field(default_factory=dict)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    preempted_events: int = 0

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    def shutdown(self) -> None:
        self.core.shutdown()


@contextlib.contextmanager
def _v2_model_runner(on: bool) -> Iterator[None]:
    """``VLLM_USE_V2_MODEL_RUNNER`` while the engine core is built (vLLM reads it through its
    envs cache, which ``EngineCore.__init__`` enables: reset it first)."""
    import vllm.envs as envs

    old = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if on else "0"
    envs.disable_envs_cache()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = old
        envs.disable_envs_cache()


def engine_args(mode: Mode, model: Path, **overrides: Any) -> dict[str, Any]:
    """``EngineArgs`` keywords for ``mode`` (what a ``vllm serve`` command line would say)."""
    # Under pressure: 640 token slots per KV-cache group (the e2e truth workload's cache is
    # 768), so that the workload both preempts and evicts.
    groups = {"full": 1, "sliding": 1, "hybrid": 3, "chunked": 3}[mode.shape]
    blocks = groups * 640 // mode.block_size if mode.pressure else 8192
    args: dict[str, Any] = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "block_size": mode.block_size,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "max_model_len": 256,
        "max_num_batched_tokens": 256,
        "max_num_seqs": 6 if mode.pressure else 64,
        "num_gpu_blocks_override": blocks,
        "enforce_eager": True,
        "distributed_executor_backend": SimExecutor,
        "kv_events_config": {"enable_kv_cache_events": True, "publisher": "null"},
        "disable_hybrid_kv_cache_manager": not mode.hybrid_manager,
        "disable_log_stats": False,
    }
    if mode.spec == "ngram":
        args["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": mode.num_spec_tokens,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    elif mode.spec == "eagle":
        # A draft model proposes k tokens every step from the model runner, as EAGLE/MTP do;
        # the simulated executor stands in for both models, so the tiny checkpoint serves as
        # the draft's config.
        args["speculative_config"] = {
            "method": "draft_model",
            "model": str(model),
            "num_speculative_tokens": mode.num_spec_tokens,
        }
    if mode.pd_consumer:
        # vLLM's own decode-side connector: every prompt token past the local hit but the
        # last is "loaded" from a prefill node (synchronously).
        args["kv_transfer_config"] = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"}
    args.update(overrides)
    return args


def build(
    mode: Mode, model: Path, sim: SimSettings | None = None, *, truth: bool = True, **overrides: Any
) -> Harness:
    """The engine core for ``mode`` (the plugin hooks it when ``SPARSEETY_*`` is set); with
    ``truth`` the ground-truth recorder wraps its scheduler (benchmarks leave it out)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core import EngineCore

    sim = sim or SimSettings()
    sim.shape = mode.shape
    sim.drafter = mode.spec
    sim.num_spec_tokens = mode.num_spec_tokens if mode.spec else 0
    config = EngineArgs(**engine_args(mode, model, **overrides)).create_engine_config()
    # The GPU defaults the CPU platform turned off (vllm/platforms/cpu.py).
    config.scheduler_config.async_scheduling = mode.async_scheduling
    with _v2_model_runner(mode.v2):
        assert config.use_v2_model_runner is mode.v2
        PENDING.append(sim)
        core = EngineCore(config, SimExecutor, log_stats=True)
        assert core.scheduler.use_v2_model_runner is mode.v2
    executor = core.model_executor
    assert isinstance(executor, SimExecutor)
    recorder = HarnessTruth(core.scheduler) if truth else None
    if recorder is not None:
        recorder.attention_groups = attention_groups(mode.shape)
        executor.sim.observer = recorder
    return Harness(mode=mode, core=core, executor=executor, truth=recorder)  # type: ignore[arg-type]


def long_context_model(base: Path, positions: int = 262_144) -> Path:
    """A config-only copy of ``base`` whose position limit allows long requests (the harness
    loads no weights and no tokenizer: ``config.json`` is all vLLM reads)."""
    import json

    out = base.parent / f"{base.name}-ctx{positions}"
    config = json.loads((base / "config.json").read_text())
    config["max_position_embeddings"] = positions
    out.mkdir(parents=True, exist_ok=True)
    target = out / "config.json"
    text = json.dumps(config, indent=1)
    if not target.exists() or target.read_text() != text:
        target.write_text(text)
    return out


def attention_groups(shape: str) -> list[dict[str, Any]]:
    """The model's layers grouped by attention reach (what the attention computes, whatever
    the KV-cache manager makes of them)."""
    by: dict[tuple[str, int | None], int] = {}
    for kind, size in SHAPES[shape]:
        by[(kind, size)] = by.get((kind, size), 0) + 1
    return [
        {
            "layers": layers,
            "sliding_window": size if kind == "sliding" else None,
            "attention_chunk_size": size if kind == "chunked" else None,
        }
        for (kind, size), layers in by.items()
    ]


def request(
    rid: str,
    prompt: list[int],
    *,
    tenant: str = "",
    extra: dict[str, Any] | None = None,
    external_req_id: str | None = None,
    **sampling: Any,
) -> Any:
    """An ``EngineCoreRequest`` as vLLM's front end builds it (tenant and ``extra`` in
    ``extra_args``; ``external_req_id`` defaults to ``rid``)."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    sampling.setdefault("temperature", 0.0)
    extra_args = {**(extra or {}), **({"tenant": tenant} if tenant else {})}
    params = SamplingParams(extra_args=extra_args or None, **sampling)
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=list(prompt),
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id=external_req_id or rid,
    )


def drive(h: Harness, phases: list[list[Any]], *, max_steps: int = 200_000) -> Harness:
    """Add each phase's requests and step until they all finished (the busy loop's job)."""
    from vllm.v1.engine import EngineCoreEventType

    core = h.core
    for phase in phases:
        for ecr in phase:
            req, wave = core.preprocess_add_request(ecr)
            core.add_request(req, wave)
        while core.scheduler.has_requests() or core.batch_queue:
            outputs, executed = core.step_fn()
            core.post_step(executed)
            h.steps += 1
            if h.steps > max_steps:
                raise RuntimeError(f"{h.mode.name}: no end after {max_steps} steps")
            for eco in (outputs or {}).values():
                stats = eco.scheduler_stats
                if stats is not None and stats.spec_decoding_stats is not None:
                    h.spec_draft_tokens += stats.spec_decoding_stats.num_draft_tokens
                    h.spec_accepted_tokens += stats.spec_decoding_stats.num_accepted_tokens
                for o in eco.outputs:
                    if o.prefill_stats is not None and o.request_id not in h.prefill:
                        h.prefill[o.request_id] = o.prefill_stats
                    h.preempted_events += sum(
                        1 for e in o.events or () if e.type == EngineCoreEventType.PREEMPTED
                    )
                    h.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                    if o.finish_reason is not None:
                        h.finish[o.request_id] = str(o.finish_reason)
    return h
