"""vLLM generation throughput with SparSEEty on vs off, side by side in one run.

Four engines serve the same tiny local Llama at the same time, each in its own process in vLLM's
real multiprocess layout (EngineCore + worker): two ``off`` (plain vLLM) and two ``on`` (the
plugin active, publishing to an embedded broker on this machine, with KV cache events enabled
as a user enables them for SparSEEty). They take turns on the same workload (off, on, on, off,
then the reverse), so drift on this shared machine hits both sides alike; the result is
the ratio of the median throughputs (generated tokens per second of ``LLM.generate``), and the
median of the per-round (paired) ratios.

A tiny model on CPU is a harsh case: its steps take a few milliseconds, so the fixed cost per
step weighs far more than beside a GPU step of 6-30 ms; and the producer's thread, the broker
and the engine share 2 cores.

    .venv/bin/python benchmarks/bench_engine_throughput.py [--rounds 5] [--requests 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = Path(os.environ.get("TINY_MODEL_CACHE", "~/.cache/sparseety-tiny-models")).expanduser()
SYSTEMS = [
    "You are the billing assistant of the serving fleet. Answer in one short paragraph. " * 4,
    "Explain the scheduler: every step it decides which requests run and which blocks are freed. " * 4,
    "Numbers such as 0, 1, 2, 3, 42, 100, 256 and 1024 appear in logs, tables and invoices. " * 4,
    "Translate every sentence into French, then explain each word of the translation. " * 4,
]


def child(model: str, kv_events: bool) -> None:
    """Engine driver: answers ``run <requests> <max_tokens>`` with its throughput."""
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    if kv_events:
        kwargs["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "null"}
    llm = LLM(
        model=model,
        enable_prefix_caching=True,
        block_size=32,
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
        **kwargs,
    )
    print("READY", flush=True)
    for round_no, line in enumerate(sys.stdin, start=1):
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        n, max_tokens = int(cmd[1]), int(cmd[2])
        prompts = [SYSTEMS[i % len(SYSTEMS)] + f"Round {round_no}, question {i}: why?" for i in range(n)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print("RESULT " + json.dumps({"tokens": tokens, "seconds": dt}), flush=True)
    llm.llm_engine.engine_core.shutdown()


class Engine:
    def __init__(self, name: str, model: Path, env: dict[str, str], kv_events: bool, log: Path) -> None:
        self.name = name
        self.log = open(log, "w")  # noqa: SIM115
        args = [sys.executable, __file__, "--child", str(model)] + (["--kv-events"] if kv_events else [])
        self.proc = subprocess.Popen(
            args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("READY"):
                return
        raise RuntimeError(f"{self.name} engine exited; see {self.log.name}")

    def run(self, requests: int, max_tokens: int) -> dict[str, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"run {requests} {max_tokens}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[7:])  # type: ignore[no-any-return]
        raise RuntimeError(f"{self.name} engine exited; see {self.log.name}")

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], "--kv-events" in sys.argv)
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--aa", action="store_true", help="A/A run: the plugin off on both sides (this machine's noise floor)"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from sparseety.broker import EmbeddedBroker
    from sparseety.config import load_config, to_env
    from sparseety.kafka import ensure_topics
    from sparseety.stack.tiny_models import build_tiny_model
    from tests.helpers import free_port

    model = build_tiny_model("llama", MODEL_CACHE / "llama")
    with tempfile.TemporaryDirectory(prefix="sparseety-bench-") as tmp:
        cfg = load_config(data_dir=tmp, broker={"port": free_port()})
        broker = EmbeddedBroker(cfg)
        broker.start(create_topics=False)
        ecfg = broker.client_config().replace(
            topics={**cfg.topics.model_dump(), "engine_events": "bench.engine-events", "partitions": 1}
        )
        ensure_topics(ecfg, [ecfg.topics.engine_events])
        base = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
        base.update({"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)})

        def on_env(i: int) -> dict[str, str]:
            named = ecfg.replace(producer={"engine_name": f"bench-on-{i}"})
            return dict(base) if args.aa else {**base, **to_env(named)}

        # Two engines per side, started off/on/on/off: an engine instance's own speed (seen
        # +-7 % between two identical engines here) and the start order average out.
        engines = [
            ("off", Engine("off-1", model, dict(base), False, Path(tmp) / "off-1.log")),
            ("on", Engine("on-1", model, on_env(1), not args.aa, Path(tmp) / "on-1.log")),
            ("on", Engine("on-2", model, on_env(2), not args.aa, Path(tmp) / "on-2.log")),
            ("off", Engine("off-2", model, dict(base), False, Path(tmp) / "off-2.log")),
        ]
        tput: dict[str, list[float]] = {"off": [], "on": []}
        ratios: list[float] = []
        try:
            for _, e in engines:
                e.wait_ready()
            for _, e in engines:  # warm-up round, not counted
                e.run(args.requests, args.max_tokens)
            for r in range(args.rounds):
                got: dict[str, list[float]] = {"off": [], "on": []}
                for side, e in engines if r % 2 == 0 else engines[::-1]:
                    res = e.run(args.requests, args.max_tokens)
                    got[side].append(res["tokens"] / res["seconds"])
                for side in got:
                    tput[side] += got[side]
                ratios.append(statistics.mean(got["on"]) / statistics.mean(got["off"]))
                print(
                    f"round {r + 1}: off {statistics.mean(got['off']):.0f} tok/s, "
                    f"on {statistics.mean(got['on']):.0f} tok/s, ratio {ratios[-1]:.3f}",
                    flush=True,
                )
        finally:
            for _, e in engines:
                e.close()
            logs = "\n".join((Path(tmp) / f"{e.name}.log").read_text(errors="replace") for _, e in engines)
            broker.stop()
        off, on = statistics.median(tput["off"]), statistics.median(tput["on"])
        label = " (A/A: plugin off on both sides)" if args.aa else ""
        print(f"\n{args.requests} requests x {args.max_tokens} tokens per round, {args.rounds} rounds{label}")
        print(f"median throughput: off {off:.0f} tok/s, on {on:.0f} tok/s, ratio on/off {on / off:.3f}")
        print(f"per-round ratios: {[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}")
        for line in logs.splitlines():
            if "sparseety producer" in line and "stopped:" in line:
                print("producer:", line.split("stopped:", 1)[1].strip())
            elif "sparseety" in line and ("WARNING" in line or "ERROR" in line):
                print("on engine:", line)


if __name__ == "__main__":
    main()
