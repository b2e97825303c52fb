"""The real worker process against the pure fold of the same events, side by side in one run.

    .venv/bin/python benchmarks/bench_worker.py [--quick] [--rounds 3] [--profile out.prof]

For two workloads of ``bench_assembler.synthetic`` (a steady decode batch; prompts of 512 tokens,
4 blocks cached): batch-256 engine steps where one request finishes and one is admitted per step
(few large StepBatches), and batch-4 steps where that happens every 32 steps (many small events),
each round:

1. a fresh set of topics (one partition) and a fresh ``sparseety worker`` process (Faust, the
   changelog-backed table, the consumer group: the production code path and its default batch
   settings) on the embedded broker; a warm-up engine epoch is folded first, so start-up and the
   group join are outside the measurement;
2. the workload is produced (schema-v3 single-object events, as the producers write them) and the
   script waits until every request's RequestAccounting is on the timelines topic;
3. the worker's CPU time (user + system, from ``/proc``) across step 2 gives its rate per worker
   core; the pure fold (``Assembler.apply`` on the decoded events, no decoding) of the same events
   is timed with ``time.process_time`` in this process right after, so both see the same machine,
   under the worker's garbage-collector settings (``sparseety.lifecycle.tune_gc``).

The ratio is worker request-steps per CPU-second / fold request-steps per CPU-second (medians over
rounds). Per round and per workload the script also prints where the worker's CPU went, per
CPU-second of the pure fold: its batch thread's stages (``sparseety:worker_stage_cpu_seconds_total``
from its metrics endpoint: decode, fold, encode, send, state), ``rest`` (that thread outside the
stages: Faust's delivery, acks, commits, timers) and ``others`` (its other threads, Faust's
consumer thread); and the worker's own fold stage as a share of its CPU, which is measured at the
same moment as the rest and so moves less with a shared machine's load than the ratio does.
Wall-clock rates are printed too; on a shared machine they include waiting for a core.
The last two lines are the issue-13 targets::

    bench_worker: batch-4 NNN events/s per worker core (worker/fold ratio 0.NN)
    bench_worker: worker/fold ratio 0.NN; NNN request-steps/s

``--profile PATH`` runs the workers of the last round under cProfile and writes ``PATH.256`` and
``PATH.4`` (read them with ``python -m pstats``); profiling slows the worker, so that round's
figures are not the ones to quote. ``--py-spy PATH`` samples them instead (py-spy, from the dev
extra; collapsed stacks, read with ``benchmarks/stacks.py``), which barely slows the worker.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_assembler import synthetic  # noqa: E402
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition  # noqa: E402

from sparseety import events as ev  # noqa: E402
from sparseety.config import Config, WorkerConfig  # noqa: E402
from sparseety.kafka import make_producer  # noqa: E402
from sparseety.lifecycle import tune_gc  # noqa: E402
from sparseety.streams.assembler import Assembler  # noqa: E402
from sparseety.streams.state import MemoryStore  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` and its threads, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (``VmHWM``), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def thread_cpu(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each thread of ``pid`` (by thread id)."""
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


STAGES = ("decode", "fold", "encode", "send", "state")


def stage_cpu(port: int) -> dict[str, float]:
    """The worker's ``sparseety:worker_stage_cpu_seconds_total`` per stage (its metrics endpoint)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = dict.fromkeys(STAGES, 0.0)
    for line in text.splitlines():
        if line.startswith("sparseety:worker_stage_cpu_seconds_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('stage="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def fold_cpu(cfg: WorkerConfig, events: list[dict[str, Any]], runs: int) -> float:
    """Median CPU seconds of the pure fold over ``events`` (the worker's settings, and the
    worker's garbage-collector settings: with CPython's defaults the fold's own rate falls as its
    state grows, which would flatter the ratio on longer workloads)."""
    times = []
    threshold = gc.get_threshold()
    gc.collect()
    tune_gc()  # freezes the inputs and this script's objects, as the worker its start-up heap
    try:
        for _ in range(runs):
            asm = Assembler(cfg, MemoryStore())
            start = time.process_time()
            for e in events:
                asm.apply(e)
            times.append(time.process_time() - start)
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
    return statistics.median(times)


def produce(cfg: Config, events: list[dict[str, Any]]) -> None:
    from sparseety.kafka import make_encoder

    enc = make_encoder(cfg, "EngineEvent", cfg.topics.engine_events)
    blobs = [(e["engine_name"].encode(), enc.encode(e)) for e in events]  # encoded before timing
    producer = make_producer(cfg)
    for i, (key, value) in enumerate(blobs):
        producer.produce(cfg.topics.engine_events, key=key, value=value)
        if i % 1000 == 999:
            producer.poll(0)
    if producer.flush(120) != 0:
        raise RuntimeError("events not delivered")


class TimelineCounter:
    """Counts distinct RequestAccounting keys on the timelines topic, reading incrementally."""

    def __init__(self, cfg: Config) -> None:
        topic = cfg.topics.timelines
        self.consumer = Consumer(
            cfg.kafka.librdkafka(
                **{"group.id": "bench-reader", "enable.auto.commit": False, "fetch.wait.max.ms": 20}
            )
        )
        self.consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        self.keys: set[bytes] = set()

    def wait(self, n: int, worker: Any, timeout_s: float) -> float:
        """Block until ``n`` distinct keys were seen; returns the monotonic time it happened."""
        deadline = time.monotonic() + timeout_s
        while len(self.keys) < n:
            for msg in self.consumer.consume(1000, 0.05):
                if not msg.error():
                    self.keys.add(msg.key())
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(self.keys)}/{n} timelines after {timeout_s}s:\n{worker.tail()}")
            if not worker.alive():
                raise RuntimeError(f"worker exited:\n{worker.tail()}")
        return time.monotonic()

    def close(self) -> None:
        self.consumer.close()


def warmup_events(engine: str) -> list[dict[str, Any]]:
    """One short epoch of another engine: the worker joins the group and folds once before timing."""
    from tests import factories as f

    return [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started(), engine=engine),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("w1", list(range(8))), engine=engine),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("w1", 8, 0, [1])]), engine=engine),
        f.wrap(3, ev.REQUEST_FINISHED, f.request_finished("w1", prompt=8, output=1, cached=0), engine=engine),
    ]


# The worker ends through os._exit (sparseety.lifecycle.exit_after), which skips cProfile's own
# dump: write the profile just before it.
_PROFILED = """
import cProfile, os, sys, time
prof = cProfile.Profile(time.process_time)  # CPU time: the machine is shared
real_exit = os._exit
def _exit(code):
    prof.disable()
    prof.dump_stats({path!r})
    real_exit(code)
os._exit = _exit
sys.argv = ["sparseety", *sys.argv[1:]]
from sparseety.cli import main
prof.enable()
main()
"""


def start_py_spy(pid: int, path: str) -> subprocess.Popen[bytes]:
    """Sample ``pid`` with py-spy (collapsed stacks) until SIGINT: only threads holding the GIL,
    since on a shared machine a thread back from ``select`` but waiting for a core is not idle to
    py-spy, and such samples hid where the CPU goes (most of a loaded run's samples)."""
    exe = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
    command = [exe, "record", "--pid", str(pid), "--rate", "1000", "--gil", "--format", "raw", "-o", path]
    sampler = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches before the workload starts
    return sampler


def run_worker(
    base: Config,
    tmp: Path,
    tag: str,
    events: list[dict[str, Any]],
    profile: str | None,
    py_spy: str | None = None,
) -> tuple[float, float, dict[str, float]]:
    """Worker (CPU seconds, wall seconds, CPU seconds per stage) to turn ``events`` into their
    timelines. The stages are the worker's ``sparseety:worker_stage_cpu_seconds_total`` (its batch
    thread), ``rest`` the batch thread's CPU outside them (Faust's delivery, acks, commits, timers),
    ``others`` the process's other threads (Faust's consumer thread)."""
    from sparseety.kafka import ensure_topics
    from tests.helpers import VENV_BIN, ComponentProcess, free_port

    port = free_port()
    cfg = base.replace(
        topics={
            "engine_events": f"{tag}.ee",
            "timelines": f"{tag}.tl",
            "usage": f"{tag}.us",
            "dlq": f"{tag}.dlq",
            "partitions": 1,
        },
        worker={"app_id": f"bench-{tag}", "metrics_port": port},
    )
    ensure_topics(cfg)
    command = None
    if profile:
        command = [str(VENV_BIN / "python"), "-c", _PROFILED.format(path=profile)]
    worker = ComponentProcess(cfg, ["worker", "--loglevel", "info"], tmp / f"{tag}.log", command).start()
    counter = TimelineCounter(cfg)
    try:
        assert worker.proc is not None
        produce(cfg, warmup_events("bench-warmup"))
        counter.wait(1, worker, 180)
        time.sleep(0.5)  # let the warm-up batch's changelog write and commit settle
        n_closed = 1 + sum(1 for e in events if ev.payload_type(e) == ev.REQUEST_FINISHED)
        sampler = start_py_spy(worker.proc.pid, py_spy) if py_spy else None
        threads0, stages0 = thread_cpu(worker.proc.pid), stage_cpu(port)
        cpu0, wall0 = cpu_seconds(worker.proc.pid), time.monotonic()
        produce(cfg, events)
        print(f"  produced in {time.monotonic() - wall0:.2f} s", flush=True)
        wall1 = counter.wait(n_closed, worker, 600)
        time.sleep(0.3)  # the last batch writes its state after its outputs were acknowledged
        cpu1 = cpu_seconds(worker.proc.pid)
        threads1, stages1 = thread_cpu(worker.proc.pid), stage_cpu(port)
        pid = worker.proc.pid
        print(f"  worker peak RSS {peak_rss_mib(pid):.0f} MiB", flush=True)
        split = {k: stages1[k] - stages0[k] for k in STAGES}
        # The batch thread is the main one; Faust's consumer thread and the rest are "others".
        split["rest"] = threads1.get(pid, 0.0) - threads0.get(pid, 0.0) - sum(split.values())
        split["others"] = sum(v - threads0.get(t, 0.0) for t, v in threads1.items() if t != pid)
        if sampler is not None:
            sampler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            sampler.wait(60)
        return cpu1 - cpu0, wall1 - wall0, split
    finally:
        counter.close()
        worker.stop()
        if worker.proc is not None:
            worker.proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="one round of the full workloads (under 2 minutes; shorter workloads read 15-40%% higher)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps-256", type=int, default=2000, help="engine steps of the batch-256 workload")
    ap.add_argument("--steps-4", type=int, default=20000, help="engine steps of the batch-4 workload")
    ap.add_argument("--only", type=int, choices=(4, 256), help="run one workload (no target lines)")
    ap.add_argument("--profile", help="write cProfiles of the last round's workers to PATH.<batch>")
    ap.add_argument(
        "--py-spy",
        help="sample the last round's workers with py-spy (collapsed stacks) into PATH.<batch>",
    )
    args = ap.parse_args()
    if args.quick:
        # One round of the same workloads, not shorter ones: at 400 / 4,000 steps the worker read
        # 15-40 % faster than over the full run's 2,000 / 20,000 (its fold stage per engine step
        # grows over a run; docs/benchmarks.md, stop 21), so a short run was not the full run's
        # figure in small.
        args.rounds = 1

    from sparseety.broker import EmbeddedBroker
    from sparseety.config import load_config
    from tests.helpers import free_port

    sizes = {256: args.steps_256, 4: args.steps_4}
    # batch 256: a request finishes every step (~256 output tokens each); batch 4: every 32
    # steps (~128 output tokens), so most events are small StepBatches.
    finish_every = {256: 1, 4: 32}
    workloads = {
        b: synthetic(b, steps, finish_every=finish_every[b])
        for b, steps in sizes.items()
        if args.only in (None, b)
    }
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-worker-"))
    cfg = load_config(data_dir=str(tmp), broker={"port": free_port()})
    broker = EmbeddedBroker(cfg)
    broker.start(create_topics=False)
    results: dict[int, dict[str, list[float]]] = {
        b: {"worker": [], "wall": [], "fold": []} for b in workloads
    }
    try:
        base = broker.client_config()
        print(
            f"worker settings: take_max {base.worker.take_max}, take_within_s {base.worker.take_within_s}, "
            f"commit_interval_s {base.worker.commit_interval_s}"
        )
        for r in range(args.rounds):
            for batch, (events, request_steps) in workloads.items():
                profile = f"{args.profile}.{batch}" if args.profile and r == args.rounds - 1 else None
                last = r == args.rounds - 1
                sampled = f"{args.py_spy}.{batch}" if args.py_spy and last else None
                cpu, wall, split = run_worker(base, tmp, f"b{batch}r{r}", events, profile, sampled)
                fold_s = fold_cpu(base.worker, events, 3)
                res = results[batch]
                res["worker"].append(cpu)
                res["wall"].append(wall)
                res["fold"].append(fold_s)
                for k, v in split.items():
                    res.setdefault(f"stage {k}", []).append(v / fold_s)
                # Measured in the worker at the same moment as the rest of its CPU, so the load of
                # a shared machine moves it less than the ratio to a fold timed afterwards.
                res.setdefault("own fold", []).append(split["fold"] / cpu)
                print(
                    f"round {r} batch {batch}: {len(events)} events, {request_steps} request-steps; "
                    f"worker {cpu:.2f} CPU-s ({wall:.2f} s wall), fold {fold_s:.2f} CPU-s; worker "
                    + ", ".join(f"{k} {v:.2f}" for k, v in split.items()),
                    flush=True,
                )
    finally:
        broker.stop()
    lines = {}
    for batch, (events, request_steps) in workloads.items():
        res = results[batch]
        worker_s, wall_s, fold_s = (statistics.median(res[k]) for k in ("worker", "wall", "fold"))
        ratio = fold_s / worker_s
        print(
            f"batch {batch:>3}: worker {request_steps / worker_s:>10,.0f} request-steps/CPU-s "
            f"({len(events) / worker_s:,.0f} events/CPU-s; "
            f"wall {request_steps / wall_s:,.0f} request-steps/s), "
            f"fold {request_steps / fold_s:,.0f} request-steps/CPU-s; ratio {ratio:.2f}"
        )
        print(
            f"batch {batch:>3}: worker CPU per fold CPU-s, by stage (medians): "
            + ", ".join(
                f"{k} {statistics.median(res[f'stage {k}']):.2f}" for k in (*STAGES, "rest", "others")
            )
            + f"; the worker's own fold stage / its CPU {statistics.median(res['own fold']):.2f}"
        )
        lines[batch] = (ratio, request_steps / worker_s, len(events) / worker_s)
    if args.only:
        return
    r4, _, events_4 = lines[4]
    r256, steps_256, _ = lines[256]
    print(f"bench_worker: batch-4 {events_4:.0f} events/s per worker core (worker/fold ratio {r4:.2f})")
    print(f"bench_worker: worker/fold ratio {r256:.2f}; {steps_256:.0f} request-steps/s")


if __name__ == "__main__":
    main()
