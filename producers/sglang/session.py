"""One SGLang engine epoch in the scheduler process: the hot-path side of the hooks.

Where SGLang's model differs from vLLM's, it is mapped here (docs/streams.md, docs/sglang.md):

* a *step* is one forward batch (``Scheduler.run_batch``): an extend (prefill, chunked prefill,
  or mixed) or a decode batch; its StepBatch is sent after ``process_batch_result``;
* *admission* is a request's first extend batch: ``RequestStarted.num_cached_tokens`` is its
  ``prefix_len`` then (the radix-cache hit, what SGLang adds to ``cached_tokens``);
* *retraction* (``ScheduleBatch.retract_decode``) is a preemption: the retracted requests ride
  on the next StepBatch's ``preempted_req_ids``, and their next extend batch is a resume
  (``resumed_req_ids``), as on vLLM;
* finishes carry SGLang's own totals (``len(origin_input_ids)``, ``len(output_ids)``,
  ``cached_tokens``, ``retraction_count``): the numbers its ``meta_info`` reports;
* radix-cache inserts and evictions (``KVCacheEventRecorder.record_store/record_remove``, called by
  SGLang whether or not its own KV events are on) become KvBlocksStored/KvBlocksRemoved over
  fixed-size blocks (``records.py``).

The hot path only reads lengths and takes references (token arrays SGLang never mutates once a
node or request holds them); hashing and payloads are built on the emitter's thread.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from sparseety import __version__ as sparseety_version
from sparseety import events as ev
from sparseety.config import Config

from .. import plugin_kit
from ..emitter import Emitter, new_epoch
from ..plugin_kit import SessionBase, announce
from ..privacy import PromptPolicy
from .records import HASH_ALGO, Admission, RecordBuilder, RustRun

log = logging.getLogger("sparseety.producer.sglang")

#: Accounting block size when SGLang's radix cache is token-granular (page size 1).
DEFAULT_BLOCK_SIZE = 16
#: SGLang's own health probes (``/health_generate``) are not anybody's requests.
_HEALTH_PREFIX = "HEALTH_CHECK"


def sglang_version() -> str:
    return plugin_kit.installed_version("sglang")


def engine_started(
    scheduler: Any, block_size: int, privacy_mode: str, rust_tee: bool = False
) -> dict[str, Any]:
    """The EngineStarted payload of one SGLang scheduler (tensor-parallel rank 0)."""
    args = scheduler.server_args
    mc = scheduler.model_config
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    served = getattr(args, "served_model_name", None) or args.model_path
    tree = getattr(scheduler, "tree_cache", None)
    num_layers = int(getattr(mc, "num_hidden_layers", 0) or 0)
    return {
        "model": str(args.model_path),
        "served_model_name": str(served),
        "engine_kind": "sglang",
        "engine_version": sglang_version(),
        "sparseety_version": sparseety_version,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "block_size": block_size,
        "enable_prefix_caching": not bool(getattr(tree, "disable", True)),
        "prefix_hash_algo": HASH_ALGO,
        "kv_cache_groups": [
            {
                "kind": "full_attention",
                "sliding_window": None,
                "block_size": block_size,
                "num_layers": num_layers,
                "attention_chunk_size": None,
            }
        ],
        "kv_cache_dtype": str(getattr(args, "kv_cache_dtype", "auto")),
        "dtype": str(getattr(mc, "dtype", "")).removeprefix("torch."),
        **_spec(args),
        "moe_num_experts": 0,
        "moe_top_k": 0,
        "num_layers": num_layers,
        "hidden_size": int(getattr(mc, "hidden_size", 0) or 0),
        "intermediate_size": int(getattr(hf, "intermediate_size", 0) or 0),
        "num_attention_heads": int(getattr(mc, "num_attention_heads", 0) or 0),
        "num_kv_heads": int(getattr(mc, "num_key_value_heads", 0) or 0),
        "head_dim": int(getattr(mc, "head_dim", 0) or 0),
        "vocab_size": int(getattr(mc, "vocab_size", 0) or 0),
        "max_num_seqs": int(getattr(scheduler, "max_running_requests", 0) or 0),
        "max_num_batched_tokens": int(getattr(args, "chunked_prefill_size", 0) or 0),
        "max_model_len": int(getattr(mc, "context_len", 0) or 0),
        "num_gpu_blocks": int(getattr(scheduler, "max_total_num_tokens", 0) or 0) // block_size,
        "privacy_mode": privacy_mode,
        "routing_capture": False,
        "kv_events_observed": kv_events_observed(tree, rust_tee),
    }


def _spec(args: Any) -> dict[str, Any]:
    """EngineStarted's speculation: SGLang's algorithm (``--speculative-algorithm``, lower case)
    and the drafts each verify judges (``speculative_num_draft_tokens`` less the one token
    of the verify that is not a draft)."""
    method = getattr(args, "speculative_algorithm", None)
    if not method:
        return {"spec_method": None, "spec_num_tokens": 0}
    drafts = int(getattr(args, "speculative_num_draft_tokens", 0) or 0)
    return {"spec_method": str(method).lower(), "spec_num_tokens": max(0, drafts - 1)}


def visible_output(req: Any) -> int:
    """A request's output tokens as SGLang returns them: a verify appends its whole accepted run
    to ``output_ids``, which can run past the stop; ``finished_len`` marks where the output ends
    (SGLang's ``_visible_output_len``)."""
    n = len(req.output_ids)
    end = getattr(req, "finished_len", None)
    return n if end is None else min(n, end)


def speculative(batch: Any) -> bool:
    """Whether ``batch`` runs SGLang's speculative decoding (its decode batches are verifies)."""
    algorithm = getattr(batch, "spec_algorithm", None)
    return algorithm is not None and not algorithm.is_none()


def kv_events_observed(tree: Any, rust_tee: bool = False) -> bool:
    """Whether the producer will see this radix cache's inserts and evictions.

    SGLang 0.5.23's ``UnifiedRadixCache`` runs its tree in a TreeCore chosen per cache
    (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``, default ``rust`` on Linux, with a fallback to
    Python for features Rust lacks). The Python core calls the ``KVCacheEventRecorder`` the hooks
    wrap. The Rust core inserts and evicts inside Rust and only queues KV events when SGLang's own
    are on (``--kv-events-config``); the producer tees that queue (``rust_tee``: the adapter's
    event conversion is hooked). What is read here is the backend the cache resolved, not the
    variable, so a fallback is seen as what runs.
    """
    backend = getattr(tree, "_tree_core_backend", None)
    core = getattr(tree, "tree_core", None)
    rust = (
        backend == "rust" if isinstance(backend, str) else core is not None and "Rust" in type(core).__name__
    )
    if not rust:
        return True
    return rust_tee and rust_events_enabled(tree)


def rust_events_enabled(tree: Any) -> bool:
    """Whether the Rust TreeCore of ``tree`` queues KV events (SGLang's ``--kv-events-config``)."""
    recorder = getattr(getattr(tree, "tree_core", None), "kv_events", None)
    return bool(getattr(recorder, "enabled", False))


def _tiers(req: Any) -> tuple[Any, Any, Any] | None:
    """SGLang's split of a request's admission hit by tier (set by ``prepare_for_extend`` on its
    first extend, before ``run_batch``): device, host (HiCache L2), storage (L3)."""
    device = getattr(req, "cached_tokens_device", None)
    if device is None:
        return None
    return (device, getattr(req, "cached_tokens_host", 0), getattr(req, "cached_tokens_storage", 0))


def _on_device(medium: Any) -> bool:
    """A KV event's ``medium`` (SGLang's ``StorageMedium`` value) is the device tier."""
    return str(getattr(medium, "value", medium)) == "GPU"


def engine_name(cfg: Config, scheduler: Any, served: str) -> str:
    """The scheduler's name (:func:`~..plugin_kit.engine_name`, the vLLM producer's rule)."""
    rank = int(getattr(scheduler, "dp_rank", 0) or 0)
    return plugin_kit.engine_name(
        cfg, served, dp_rank=rank, dp_size=int(getattr(scheduler.server_args, "dp_size", 1) or 1)
    )


def _arrival_s(req: Any) -> float:
    """Wall time the scheduler received the request (SGLang keeps it on ``time_stats``)."""
    stats = getattr(req, "time_stats", None)
    for name in ("scheduler_recv_time", "created_time", "wait_queue_entry_time"):
        value = getattr(stats, name, None)
        if isinstance(value, float) and value > 1e9:  # a wall clock, not a monotonic one
            return value
    return time.time()


@dataclass(slots=True)
class InFlight:
    """One forward batch between ``run_batch`` and its ``process_batch_result``."""

    step: int
    start_ns: int
    rids: list[str]
    scheduled: list[int]
    before: list[int]
    reqs: list[Any]
    retracted: list[str]  #: retracted while this batch was built (its StepBatch's preemptions)
    resumed: list[str]
    result: Any = None
    outs: list[int] = field(default_factory=list)  #: output lengths right before processing
    #: A speculative verify batch: each request's drafts and their acceptance come from its
    #: result (``accept_lens``), and so does how far its position moves.
    spec: bool = False
    #: Per request: finished or retracted before its result is processed (SGLang then commits
    #: nothing of it and counts no verify: its drafts were never judged).
    skipped: list[bool] = field(default_factory=list)


class SglangSession(SessionBase):
    """The producer of one SGLang engine epoch, bound to one ``Scheduler``."""

    def __init__(self, cfg: Config, emitter: Emitter, builder: RecordBuilder) -> None:
        super().__init__(cfg, emitter)
        self.builder = builder
        self.block_size = builder.block_size
        self._step = 0
        self._live: set[str] = set()
        self._retracted: set[str] = set()  # retracted, not yet resumed
        self._retracted_now: list[str] = []  # for the next StepBatch
        #: Tokens scheduled so far per live request (its next batch's ``num_computed_before``).
        self._pos: dict[str, int] = {}
        #: Batches launched and not yet processed that schedule each request.
        self._inflight: dict[str, int] = {}
        #: Batches in flight, keyed by the identity of ``run_batch``'s result (the object SGLang
        #: hands to ``process_batch_result``; the overlap loop passes a copy of the batch, never
        #: the batch itself), in launch order.
        self._flights: dict[int, InFlight] = {}
        self._launching: InFlight | None = None
        self._processing: InFlight | None = None
        #: Ended outside a step (aborted while waiting) with a batch of theirs still in flight.
        self._ended: set[str] = set()
        #: SGLang's KV event publisher when the Rust TreeCore's events are teed (else None).
        self.rust_publisher: Any = None
        #: The Rust core's pages this epoch saw stored: SGLang's block hash -> (run, end depth).
        self._rust_pages: dict[int, tuple[RustRun, int]] = {}

    @classmethod
    def start(cls, cfg: Config, scheduler: Any, rust_tee: bool = False) -> SglangSession:
        """The session of ``scheduler``; ``rust_tee``: the Rust TreeCore's KV events are teed
        (the hooks wrapped its adapter's event conversion)."""
        page = int(getattr(scheduler, "page_size", 1) or 1)
        block_size = page if page > 1 else DEFAULT_BLOCK_SIZE
        started = engine_started(scheduler, block_size, cfg.privacy.mode, rust_tee)
        emitter = Emitter(
            cfg, engine_name=engine_name(cfg, scheduler, started["served_model_name"]), epoch=new_epoch()
        )
        builder = RecordBuilder(
            policy=PromptPolicy(cfg.privacy),
            served_model_name=started["served_model_name"],
            block_size=block_size,
        )
        session = cls(cfg, emitter, builder)
        tree = getattr(scheduler, "tree_cache", None)
        if rust_tee and started["kv_events_observed"] and rust_events_enabled(tree):
            session.rust_publisher = getattr(scheduler, "kv_events_publisher", None)
        announce(session, started)
        log.info(
            "sparseety: publishing SGLang engine %s to %s (topic %s, block size %d)",
            emitter.engine_id,
            cfg.kafka.bootstrap,
            cfg.topics.engine_events,
            block_size,
        )
        return session

    # --- steps -------------------------------------------------------------------------------

    def before_run(self, batch: Any) -> None:
        """``Scheduler.run_batch(batch)`` is about to launch the forward: the batch's facts.

        Positions come from the session's own count of what was scheduled per request (an
        extend sets it to ``prefix_len + extend_len``, a decode adds 1), not from
        ``output_ids``: under the overlap scheduler batch N+1 launches before batch N's tokens
        are appended, so ``output_ids`` lags the batch by one there.
        """
        mode = batch.forward_mode
        reqs = batch.reqs
        spec = False
        if mode.is_extend():
            prefix = list(batch.prefix_lens)
            scheduled = list(batch.extend_lens)
        elif mode.is_decode():
            prefix = None
            scheduled = None
            spec = speculative(batch)
        else:
            return  # idle / prebuilt batches compute nothing for a request
        rids: list[str] = []
        keep_sched: list[int] = []
        keep_before: list[int] = []
        kept: list[Any] = []
        started: list[Admission] = []
        resumed: list[str] = []
        live, pos, inflight = self._live, self._pos, self._inflight
        for i, req in enumerate(reqs):
            rid = req.rid
            if rid.startswith(_HEALTH_PREFIX):
                continue
            if prefix is None:
                before = pos.get(rid)
                if before is None:  # decoding before any extend we saw: the old rule
                    before = len(req.origin_input_ids) + len(req.output_ids) - 1
                n = 1
            else:
                before, n = prefix[i], scheduled[i]  # type: ignore[index]
            if rid not in live:
                live.add(rid)
                sp = req.sampling_params
                started.append(
                    Admission(
                        rid,
                        req.origin_input_ids,
                        before,
                        _arrival_s(req),
                        getattr(sp, "max_new_tokens", None),
                        getattr(sp, "custom_params", None),
                        (req.extra_key, getattr(req, "cache_salt", None)),
                        _tiers(req),
                    )
                )
            elif rid in self._retracted:
                self._retracted.discard(rid)
                resumed.append(rid)
            if not spec:  # a verify's advance is its accepted run, known from its result
                pos[rid] = before + n
            inflight[rid] = inflight.get(rid, 0) + 1
            rids.append(rid)
            keep_sched.append(n)
            keep_before.append(before)
            kept.append(req)
        if not rids:
            return
        if started:
            self.emitter.emit_many(len(started), self.builder.requests_started, started)
        retracted, self._retracted_now = self._retracted_now, []
        step = self._step
        self._step = step + 1
        self._launching = InFlight(
            step, time.monotonic_ns(), rids, keep_sched, keep_before, kept, retracted, resumed, spec=spec
        )

    def launched(self, result: Any) -> None:
        """``run_batch`` returned ``result``: the batch is in flight until SGLang processes it."""
        flight, self._launching = self._launching, None
        if flight is not None:
            flight.result = result  # held: the key's object stays alive while the batch is in flight
            self._flights[id(result)] = flight

    def before_result(self, result: Any) -> None:
        """``process_batch_result(batch, result)`` is about to run: which batch it is, and each
        request's output length before SGLang appends this batch's tokens."""
        flight = self._flights.pop(id(result), None)
        if flight is not None:
            reqs = flight.reqs
            flight.outs = [visible_output(r) for r in reqs]
            if flight.spec:
                flight.skipped = [r.finished() or bool(getattr(r, "is_retracted", False)) for r in reqs]
        self._processing = flight

    def after_result(self) -> None:
        """``process_batch_result`` returned: the StepBatch, then the requests that finished with
        no later batch of theirs still in flight (a request may finish in batch N while the
        overlap scheduler already launched it in N+1: its finish waits for N+1's result)."""
        flight, self._processing = self._processing, None
        if flight is None:
            return
        new_tokens: list[int] = []
        token_ids: list[int] = []
        finished: list[tuple[Any, ...]] = []
        inflight = self._inflight
        proposed, accepted = self._verified(flight) if flight.spec else ([], [])
        for req, n_before in zip(flight.reqs, flight.outs, strict=True):
            n_after = visible_output(req)
            n = n_after - n_before
            new_tokens.append(max(0, n))
            if n > 0:
                token_ids.extend(req.output_ids[n_before:n_after])
            rid = req.rid
            left = inflight.get(rid, 1) - 1
            if left > 0:
                inflight[rid] = left
            else:
                inflight.pop(rid, None)
                if (req.finished() or rid in self._ended) and rid in self._live:
                    self._close(rid)
                    finished.append(self._finish_facts(req))
        self.emitter.emit(
            self.builder.step,
            flight.step,
            flight.start_ns,
            time.monotonic_ns(),
            flight.rids,
            flight.scheduled,
            flight.before,
            new_tokens,
            token_ids,
            flight.retracted,
            flight.resumed,
            proposed,
            accepted,
        )
        if finished:
            self.emitter.emit_many(len(finished), self.builder.requests_finished, finished)

    def _verified(self, flight: InFlight) -> tuple[list[int], list[int]]:
        """A verify batch's drafts per request, from its result as SGLang's
        ``_resolve_spec_v2_tokens`` reads it: ``speculative_num_draft_tokens`` positions computed
        (the last committed token and its drafts), ``accept_lens`` committed (the accepted drafts
        and the bonus token). A request skipped by the processing had its drafts judged by
        nobody: reported as proposed and not accepted, with no new token (the fold's
        unverified). Sets the scheduled counts and positions, and moves each request's position."""
        result = flight.result
        stride = int(result.speculative_num_draft_tokens)
        lens = result.accept_lens.tolist()
        pos = self._pos
        proposed = [stride - 1] * len(flight.rids)
        accepted: list[int] = []
        before = flight.before
        for i, rid in enumerate(flight.rids):
            # the position when this verify's result is processed: under the overlap loop this
            # batch launched before the previous verify's accept_lens were known
            at = pos.get(rid)
            if at is not None:
                before[i] = at
            if flight.skipped[i]:
                accepted.append(0)
                continue
            accepted.append(int(lens[i]) - 1)
            if at is not None:
                pos[rid] = at + int(lens[i])
        flight.scheduled = [stride] * len(flight.rids)
        return proposed, accepted

    def _close(self, rid: str) -> None:
        self._live.discard(rid)
        self._ended.discard(rid)
        self._pos.pop(rid, None)
        self._retracted.discard(rid)

    @staticmethod
    def _finish_facts(req: Any) -> tuple[Any, ...]:
        return (
            req.rid,
            req.finished_reason,
            len(req.origin_input_ids),
            visible_output(req),
            int(req.cached_tokens),
            int(getattr(req, "retraction_count", 0) or 0),
        )

    def on_retract(self, retracted: list[Any]) -> None:
        for req in retracted:
            if req.rid in self._live:
                self._retracted.add(req.rid)
                self._retracted_now.append(req.rid)

    def on_finished_outside_step(self, req: Any) -> None:
        """A live request that ended while waiting (e.g. aborted after a retraction). One still in
        a batch in flight (retracted while the overlap scheduler ran it) finishes when that
        batch's result is processed."""
        rid = req.rid
        if rid not in self._live:
            return
        if self._inflight.get(rid):
            self._ended.add(rid)  # SGLang may leave finished_reason unset on this path
            return
        self._close(rid)
        self.emitter.emit(self.builder.request_finished, *self._finish_facts(req))

    def _release(self) -> None:
        """At stop: requests SGLang finished while a batch of theirs was still in flight."""
        for flight in [*self._flights.values(), *filter(None, [self._processing])]:
            for req in flight.reqs:
                if req.rid in self._live and (req.finished() or req.rid in self._ended):
                    self._close(req.rid)
                    self.emitter.emit(self.builder.request_finished, *self._finish_facts(req))

    # --- radix cache --------------------------------------------------------------------------

    def _node_event(self, node: Any, build: Any) -> None:
        keys = []
        depth = 0
        n = node
        while n is not None and n.parent is not None:  # the root has no parent and no tokens
            keys.append(n.key)
            if n is not node:
                depth += len(n.key)
            n = n.parent
        if not keys:
            return
        bs = self.block_size
        if (depth + len(node.key)) // bs > depth // bs:  # some block ends in this node
            self.emitter.emit(build, keys)

    def on_store(self, node: Any) -> None:
        self._node_event(node, self.builder.kv_stored)

    def on_remove(self, node: Any) -> None:
        self._node_event(node, self.builder.kv_removed)

    def on_cleared(self) -> None:
        self.emitter.emit_record(ev.KV_CLEARED, {"medium": "GPU"})

    # --- the Rust TreeCore's KV events ---------------------------------------------------------

    def drain_rust_events(self) -> None:
        """Before a batch launches: SGLang's own ``publish_kv_events`` (it takes the Rust core's
        queued KV events and publishes them on SGLang's configured publisher, as it does after
        each prefill result), so the inserts and evictions before this batch's admissions reach
        the stream before its RequestStarted. SGLang's subscribers get the same events, sooner."""
        publisher = self.rust_publisher
        if publisher is not None:
            publisher.publish_kv_events()

    def on_rust_event(self, event: Any) -> None:
        """One of the Rust core's tagged KV events, as SGLang converts it
        (``block_stored``: hashes, parent hash, token ids, block size, medium, cache_salt,
        session id, extra_key; ``block_removed``: hashes, medium, extra_key;
        ``all_blocks_cleared``). Device-tier pages only; a page whose path the session never saw
        (stored before it started) is skipped."""
        tag = event[0]
        pages = self._rust_pages
        bs = self.block_size
        if tag == "block_stored":
            hashes, parent, tokens = event[1], event[2], event[3]
            if not hashes or not _on_device(event[5]):
                return
            if parent is None:
                prev, start = None, 0
            else:
                at = pages.get(parent)
                if at is None:
                    return
                prev, start = at
            page = len(tokens) // len(hashes)
            run = RustRun(prev, start, tokens, page, (event[8], event[6]))
            for i, h in enumerate(hashes):
                pages[h] = (run, start + (i + 1) * page)
            end = start + len(tokens)
            if end // bs > start // bs:  # some block ends in this run
                self.emitter.emit(self.builder.rust_stored, run, end)
        elif tag == "block_removed":
            if not _on_device(event[2]):
                return
            ends: list[tuple[RustRun, int]] = []
            for h in event[1]:
                at = pages.pop(h, None)
                if at is None:
                    continue
                run, end = at
                block_end = end // bs * bs
                if block_end > end - run.page and block_end > 0:  # a block ends in this page
                    ends.append((run, block_end))
            if ends:
                self.emitter.emit(self.builder.rust_removed, ends)
        elif tag == "all_blocks_cleared":
            pages.clear()
            self.on_cleared()
