"""A simulated executor for vLLM's real engine core: the model runner's bookkeeping, no math.

Test and benchmark support, not product code. :class:`SimExecutor` is an
``vllm.v1.executor.abstract.Executor`` subclass handed to vLLM's own ``EngineCore`` as its
executor class. vLLM then runs everything it runs on a GPU host above the executor: the
``Scheduler`` or ``AsyncScheduler``, the KV-cache manager and block pool, the batch queue of
``step_with_batch_queue``, the plugin's hooks and KV events. What the executor does per step is
what the GPU model runner's bookkeeping does:

* it keeps each request's true KV length (``pos``) itself, as the runner's input batch does. Under
  async scheduling the scheduler's ``num_computed_tokens`` is optimistic: it already counts the
  drafts of a step still in flight, which may be rejected;
* a step whose tokens reach the end of what the request knows samples ``1 + accepted`` tokens
  (accepted drafts by a configurable pattern), a prefill chunk short of it samples nothing;
* sampled token ids are a deterministic function of the request and the position, never EOS, so
  a request stops at ``max_tokens`` or at a ``stop_token_ids`` entry the test picked;
* drafts: under the plain scheduler the engine core asks ``take_draft_token_ids()`` after each
  step (EAGLE/MTP propose ``k`` every step; an ngram proposer proposes ``0..k``, here by a
  deterministic pattern); under async scheduling the scheduler holds ``-1`` placeholders and
  the runner fills them itself, so the executor verifies what the scheduler scheduled;
* a KV connector's worker side reports nothing to wait for (loads are synchronous), so a
  decode-side engine gets its externally matched tokens at once;
* under vLLM's ``ExampleConnector`` (P/D through a shared directory) the executor does what the
  connector's worker side does on a save: the request's directory appears under the shared path,
  named by the connector's own code; the layer files' contents (the model's KV) are no fact of
  accounting and are not written.

Each step's facts go to ``observer`` (the harness truth) in the order the GPU would produce
them: :meth:`Observer.on_execute` with the true start positions, :meth:`Observer.on_sample`
with the accepted drafts.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput

#: Model shapes: one entry per attention layer, ``("full", None)``, ``("sliding", W)`` or
#: ``("chunked", C)``.
SHAPES: dict[str, list[tuple[str, int | None]]] = {
    "full": [("full", None)] * 2,
    "sliding": [("sliding", 64)] * 2,
    "hybrid": [("full", None), ("sliding", 64), ("sliding", 64)],
    "chunked": [("full", None), ("chunked", 96), ("chunked", 96)],
}


def _mix(*parts: object) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def token_at(rid: str, position: int, vocab: int = 512) -> int:
    """The token the simulated model samples at ``position`` of request ``rid`` (never 0-3)."""
    return 4 + _mix(rid, position) % (vocab - 4)


def accept_pattern(rid: str, step: int, k: int) -> int:
    """Default acceptance: 0..k drafts accepted, pseudo-random per request and step."""
    return _mix("accept", rid, step) % (k + 1) if k else 0


class Observer(Protocol):
    def on_execute(self, scheduler_output: Any, starts: dict[str, int]) -> None: ...

    def on_sample(self, scheduler_output: Any, accepted: dict[str, int], sampled: dict[str, int]) -> None: ...


@dataclass
class SimSettings:
    """What the simulated model looks like and how its drafts fare."""

    shape: str = "full"
    num_kv_heads: int = 1
    head_size: int = 64
    dtype: torch.dtype = torch.bfloat16
    #: ``None``, ``"ngram"`` (0..k proposals a step) or ``"eagle"`` (k every step).
    drafter: str | None = None
    num_spec_tokens: int = 0
    accept: Callable[[str, int, int], int] = accept_pattern
    kv_cache_bytes: int = 1 << 30
    observer: Observer | None = None
    #: Seconds a step takes on the "GPU" (0: none; the benchmarks' step time).
    step_time_s: float = 0.0
    #: A modelled GPU stream (0: none): under async scheduling a step's result is ready this
    #: long after the stream is free to run it, and waiting for it releases the GIL, as
    #: vLLM's wait on a real GPU does (``bench_engine_sim.py``'s wall-clock points).
    gpu_stream_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


#: Settings for the next executor built (vLLM constructs the executor class itself).
PENDING: list[SimSettings] = []


@dataclass
class _Req:
    prompt_len: int
    outputs: int = 0  # tokens sampled so far (they survive a preemption)
    pos: int = 0  # true KV length


class SimExecutor(Executor):
    """See the module docstring."""

    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        self.sim = PENDING.pop() if PENDING else SimSettings()
        self.reqs: dict[str, _Req] = {}
        self.step = 0
        self._last: Any = None
        self._last_samplers: list[str] = []
        self._stream_free = 0.0  # when the modelled GPU stream finishes its queued steps
        self._kv_saver: Any = None
        ktc = self.vllm_config.kv_transfer_config
        if ktc is not None and ktc.kv_connector == "ExampleConnector" and ktc.is_kv_producer:
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
            from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

            self._kv_saver = ExampleConnector(self.vllm_config, KVConnectorRole.WORKER, None)  # type: ignore[arg-type]

    # --- set-up -------------------------------------------------------------------------------

    def get_kv_cache_specs(self) -> list[dict[str, KVCacheSpec]]:
        bs = int(self.cache_config.block_size)
        s = self.sim
        common = {
            "block_size": bs,
            "num_kv_heads": s.num_kv_heads,
            "head_size": s.head_size,
            "dtype": s.dtype,
        }
        specs: dict[str, KVCacheSpec] = {}
        for i, (kind, size) in enumerate(SHAPES[s.shape]):
            name = f"model.layers.{i}.self_attn.attn"
            if kind == "full":
                specs[name] = FullAttentionSpec(**common)
            elif kind == "sliding":
                specs[name] = SlidingWindowSpec(sliding_window=int(size or 0), **common)
            else:
                specs[name] = ChunkedLocalAttentionSpec(attention_chunk_size=int(size or 0), **common)
        return [specs]

    def determine_available_memory(self) -> list[int]:
        return [self.sim.kv_cache_bytes]

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        self.kv_cache_config = kv_cache_configs[0]

    def compile_or_warm_up_model(self) -> None:
        pass

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [["NHD"]]

    def set_kv_cache_layout(self, layout_name: str) -> None:
        pass

    def collective_rpc(
        self,
        method: Any,
        timeout: Any = None,
        args: Any = (),
        kwargs: Any = None,
        non_block: bool = False,
        **_: Any,
    ) -> Any:
        return [None]

    def get_kv_connector_handshake_metadata(self) -> list[Any]:
        return []

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    # --- steps --------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        so = scheduler_output
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        if not so.total_num_scheduled_tokens:
            return _done(EMPTY_MODEL_RUNNER_OUTPUT, non_block)
        for nr in so.scheduled_new_reqs:
            state = self.reqs.get(nr.req_id)
            if state is None:  # first admission
                state = self.reqs[nr.req_id] = _Req(prompt_len=len(nr.prompt_token_ids or ()))
            state.pos = int(nr.num_computed_tokens)  # admission, or a resume under Model Runner V2
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            if rid in resumed:
                self.reqs[rid].pos = int(computed)
        if self._kv_saver is not None:
            for meta in getattr(so.kv_connector_metadata, "requests", ()):
                if meta.is_store:  # save_kv_layer's files go into this directory
                    self._kv_saver._generate_foldername_debug(
                        meta.token_ids, meta.mm_hashes, create_folder=True
                    )
        starts = {rid: self.reqs[rid].pos for rid in so.num_scheduled_tokens}
        if self.sim.observer is not None:
            self.sim.observer.on_execute(so, starts)
        self._last = so
        return _done(None, non_block)  # the GPU runner samples in sample_tokens()

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        so, self._last = self._last, None
        self.step += 1
        spec = so.scheduled_spec_decode_tokens or {}
        ids = list(so.num_scheduled_tokens)
        sampled_ids: list[list[int]] = []
        accepted: dict[str, int] = {}
        sampled: dict[str, int] = {}
        samplers = []
        for rid, n in so.num_scheduled_tokens.items():
            state = self.reqs[rid]
            k = len(spec.get(rid, ()))
            known = state.prompt_len + state.outputs
            end = state.pos + n - k
            if end < known:  # a prefill chunk short of the end: nothing sampled
                state.pos = end
                sampled_ids.append([])
                continue
            a = min(self.sim.accept(rid, self.step, k), k) if k else 0
            out = [token_at(rid, state.prompt_len + state.outputs + j) for j in range(1 + a)]
            state.pos = end + a  # rejected drafts' KV is discarded
            state.outputs += len(out)
            accepted[rid] = a
            sampled[rid] = len(out)
            sampled_ids.append(out)
            samplers.append(rid)
        self._last_samplers = samplers
        if self.sim.observer is not None:
            self.sim.observer.on_sample(so, accepted, sampled)
        if self.sim.step_time_s:
            time.sleep(self.sim.step_time_s)
        mro = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled_ids
        )
        if self.vllm_config.kv_transfer_config is not None:
            from vllm.v1.outputs import KVConnectorOutput

            mro.kv_connector_output = KVConnectorOutput()
        if self.sim.gpu_stream_s and non_block:
            ready = max(time.monotonic(), self._stream_free) + self.sim.gpu_stream_s
            self._stream_free = ready
            return _StreamFuture(mro, ready)
        return _done(mro, non_block)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """Plain scheduler only: the drafts the runner proposed for the requests it sampled."""
        s = self.sim
        if not s.drafter or not s.num_spec_tokens or not self._last_samplers:
            return None
        rids, drafts = [], []
        for rid in self._last_samplers:
            k = (
                s.num_spec_tokens
                if s.drafter == "eagle"
                else _mix("ngram", rid, self.step) % (s.num_spec_tokens + 1)
            )
            state = self.reqs.get(rid)
            base = (state.prompt_len + state.outputs) if state else 0
            rids.append(rid)
            drafts.append([token_at(rid, base + j) for j in range(k)])
        return DraftTokenIds(req_ids=rids, draft_token_ids=drafts)


class _StreamFuture(Future[Any]):
    """A step's result on the modelled GPU stream: ready at ``ready_at`` (monotonic s)."""

    def __init__(self, value: Any, ready_at: float) -> None:
        super().__init__()
        self._value = value
        self._ready_at = ready_at

    def done(self) -> bool:
        return time.monotonic() >= self._ready_at

    def result(self, timeout: float | None = None) -> Any:
        wait = self._ready_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # releases the GIL, as a wait on the GPU does
        return self._value


def _done(value: Any, non_block: bool) -> Any:
    if not non_block:
        return value
    f: Future[Any] = Future()
    f.set_result(value)
    return f
