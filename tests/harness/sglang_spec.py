"""A simulated EAGLE worker for SGLang's real scheduler (test code; runs in SGLang's venv).

With ``--speculative-algorithm EAGLE`` SGLang's scheduler builds its draft worker through
``SpeculativeAlgorithm.create_worker`` (``sglang/srt/speculative/spec_info.py``) and makes it
the ``model_worker``: every batch goes to its ``forward_batch_generation``. SGLang 0.5.23's
EAGLE worker (``EAGLEWorkerV2``, ``speculative/eagle_worker_v2.py``) runs the draft model and
the verify kernels, which have no CPU build. :class:`SimEagleWorker` replaces only that worker;
everything around it stays SGLang's: the scheduler's spec decode preparation
(``eagle_prepare_for_decode``: the KV slots for the drafts, from the real allocator), the batch
result processing (``_resolve_spec_v2_tokens``: it commits ``accept_lens`` tokens per request
and counts ``spec_verify_ct`` / ``spec_num_correct_drafts``), retraction, the radix cache.

The result per verify is what ``run_eagle_verify`` returns (``DESIGN.md`` §8, Round 4 facts):
``next_token_ids`` a flat CPU tensor of ``[bs * stride]`` (stride = num_draft_tokens),
``accept_lens`` ``[bs]`` (the bonus token included), ``speculative_num_draft_tokens``,
``next_draft_input`` (an ``EagleDraftInput`` carrying the bonus tokens) and ``new_seq_lens``
(``seq_lens + accept_lens``: spec v2's seq_lens are the length before this verify's tokens).

The acceptance pattern: ``SGLANG_HARNESS_ACCEPT`` is a comma list of accepted drafts per verify
(each at most ``num_draft_tokens - 1``); a request's ``k``-th verify accepts
``pattern[(k + hash(rid)) % len(pattern)]`` drafts, so requests in one batch differ.
"""

from __future__ import annotations

import os
import zlib
from typing import Any


def pattern() -> list[int]:
    return [int(x) for x in os.environ.get("SGLANG_HARNESS_ACCEPT", "3,0,1,2").split(",")]


def accepted(rid: str, verify_ct: int, num_drafts: int) -> int:
    """Drafts accepted by request ``rid``'s verify number ``verify_ct`` (0-based)."""
    p = pattern()
    return min(p[(verify_ct + zlib.crc32(rid.encode())) % len(p)], num_drafts)


def allow_overlap() -> None:
    """SGLang turns the overlap scheduler off for speculation on the CPU
    (``arg_groups/speculative_hook._disable_overlap_schedule_for_cpu``: "Overlap schedule is not
    implemented for speculative decoding on CPU"); on a GPU spec v2 runs under the overlap loop by
    default. The harness keeps the mode's own setting (in the launcher, where the server
    arguments are resolved)."""
    import sglang.srt.arg_groups.speculative_hook as hook

    hook._disable_overlap_schedule_for_cpu = lambda server_args: None


def install(next_token: Any) -> None:
    """Patch ``SpeculativeAlgorithm.create_worker`` so EAGLE builds :class:`SimEagleWorker`."""
    import torch
    import wrapt

    def on_spec_info(module: Any) -> None:
        from sglang.srt.runtime_context import get_spec
        from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

        class SimEagleWorker(BaseSpecWorker):
            """The draft and verify without math: drafts are the simulated model's own next
            tokens, the acceptance pattern decides how many of them verify accepts."""

            def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any):
                super().__init__()
                self.server_args = server_args
                self._target_worker = target_worker
                self._draft_worker = None
                self.topk = get_spec().speculative_eagle_topk
                self.speculative_num_steps = get_spec().speculative_num_steps
                self.speculative_num_draft_tokens = get_spec().speculative_num_draft_tokens
                self.device = target_worker.device

            def __getattr__(self, name: str) -> Any:  # what the scheduler asks the target
                if name.startswith("_"):
                    raise AttributeError(name)
                return getattr(self._target_worker, name)

            def alloc_memory_pool(self, **kw: Any) -> None:
                pass

            def init_hicache_draft_plan(self) -> None:
                pass

            def init_attention_backends(self) -> None:
                pass

            def init_cuda_graphs(self) -> None:
                pass

            def on_verify_complete_cpu(self, *a: Any, **kw: Any) -> None:
                pass

            def _draft_input(self, bonus: list[int]) -> Any:
                from sglang.srt.speculative.eagle_info import EagleDraftInput

                bs = len(bonus)
                return EagleDraftInput(
                    topk_p=torch.ones((bs, self.topk), dtype=torch.float32),
                    topk_index=torch.zeros((bs, self.topk), dtype=torch.int64),
                    hidden_states=None,
                    bonus_tokens=torch.tensor(bonus, dtype=torch.int32),
                )

            def forward_batch_generation(self, batch: Any, *a: Any, **kw: Any) -> Any:
                if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
                    out = self._target_worker.forward_batch_generation(batch)
                    out.new_seq_lens = batch.seq_lens
                    out.next_draft_input = self._draft_input(out.next_token_ids.tolist())
                    return out
                return self._verify(batch)

            def _verify(self, batch: Any) -> Any:
                from sglang.srt.layers.logits_processor import LogitsProcessorOutput
                from sglang.srt.managers.utils import GenerationBatchResult

                stride = self.speculative_num_draft_tokens
                seq_lens = [int(x) for x in batch.seq_lens.tolist()]
                bonus_in = batch.spec_info.bonus_tokens.tolist()
                tokens: list[int] = []
                lens: list[int] = []
                bonus: list[int] = []
                for req, last, n in zip(batch.reqs, bonus_in, seq_lens, strict=True):
                    run = []  # the target's own tokens after the last committed one
                    for i in range(stride):
                        last = next_token(last, n + i)
                        run.append(last)
                    k = accepted(req.rid, req.spec_verify_ct, stride - 1)
                    tokens += run
                    lens.append(k + 1)  # k drafts and the bonus token
                    bonus.append(run[k])
                accept_lens = torch.tensor(lens, dtype=torch.int32)
                return GenerationBatchResult(
                    logits_output=LogitsProcessorOutput(next_token_logits=None),
                    next_token_ids=torch.tensor(tokens, dtype=torch.int64),
                    can_run_cuda_graph=False,
                    speculative_num_draft_tokens=stride,
                    next_draft_input=self._draft_input(bonus),
                    accept_lens=accept_lens,
                    new_seq_lens=batch.seq_lens + accept_lens.to(batch.seq_lens.dtype),
                )

        create = module.SpeculativeAlgorithm.create_worker

        def create_worker(self: Any, server_args: Any) -> Any:
            if self.is_eagle():
                return SimEagleWorker
            return create(self, server_args)

        module.SpeculativeAlgorithm.create_worker = create_worker

    wrapt.register_post_import_hook(on_spec_info, "sglang.srt.speculative.spec_info")

    def on_memory_pool(module: Any) -> None:
        """With speculation on, the KV pool warms up ``copy_all_layer_kv_cache`` (the kernel
        that moves accepted tree nodes' KV for topk > 1), a C++ kernel with no CPU build here.
        Its warmup copies slot 0 onto itself: a no-op. Any real move raises (topk = 1 moves
        nothing: the accepted path is the front of the chain)."""
        real = module.copy_all_layer_kv_cache_func

        def copy_all_layer_kv_cache_func(ptrs: Any, strides: Any, tgt: Any, src: Any, *a: Any) -> Any:
            if torch.equal(tgt, src) and not bool(tgt.any()):
                return None
            return real(ptrs, strides, tgt, src, *a)

        module.copy_all_layer_kv_cache_func = copy_all_layer_kv_cache_func

    wrapt.register_post_import_hook(on_memory_pool, "sglang.srt.mem_cache.memory_pool")

    def on_allocation(module: Any) -> None:
        """Spec decode reserves the drafts' KV slots through ``alloc_for_spec_decode``, which
        writes them into each request's ``req_to_token`` row with
        ``assign_req_to_token_pool_cpu`` (a C++ kernel with no CPU build here). The same
        write in torch, as SGLang's Triton kernel ``assign_req_to_token_pool`` does it: request
        ``i``'s row from ``start[i]`` to ``end[i]`` takes the next ``end[i] - start[i]`` slots of
        ``out_cache_loc``."""

        def assign_req_to_token_pool_cpu(
            req_pool_indices: Any, req_to_token: Any, start: Any, end: Any, out_cache_loc: Any, _: int
        ) -> None:
            at = 0
            for row, a, b in zip(req_pool_indices.tolist(), start.tolist(), end.tolist(), strict=True):
                req_to_token[row, a:b] = out_cache_loc[at : at + b - a].to(req_to_token.dtype)
                at += b - a

        module.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu

    wrapt.register_post_import_hook(on_allocation, "sglang.srt.mem_cache.allocation")

    def on_overlap_utils(module: Any) -> None:
        """Under the overlap scheduler the next verify's draft input is resolved from the future
        map by ``gather_spec_extras``, a Triton kernel (no CPU driver here). The same row gather
        in torch: each buffer's rows at ``indices`` (what the kernel fuses)."""

        def gather_spec_extras(indices: Any, topk_p: Any, topk_index: Any, tokens: Any, hidden: Any) -> Any:
            rows = indices.to(torch.int64)
            return (topk_p[rows], topk_index[rows], tokens[rows], None if hidden is None else hidden[rows])

        module.gather_spec_extras = gather_spec_extras

    wrapt.register_post_import_hook(on_overlap_utils, "sglang.srt.managers.overlap_utils")
