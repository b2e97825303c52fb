"""vLLM with the SparSEEty plugin on vs off, and an A/A control (off vs off), in one run.

Engines serve the same tiny local Llama (``sparseety/stack/tiny_models.py``, CPU vLLM), each in
its own process in vLLM's real multiprocess layout (EngineCore + worker): ``off-a`` is plain vLLM,
``on`` has the plugin active, publishing to an embedded broker on this machine, with KV cache events
enabled as a user enables them for SparSEEty. The A/A control ``off-b`` is one of two kinds
(``--aa``), named in the output:

* ``two-engines`` (the default): a second plain engine, started like ``off-a``. Its ratio to
  ``off-a`` is the noise floor between two identical engines: the measurement's noise plus
  whatever differs from one engine process to another.
* ``one-engine`` (``--quick``'s): a second series of rounds on ``off-a``'s own engine, interleaved
  with the first (``off-a``, ``on``, ``off-b``, then reversed). Its ratio is the noise of the
  measurement on this machine, without engine-to-engine variation; it saves one engine start
  (three vLLM processes, 1-3 minutes here), and peak RSS has no A/A (same processes).

The series take turns on the same workload, round after round (the order reversed every other
round), so drift on this shared machine hits every side alike. Per round and series:

* throughput: generated tokens / wall time of ``LLM.generate``;
* TTFT p50 and p99 over the round's requests (vLLM's own ``first_token_latency``);
* TPOT: mean time per output token after the first (``(last_token_ts - first_token_ts) /
  (tokens - 1)``, vLLM's own timestamps), the median over requests;
* peak RSS: the high-water mark (``VmHWM``) summed over the engine's processes.

The per-round ratios are ``on / off-a`` and, as the noise floor, ``off-b / off-a``; the script
prints the A/A kind, their medians, every per-round ratio, the run's duration, and as its last
line::

    bench_engine: on/off throughput 0.NN; ttft_p99 N.NN; tpot N.NN; rss +N MiB

(TTFT/TPOT as on/off ratios of the medians; RSS as on minus off-a, median over rounds.)

A tiny model on CPU is a harsh case: its steps take a few milliseconds, so the fixed cost per
step weighs far more than beside a GPU step of 6-30 ms; the producer's thread, the broker and the
engine share 2 cores.

    .venv/bin/python benchmarks/bench_engine.py --quick   # 2 engines (one-engine A/A), 9 rounds of 64 x 48
    .venv/bin/python benchmarks/bench_engine.py --rounds 8  # 3 engines (two-engines A/A)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = Path(os.environ.get("TINY_MODEL_CACHE", "~/.cache/sparseety-tiny-models")).expanduser()
# --quick: (rounds, requests per round, max tokens per request); the rest of its time is starting
# two engines (about a minute on a quiet 2-core machine).
QUICK = (9, 64, 48)
AA_KINDS = {
    "two-engines": "off-b is a second plain engine (noise between two identical engines)",
    "one-engine": "off-b is a second series of rounds on off-a's engine, interleaved with off-a "
    "(noise of the measurement only, not engine-to-engine; no RSS control)",
}
SYSTEMS = [
    "You are the billing assistant of the serving fleet. Answer in one short paragraph. " * 4,
    "Explain the scheduler: every step it decides which requests run and which blocks are freed. " * 4,
    "Numbers such as 0, 1, 2, 3, 42, 100, 256 and 1024 appear in logs, tables and invoices. " * 4,
    "Translate every sentence into French, then explain each word of the translation. " * 4,
]


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def tree_peak_rss_mib(pid: int) -> float:
    """Sum of ``VmHWM`` (peak resident set) over ``pid`` and its descendants, MiB."""
    pids, total = [pid], 0.0
    while pids:
        p = pids.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) / 1024
        pids += [int(c) for c in children]
    return total


_TICK = os.sysconf("SC_CLK_TCK")
#: Linux thread names of the plugin's threads: its background emitters (named by
#: ``producers/supervisor.py``; Linux keeps 15 characters) and librdkafka's own threads.
_EMITTER, _RDKAFKA = "sparseety-emitt", "rdk:"


def tree_cpu_s(pid: int) -> tuple[float, float, float]:
    """CPU seconds (user + system) of ``pid`` and its descendants, all threads: (total, of which
    the plugin's emitter threads, of which librdkafka's threads)."""
    pids, total, emitters, rdkafka = [pid], 0.0, 0.0, 0.0
    while pids:
        p = pids.pop()
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{p}/task")]
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{p}/task/{tid}/stat").read_text()
            except OSError:
                continue
            name, rest = stat.split("(", 1)[1].rsplit(")", 1)
            fields = rest.split()
            cpu = (int(fields[11]) + int(fields[12])) / _TICK
            total += cpu
            if name.startswith(_EMITTER):
                emitters += cpu
            elif name.startswith(_RDKAFKA):
                rdkafka += cpu
        pids += [int(c) for c in children]
    return total, emitters, rdkafka


def child(model: str, kv_events: bool) -> None:
    """Engine driver: answers ``run <requests> <max_tokens> <tag>`` with its figures.

    ``tag`` goes into every prompt after the shared system prompts, so that a series never reuses
    another series' cached prompt tail on the same engine (one-engine A/A); the tags of one round
    have one length.
    """
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
        disable_log_stats=False,  # per-request timestamps (TTFT, TPOT), on both sides alike
        **kwargs,
    )
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        n, max_tokens, tag = int(cmd[1]), int(cmd[2]), cmd[3]
        prompts = [SYSTEMS[i % len(SYSTEMS)] + f"Round {tag}, question {i}: why?" for i in range(n)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        ttft, tpot = [], []
        for o in outs:
            m = o.metrics
            if m is None:
                continue
            ttft.append(m.first_token_latency)
            k = len(o.outputs[0].token_ids)
            if k > 1 and m.last_token_ts > m.first_token_ts:
                tpot.append((m.last_token_ts - m.first_token_ts) / (k - 1))
        print(
            "RESULT " + json.dumps({"tokens": tokens, "seconds": dt, "ttft": ttft, "tpot": tpot}), flush=True
        )
    llm.llm_engine.engine_core.shutdown()


class Engine:
    def __init__(self, name: str, model: Path, env: dict[str, str], kv_events: bool, log: Path) -> None:
        self.name = name
        self.log_path = log
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        args = [sys.executable, __file__, "--child", str(model)] + (["--kv-events"] if kv_events else [])
        self.proc = subprocess.Popen(
            args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("READY"):
                return
        raise RuntimeError(f"{self.name} engine exited; see {self.log_path}")

    def run(self, requests: int, max_tokens: int, tag: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        cpu0, emit0, rdk0 = tree_cpu_s(self.proc.pid)
        self.proc.stdin.write(f"run {requests} {max_tokens} {tag}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                res: dict[str, Any] = json.loads(line[7:])
                res["rss_mib"] = tree_peak_rss_mib(self.proc.pid)
                cpu1, emit1, rdk1 = tree_cpu_s(self.proc.pid)
                res["cpu_s"], res["emitter_cpu_s"] = cpu1 - cpu0, emit1 - emit0
                res["rdkafka_cpu_s"] = rdk1 - rdk0
                return res
        raise RuntimeError(f"{self.name} engine exited; see {self.log_path}")

    def quit(self) -> None:
        """Asks the engine to shut down; ``close`` waits for it (all engines stop together)."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except OSError:
                pass

    def close(self) -> None:
        self.quit()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def figures(res: dict[str, Any]) -> dict[str, float]:
    """One engine's round: throughput, TTFT p50/p99, TPOT (median), peak RSS."""
    return {
        "tput": res["tokens"] / res["seconds"],
        "ttft_p50": percentile(res["ttft"], 0.5),
        "ttft_p99": percentile(res["ttft"], 0.99),
        "tpot": statistics.median(res["tpot"]),
        "rss": res["rss_mib"],
        "cpu_s": res["cpu_s"],
        "emitter_cpu_s": res["emitter_cpu_s"],
        "rdkafka_cpu_s": res["rdkafka_cpu_s"],
        "broker_cpu_s": res.get("broker_cpu_s", 0.0),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], "--kv-events" in sys.argv)
        return
    started = time.monotonic()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--aa",
        choices=AA_KINDS,
        default=None,
        help="A/A control kind (default two-engines; --quick: one-engine)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="{} rounds of {} requests x {} tokens, one-engine A/A: under 2 minutes on a quiet 2-core "
        "machine".format(*QUICK),
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.max_tokens = QUICK
    aa = args.aa or ("one-engine" if args.quick else "two-engines")
    sys.path.insert(0, str(ROOT))
    from sparseety.broker import EmbeddedBroker
    from sparseety.config import load_config, to_env
    from sparseety.kafka import ensure_topics
    from sparseety.stack.tiny_models import build_tiny_model

    print(f"A/A control: {AA_KINDS[aa]}", flush=True)
    model = build_tiny_model("llama", MODEL_CACHE / "llama")
    with tempfile.TemporaryDirectory(prefix="sparseety-bench-") as tmp:
        cfg = load_config(data_dir=tmp, broker={"port": free_port()})
        broker = EmbeddedBroker(cfg)
        broker.start(create_topics=False)
        ecfg = broker.client_config().replace(
            topics={**cfg.topics.model_dump(), "engine_events": "bench.engine-events", "partitions": 1},
            producer={"engine_name": "bench-on"},
        )
        ensure_topics(ecfg, [ecfg.topics.engine_events])
        base = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
        base.update({"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)})
        t_start = time.monotonic()
        engines = {
            "off-a": Engine("off-a", model, dict(base), False, Path(tmp) / "off-a.log"),
            "on": Engine("on", model, {**base, **to_env(ecfg)}, True, Path(tmp) / "on.log"),
        }
        if aa == "two-engines":
            engines["off-b"] = Engine("off-b", model, dict(base), False, Path(tmp) / "off-b.log")
        # Which engine serves each series; the one-engine A/A runs off-b on off-a's engine.
        serves = {
            "off-a": engines["off-a"],
            "on": engines["on"],
            "off-b": engines.get("off-b", engines["off-a"]),
        }
        # A distinct prompt tag for off-b only when it shares off-a's engine (its prefix cache).
        series_tag = {"off-a": "0", "on": "0", "off-b": "1" if aa == "one-engine" else "0"}
        rounds: list[dict[str, dict[str, float]]] = []
        try:
            for e in engines.values():
                e.wait_ready()
            ready_s = time.monotonic() - t_start
            print(f"{len(engines)} engines ready in {ready_s:.0f} s", flush=True)
            t_rounds = time.monotonic()
            for e in engines.values():  # warm-up round, not counted
                e.run(args.requests, args.max_tokens, "w.0")
            order = ["off-a", "on", "off-b"]
            broker_pid = broker.pid()

            def run_series(name: str, r: int) -> dict[str, float]:
                b0 = tree_cpu_s(broker_pid)[0] if broker_pid else 0.0
                res = serves[name].run(args.requests, args.max_tokens, f"{r}.{series_tag[name]}")
                res["broker_cpu_s"] = (tree_cpu_s(broker_pid)[0] - b0) if broker_pid else 0.0
                return figures(res)

            for r in range(args.rounds):
                got = {name: run_series(name, r) for name in order}
                rounds.append(got)
                order.reverse()
                print(
                    f"round {r + 1}: "
                    + "; ".join(
                        f"{n} {g['tput']:.0f} tok/s ttft p50/p99 {g['ttft_p50'] * 1e3:.0f}/"
                        f"{g['ttft_p99'] * 1e3:.0f} ms tpot {g['tpot'] * 1e3:.1f} ms rss {g['rss']:.0f} MiB"
                        for n, g in got.items()
                    )
                    + f"; on/off {got['on']['tput'] / got['off-a']['tput']:.3f}"
                    f", A/A {got['off-b']['tput'] / got['off-a']['tput']:.3f}",
                    flush=True,
                )
            rounds_s = time.monotonic() - t_rounds
        finally:
            for e in engines.values():
                e.quit()
            for e in engines.values():
                e.close()
            logs = "\n".join(e.log_path.read_text(errors="replace") for e in engines.values())
            broker.stop()

    def med(name: str, key: str) -> float:
        return statistics.median(g[name][key] for g in rounds)

    print(
        f"\n{args.requests} requests x {args.max_tokens} tokens per round, {args.rounds} rounds; "
        f"A/A control: {aa}"
    )
    print("| figure | off-a | off-b | on | A/A off-b/off-a | on/off-a | per-round on/off-a | per-round A/A |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for key, label, scale in (
        ("tput", "throughput, tok/s", 1.0),
        ("ttft_p50", "TTFT p50, ms", 1e3),
        ("ttft_p99", "TTFT p99, ms", 1e3),
        ("tpot", "TPOT, ms", 1e3),
        ("rss", "peak RSS, MiB", 1.0),
    ):
        per_on = [g["on"][key] / g["off-a"][key] for g in rounds]
        per_aa = [g["off-b"][key] / g["off-a"][key] for g in rounds]
        if key == "rss" and aa == "one-engine":
            # off-b's peak RSS is off-a's own processes' high-water mark: no control at all.
            aa_cells = ["n/a (same engine)", "n/a"]
        else:
            aa_cells = [f"{med('off-b', key) / med('off-a', key):.3f}", ", ".join(f"{x:.2f}" for x in per_aa)]
        print(
            f"| {label} | {med('off-a', key) * scale:.1f} | {med('off-b', key) * scale:.1f} | "
            f"{med('on', key) * scale:.1f} | {aa_cells[0]} | "
            f"{med('on', key) / med('off-a', key):.3f} | {', '.join(f'{x:.2f}' for x in per_on)} | "
            f"{aa_cells[1]} |"
        )

    # Where the extra CPU of the "on" rounds goes: on a CPU-only 2-core box every CPU-second the
    # plugin's emitter thread or the broker takes is one the engine's own processes do not get.
    print(
        "CPU seconds per round (medians): engine processes off-a "
        f"{med('off-a', 'cpu_s'):.2f}, on {med('on', 'cpu_s'):.2f} of which the plugin's "
        f"emitter threads {med('on', 'emitter_cpu_s'):.3f} and librdkafka's "
        f"{med('on', 'rdkafka_cpu_s'):.3f}; the broker during on-rounds "
        f"{med('on', 'broker_cpu_s'):.3f}, during off-a rounds {med('off-a', 'broker_cpu_s'):.3f}"
    )
    for line in logs.splitlines():
        if "sparseety producer" in line and "stopped:" in line:
            print("producer:", line.split("stopped:", 1)[1].strip())
        elif "sparseety" in line and ("WARNING" in line or "ERROR" in line):
            print("on engine:", line)
    print(
        f"duration {time.monotonic() - started:.0f} s: engines ready after {ready_s:.0f} s, "
        f"warm-up and rounds {rounds_s:.0f} s"
    )
    rss_delta = statistics.median(g["on"]["rss"] - g["off-a"]["rss"] for g in rounds)
    print(
        f"bench_engine: on/off throughput {med('on', 'tput') / med('off-a', 'tput'):.2f}; "
        f"ttft_p99 {med('on', 'ttft_p99') / med('off-a', 'ttft_p99'):.2f}; "
        f"tpot {med('on', 'tpot') / med('off-a', 'tpot'):.2f}; rss {rss_delta:+.0f} MiB"
    )


if __name__ == "__main__":
    main()
