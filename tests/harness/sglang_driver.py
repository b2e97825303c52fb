"""SGLang's real engine with a simulated model worker (test code; run in SGLang's venv).

``python -m tests.harness.sglang_driver CONFIG.json`` from the repository root, in
``.venv-sglang``. It starts ``sglang.Engine`` (the real tokenizer manager, the real ``Scheduler``
in its own spawned process, its radix cache with the TreeCore the config names, its allocator,
retraction and chunked prefill) on the tiny Llama's config with dummy weights, and replaces only
the model's math: ``TpModelWorker.forward_batch_generation`` returns a ``GenerationBatchResult``
with one next-token id per request and no logits (``DESIGN.md`` §8, Round 4 facts). Under the
overlap scheduler that result is consumed one batch late, by SGLang's own loop, exactly as a GPU
worker's is. The SparSEEty plugin loads through ``sglang.srt.plugins`` as in production.

SGLang spawns its scheduler process, which imports this module again as ``__mp_main__``: the
module-level :func:`install` below therefore runs there too, where the worker and the truth
(``tests/e2e/sglang_launch.install_truth``: radix hits, recompute after eviction) are patched.

The config: ``{"runs": [{"name", "env": {variables}, "truth": path, "out": path, "engine":
{sglang.Engine kwargs}, "phases": [[{"rid", "tenant", "input_ids", "max_new_tokens"}, ...],
...]}, ...]}``, run one after the other. Each phase is one batch ``generate`` call; SGLang's
answers (``meta_info``, ``output_ids``) go to ``out``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

VOCAB = 500  # next tokens stay inside the tiny model's vocabulary, away from special tokens


def next_token(last: int, seq_len: int) -> int:
    """The simulated model: a pure function of the last input token and the sequence length."""
    return 4 + (last * 31 + seq_len * 7) % VOCAB


def install() -> None:
    import torch
    import wrapt

    def on_worker(module: Any) -> None:
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult

        def forward_batch_generation(
            self: Any, batch: Any = None, forward_batch: Any = None, *a: Any, **kw: Any
        ) -> Any:
            src = batch if batch is not None else forward_batch
            seq_lens = [int(x) for x in src.seq_lens.tolist()]
            ids = src.input_ids.tolist() if src.input_ids is not None else [0] * len(seq_lens)
            if src.forward_mode.is_extend():
                lens = list(getattr(src, "extend_lens", None) or src.extend_seq_lens_cpu)
                ends = [sum(lens[: i + 1]) for i in range(len(seq_lens))]
                last = [ids[e - 1] if e > 0 else 0 for e in ends]
            else:
                last = ids[: len(seq_lens)]
            nxt = torch.tensor(
                [next_token(t, n) for t, n in zip(last, seq_lens, strict=True)], dtype=torch.int64
            )
            return GenerationBatchResult(
                logits_output=LogitsProcessorOutput(next_token_logits=None),
                next_token_ids=nxt,
                can_run_cuda_graph=False,
            )

        module.TpModelWorker.forward_batch_generation = forward_batch_generation

    wrapt.register_post_import_hook(on_worker, "sglang.srt.managers.tp_worker")
    from tests.harness.sglang_spec import install as install_spec

    install_spec(next_token)  # EAGLE's draft worker, simulated (only when a run speculates)
    # the truth recorder installs itself on import when E2E_SGLANG_TRUTH is set
    import tests.e2e.sglang_launch  # noqa: F401


if os.environ.get("SGLANG_HARNESS") == "1" and __name__ != "__main__":
    install()  # the spawned scheduler process (this module is its ``__mp_main__``)


def run(engine_kwargs: dict[str, Any], phases: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One engine: each phase one batch ``generate``; SGLang's answer per request."""
    import sglang as sgl

    engine = sgl.Engine(**engine_kwargs)
    answers: dict[str, Any] = {}
    try:
        for phase in phases:
            outs = engine.generate(
                input_ids=[r["input_ids"] for r in phase],
                rid=[r["rid"] for r in phase],
                sampling_params=[
                    {
                        "max_new_tokens": r["max_new_tokens"],
                        "temperature": 0,
                        "ignore_eos": True,
                        "custom_params": {"tenant": r["tenant"]},
                    }
                    for r in phase
                ],
            )
            for r, o in zip(phase, outs, strict=True):
                answers[r["rid"]] = {"meta_info": o["meta_info"], "output_ids": o.get("output_ids")}
    finally:
        stop(engine)
    return answers


def stop(engine: Any) -> None:
    """SGLang's graceful stop, as its tokenizer manager does on SIGTERM (``sigterm_watchdog``):
    a ShutdownReq to the schedulers, which leave their loop and exit (the producer's
    EngineStopped and flush run at that exit), then ``Engine.shutdown`` (which alone would
    SIGKILL them: ``kill_process_tree``)."""
    import time

    from sglang.srt.managers.io_struct import ShutdownReq
    from sglang.srt.utils.cudacore_pyspy_dump_utils import collect_scheduler_processes

    try:
        engine.tokenizer_manager._dispatch_to_scheduler(ShutdownReq())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and collect_scheduler_processes():
            time.sleep(0.1)
    finally:
        engine.shutdown()


def main(config_path: str) -> None:
    """Each run of the config in turn: its environment (the plugin's topic, the TreeCore, where
    the truth goes: the spawned scheduler reads them), its engine, its answers."""
    from sglang.srt.plugins import load_plugins

    with open(config_path) as f:
        config = json.load(f)
    load_plugins()
    from tests.harness.sglang_spec import allow_overlap

    allow_overlap()  # EAGLE under the overlap loop too, as on a GPU (SGLang forces it off on CPU)
    for spec in config["runs"]:
        os.environ.update(spec["env"])
        os.environ["E2E_SGLANG_TRUTH"] = spec["truth"]
        answers = run(spec["engine"], spec["phases"])
        with open(spec["out"], "w") as f:
            json.dump(answers, f)


if __name__ == "__main__":
    main(sys.argv[1])
