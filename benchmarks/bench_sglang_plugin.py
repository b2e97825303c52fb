"""The SGLang plugin's CPU against SGLang's own scheduler CPU, on the real SGLang CPU server.

Each round starts fresh SGLang servers on this CPU (``sparseety.stack.sglang_engine``: the
demo's and the e2e tests' server, ``CPU_ARGS``/``CPU_ENV``, from ``.venv-sglang``) on the tiny
local Llama (``sparseety.stack.tiny_models``; nothing is downloaded): one with the plugin on
(``SPARSEETY_*`` set, so SGLang's ``sglang.srt.plugins`` entry point loads it, publishing to an
embedded Tansu broker through its relay child process), one with it off (no ``SPARSEETY_*``:
the entry point returns at once), and, unless ``--no-aa``, a second one off (the A/A control).
The order of on and off alternates between rounds. The servers run torch with one thread
(``OMP_NUM_THREADS=1``, ``--omp-threads``): torch's default on this 2-core machine splits the
forward between the scheduler thread and a second OpenMP thread (about half each), which then
competes with the plugin's threads, the relay, SGLang's other processes and the client for the
second core; with one thread the forward is the scheduler thread's alone.

The workload, the same for every server: a warm-up at the largest batch (16 output tokens), then
per batch size B, B concurrent greedy requests on SGLang's native ``/generate``
(``sparseety.stack.sglang_engine.generate``), each a distinct 32-token prompt decoding
``--max-new`` tokens with ``ignore_eos``: after the admissions, every step is a decode step of
the B requests.

What is measured, from ``/proc``, sampled right before the requests are sent and right after
the last answer (start-up and warm-up are outside):

* ``scheduler``: the CPU (utime + stime of ``/proc/<pid>/task/<pid>/stat``, 10 ms ticks) of the
  main thread of SGLang's scheduler process (the server's descendant whose title SGLang sets to
  ``sglang::scheduler``). On this CPU that thread runs SGLang's event loop and the model's
  forward; the plugin's hooks run on it too, so their CPU is inside the on-vs-off difference of
  this figure and cannot be read apart from it here. ``others``: the process's other threads
  (torch's, ZMQ's, gloo's) less the plugin's;
* ``in-proc``: the plugin's own threads in that process (named with
  ``sparseety.lifecycle.name_os_thread``: the shipper, ``sparseety-shipper-<stream>``, and the
  reader of the relay's reports, ``sparseety-relay-in-<stream>``; ``comm`` keeps 15 characters,
  so every thread whose ``comm`` starts with ``sparseety-``);
* ``relay``: the relay child processes (``python -m sparseety.producers.relay``, children of the
  scheduler process; ``/proc/<pid>/stat``), their peak RSS, and their threads' CPU by name. The
  relay's supervisor polls its Kafka link every 5 ms while idle, and at the step rates SGLang
  reaches on this CPU that idle rate is a visible part of the relay's CPU: it is measured on
  each plugin-on server (3 s after the warm-up), and the share of the relay's CPU it accounts
  for over the same window is printed beside it;
* output tokens/s: output tokens (every request's ``completion_tokens``) over the wall time.

``in-proc`` and ``relay`` are read once the batch's last RequestFinished is on the topic (a
consumer in this process tails it), so what the workload handed over is in them; the requests
the plugin-on servers served are counted against the RequestFinished events at the end.

Per output token is per request-step (one request, one step); per step is that times B (a
decode step produces B tokens). Medians over rounds: scheduler thread CPU per step on and off,
its on/off ratio (A/A beside it), in-proc / scheduler thread CPU (per on server, then the
median), relay CPU per 1,000 request-steps, tokens/s on/off. The last line is the largest
batch's::

    bench_sglang_plugin: plugin in-process cpu / scheduler cpu 0.0NN; scheduler thread on/off N.NNN;
    relay cpu ms per 1,000 request-steps N.N; tokens/s on/off N.NNN

    .venv/bin/python benchmarks/bench_sglang_plugin.py            # batches 16, 64; 3 rounds on/off/off
    .venv/bin/python benchmarks/bench_sglang_plugin.py --quick    # batch 64; 2 rounds on/off/off
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparseety.config import Config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_engine_sim import _peak_rss_mib, _proc_cpu_s  # noqa: E402

SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
SCHEDULER_TITLE = "sglang::scheduler"
RELAY_MODULE = "sparseety.producers.relay"
PLUGIN_THREAD_PREFIX = "sparseety-"  # name_os_thread's names, cut to 15 characters by the kernel
PROMPT_LEN = 32
WARMUP_NEW = 16
IDLE_PROBE_S = 3.0
TOPIC = "bench-sglang.engine-events"
KINDS = ("on", "off", "aa")  # the plugin on, off, off again (the A/A control)


# --- /proc -----------------------------------------------------------------------------------


def _stat_fields(path: Path) -> list[str]:
    """The fields of a ``stat`` file after ``(comm)``: [0] is the state, [1] the parent pid,
    [11] utime and [12] stime in clock ticks."""
    return path.read_text().rsplit(")", 1)[1].split()


def _task_cpu_s(pid: int, tid: int) -> float:
    """CPU seconds (user + system) of thread ``tid`` of process ``pid`` alone (``/proc/<tid>/stat``
    would sum the whole process)."""
    try:
        fields = _stat_fields(Path(f"/proc/{pid}/task/{tid}/stat"))
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_stat_fields(entry / "stat")[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


@dataclass(frozen=True)
class ThreadCpu:
    """A thread's ``comm`` and CPU seconds (or, summed by name, several threads')."""

    comm: str
    cpu_s: float

    @property
    def plugin(self) -> bool:
        return self.comm.startswith(PLUGIN_THREAD_PREFIX)


def _threads(pid: int) -> dict[int, ThreadCpu]:
    """The live threads of process ``pid``, by tid."""
    out = {}
    with contextlib.suppress(OSError):
        for entry in Path(f"/proc/{pid}/task").iterdir():
            tid = int(entry.name)
            try:
                comm = (entry / "comm").read_text().strip()
            except OSError:
                continue
            out[tid] = ThreadCpu(comm, _task_cpu_s(pid, tid))
    return out


@dataclass(frozen=True)
class Snapshot:
    """CPU seconds of the scheduler process's threads and of its relay children at one moment."""

    threads: dict[int, ThreadCpu]  # by tid
    relays: dict[int, float]  # relay pid -> CPU seconds
    relay_threads: dict[int, ThreadCpu]  # the relays' live threads, by tid

    def cpu_s(self, tid: int) -> float:
        """Thread ``tid``'s CPU seconds (0 for a thread not alive then)."""
        t = self.threads.get(tid)
        return t.cpu_s if t is not None else 0.0

    def plugin_tids(self) -> set[int]:
        return {tid for tid, t in self.threads.items() if t.plugin}


@dataclass(frozen=True)
class Scheduler:
    """SGLang's scheduler process of one server (found by its process title)."""

    pid: int
    title: str

    @classmethod
    def find(cls, server_pid: int) -> Scheduler:
        found = [p for p in _descendants(server_pid) if _cmdline(p).startswith(SCHEDULER_TITLE)]
        if len(found) != 1:
            raise RuntimeError(f"expected one {SCHEDULER_TITLE} under pid {server_pid}, found {found}")
        return cls(found[0], _cmdline(found[0]))

    def relay_pids(self) -> list[int]:
        return [p for p in _children(self.pid) if RELAY_MODULE in _cmdline(p)]

    def snapshot(self) -> Snapshot:
        relays = self.relay_pids()
        relay_threads = {tid: t for p in relays for tid, t in _threads(p).items()}
        return Snapshot(_threads(self.pid), {p: _proc_cpu_s(p) for p in relays}, relay_threads)

    def relay_idle_ms_per_s(self, seconds: float = IDLE_PROBE_S) -> float:
        """The relay's CPU while nothing is handed over (its supervisor polls its Kafka link)."""
        before = self.snapshot().relays
        time.sleep(seconds)
        after = self.snapshot().relays
        return sum(c - before.get(p, 0.0) for p, c in after.items()) / seconds * 1e3

    def layout(self) -> str:
        """The process's threads and relay children, as found (printed once, to check by eye)."""
        s = self.snapshot()
        names = sorted({t.comm for t in s.threads.values()})
        relays = ", ".join(f"{p} ({_cmdline(p)})" for p in s.relays) or "none"
        return f"scheduler pid {self.pid} ({self.title}): threads {names}; relays: {relays}"


# --- the plugin's topic ----------------------------------------------------------------------


class TopicTail:
    """The plugin's topic, read as it fills: the requests whose RequestFinished is on it.

    A batch's relay and in-proc CPU are read once its last RequestFinished is there (produced and
    acknowledged), so that what the workload handed over is in the figure and the relay's idle
    time after it is not."""

    def __init__(self, cfg: Config) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        from sparseety.kafka import make_decoder

        self._consumer = Consumer(
            cfg.kafka.librdkafka(
                **{"group.id": "bench-sglang", "enable.auto.commit": False, "fetch.wait.max.ms": 20}
            )
        )
        self._consumer.assign([TopicPartition(TOPIC, 0, OFFSET_BEGINNING)])
        self._decoder = make_decoder(cfg)
        self.finished: set[str] = set()

    def wait_finished(self, prefix: str, n: int, timeout_s: float = 60.0) -> None:
        """Until ``n`` requests whose ids start with ``prefix`` have finished on the topic."""
        from sparseety import events as ev

        deadline = time.monotonic() + timeout_s
        count = sum(r.startswith(prefix) for r in self.finished)
        while count < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} of {n} RequestFinished for {prefix}* on {TOPIC}")
            msg = self._consumer.poll(0.2)
            value = msg.value() if msg is not None and not msg.error() else None
            if value is None:
                continue
            event = self._decoder.decode(value)[1]
            if ev.payload_type(event) == ev.REQUEST_FINISHED:
                rid = str(ev.payload(event)["request_id"])
                if rid.startswith(prefix) and rid not in self.finished:
                    count += 1
                self.finished.add(rid)

    def close(self) -> None:
        self._consumer.close()


# --- one measurement -------------------------------------------------------------------------


@dataclass(frozen=True)
class Measure:
    """One batch size on one server: CPU seconds over the timed workload, and its output."""

    kind: str  # on, off, aa
    batch: int
    tokens: int  # output tokens = request-steps
    wall_s: float  # the requests sent -> the last answer
    scheduler_s: float  # the scheduler's main thread, over wall_s
    others_s: float  # the scheduler process's other threads less the plugin's, over wall_s
    inproc_s: float  # the plugin's threads in the scheduler process, until delivered
    plugin_threads: tuple[str, ...]
    relay_s: float  # the relay processes, until delivered
    relay_window_s: float  # the requests sent -> their last RequestFinished on the topic
    relay_idle_ms_per_s: float  # the relay's CPU while idle, on this server
    relay_rss_mib: float
    relay_by_thread: tuple[ThreadCpu, ...]  # the relays' live threads' CPU, summed by name
    relay_restarted: bool  # the relay pids changed during the window

    @property
    def scheduler_us_per_token(self) -> float:
        return self.scheduler_s / self.tokens * 1e6

    @property
    def scheduler_us_per_step(self) -> float:
        return self.scheduler_us_per_token * self.batch

    @property
    def others_us_per_step(self) -> float:
        return self.others_s / self.tokens * 1e6 * self.batch

    @property
    def inproc_us_per_step(self) -> float:
        return self.inproc_s / self.tokens * 1e6 * self.batch

    @property
    def inproc_ratio(self) -> float:
        return self.inproc_s / self.scheduler_s if self.scheduler_s else 0.0

    @property
    def relay_ms_per_k(self) -> float:
        """Relay CPU ms per 1,000 request-steps."""
        return self.relay_s / self.tokens * 1e6

    @property
    def relay_idle_share(self) -> float:
        """The part of ``relay_s`` its idle rate accounts for over the same window."""
        return self.relay_idle_ms_per_s * self.relay_window_s / 1e3 / self.relay_s if self.relay_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def summary(self) -> str:
        text = (
            f"batch {self.batch}: scheduler {self.scheduler_us_per_step:,.0f} us/step, others "
            f"{self.others_us_per_step:,.0f}, {self.tokens_per_s:,.0f} tokens/s"
        )
        if self.kind != "on":
            return text
        threads = ", ".join(f"{t.comm} {t.cpu_s * 1e3:.0f}" for t in self.relay_by_thread[:4])
        return (
            f"{text}; in-proc {self.inproc_s * 1e3:.0f} ms ({self.inproc_ratio:.3f} of scheduler), "
            f"relay {self.relay_s * 1e3:.0f} ms ({self.relay_ms_per_k:.1f} per 1k request-steps, "
            f"{self.relay_idle_share:.0%} at its idle rate; threads, ms: {threads}"
            + ("; the relay was restarted" if self.relay_restarted else "")
            + ")"
        )


def _ids(seed: int, n: int) -> list[int]:
    """Deterministic token ids inside the tiny model's vocabulary (no special tokens)."""
    return [4 + (seed * 131 + i * 37 + (i * i) % 11) % 500 for i in range(n)]


def _send(url: str, tag: str, batch: int, max_new: int, seed: int) -> int:
    """``batch`` concurrent greedy requests (ids ``<tag>-<i>``); their output tokens (checked:
    ``max_new`` each)."""
    from sparseety.stack.sglang_engine import generate

    with ThreadPoolExecutor(max_workers=batch) as pool:
        jobs = [
            pool.submit(generate, url, f"{tag}-{i}", "bench", _ids(seed + i, PROMPT_LEN), max_new)
            for i in range(batch)
        ]
        done = [int(j.result()["meta_info"]["completion_tokens"]) for j in jobs]
    if done != [max_new] * batch:
        raise RuntimeError(f"{tag}: expected {max_new} output tokens per request, got {sorted(set(done))}")
    return sum(done)


@dataclass(frozen=True)
class Server:
    """One running server as the measurement sees it."""

    kind: str
    url: str
    scheduler: Scheduler
    tail: TopicTail | None  # the plugin's topic (plugin on)
    relay_idle_ms_per_s: float


def measure(server: Server, tag: str, batch: int, max_new: int, seed: int) -> Measure:
    sched = server.scheduler
    before = sched.snapshot()
    w0 = time.monotonic()
    tokens = _send(server.url, tag, batch, max_new, seed)
    wall_s = time.monotonic() - w0
    at_end = sched.snapshot()  # the scheduler's thread: right at the last answer
    if server.tail is not None:
        server.tail.wait_finished(f"{tag}-", batch)
    window_s = time.monotonic() - w0
    after = sched.snapshot() if server.tail is not None else at_end  # the plugin's threads, the relay
    plugin = after.plugin_tids()
    others = set(at_end.threads) - plugin - {sched.pid}
    return Measure(
        kind=server.kind,
        batch=batch,
        tokens=tokens,
        wall_s=wall_s,
        scheduler_s=at_end.cpu_s(sched.pid) - before.cpu_s(sched.pid),
        others_s=sum(at_end.cpu_s(t) - before.cpu_s(t) for t in others),
        inproc_s=sum(after.cpu_s(t) - before.cpu_s(t) for t in plugin),
        plugin_threads=tuple(sorted(after.threads[t].comm for t in plugin)),
        relay_s=sum(c - before.relays.get(p, 0.0) for p, c in after.relays.items()),
        relay_window_s=window_s,
        relay_idle_ms_per_s=server.relay_idle_ms_per_s,
        relay_rss_mib=max((_peak_rss_mib(p) for p in after.relays), default=0.0),
        relay_by_thread=_by_name(before.relay_threads, after.relay_threads),
        relay_restarted=set(before.relays) != set(after.relays),
    )


def _by_name(before: dict[int, ThreadCpu], after: dict[int, ThreadCpu]) -> tuple[ThreadCpu, ...]:
    """Each thread's CPU between two snapshots, summed by ``comm``, largest first."""
    sums: dict[str, float] = {}
    for tid, t in after.items():
        prior = before.get(tid)
        sums[t.comm] = sums.get(t.comm, 0.0) + t.cpu_s - (prior.cpu_s if prior is not None else 0.0)
    return tuple(sorted((ThreadCpu(c, v) for c, v in sums.items()), key=lambda t: -t.cpu_s))


# --- a server per kind -----------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    batches: tuple[int, ...]
    max_new: int
    omp_threads: int  # torch's threads in the server (OMP_NUM_THREADS); 0: torch's default
    log_dir: Path


def one_server(
    model: Path,
    env: dict[str, str],
    kind: str,
    n: int,
    settings: Settings,
    tail: TopicTail | None,
    show_layout: bool,
) -> tuple[list[Measure], int]:
    """Start a fresh server (plugin on when ``env`` carries the ``SPARSEETY_*`` variables; then
    ``tail`` reads its topic), warm it up, measure each batch size, stop it; the measures and the
    number of requests it served."""
    from sparseety.stack.sglang_engine import SglangServer

    biggest = max(settings.batches)
    t0 = time.monotonic()
    threads = {"OMP_NUM_THREADS": str(settings.omp_threads)} if settings.omp_threads else {}
    proc = SglangServer(
        SGLANG_PYTHON,
        model,
        {**env, **threads},
        settings.log_dir / f"sglang-{n}-{kind}.log",
        max_total_tokens=biggest * (PROMPT_LEN + settings.max_new) + 1024,
    )
    try:
        ready_s = time.monotonic() - t0
        sched = Scheduler.find(proc.proc.pid)
        warm = f"r{n}{kind}-warm"
        _send(proc.url, warm, biggest, WARMUP_NEW, seed=10_000 * n)
        if tail is not None:
            tail.wait_finished(f"{warm}-", biggest)
        if show_layout:
            print(f"  layout ({kind}): {sched.layout()}", flush=True)
        plugin_found = bool(sched.snapshot().plugin_tids())
        if plugin_found != (tail is not None) or bool(sched.relay_pids()) != (tail is not None):
            raise RuntimeError(
                f"plugin {kind}, but its threads found: {plugin_found}, relay: {sched.relay_pids()}; "
                f"see {proc.log}"
            )
        idle = sched.relay_idle_ms_per_s() if tail is not None else 0.0
        server = Server(kind, proc.url, sched, tail, idle)
        out = [  # distinct prompts per batch: no radix-cache hits from the batch before
            measure(server, f"r{n}{kind}-b{b}", b, settings.max_new, seed=10_000 * n + 1_000 * (j + 1))
            for j, b in enumerate(settings.batches)
        ]
    finally:
        proc.close()
    print(
        f"  round {n} {kind:>3}: ready in {ready_s:.0f} s"
        + (f"; relay idle {idle:.1f} ms/s" if tail is not None else "")
        + "".join(f"; {m.summary()}" for m in out)
        + (f"; plugin threads {list(out[-1].plugin_threads)}" if out[-1].plugin_threads else ""),
        flush=True,
    )
    return out, biggest + sum(settings.batches)


# --- the report ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """Medians over rounds for one batch size."""

    batch: int
    scheduler_on_us: float  # scheduler thread CPU per step
    scheduler_off_us: float
    thread_ratio: float  # on / off
    aa_ratio: float | None
    others_off_us: float
    inproc_us: float  # the plugin's threads per step
    inproc_ratio: float
    relay_ms_per_k: float
    relay_idle_share: float
    relay_rss_mib: float
    tokens_per_s_on: float
    tokens_per_s_off: float
    tps_ratio: float
    tps_aa: float | None

    @classmethod
    def of(cls, batch: int, runs: list[Measure]) -> Row:
        def med(kind: str, value: str) -> float:
            return statistics.median(getattr(m, value) for m in runs if m.kind == kind and m.batch == batch)

        has_aa = any(m.kind == "aa" and m.batch == batch for m in runs)
        off_us, off_tps = med("off", "scheduler_us_per_step"), med("off", "tokens_per_s")
        return cls(
            batch=batch,
            scheduler_on_us=med("on", "scheduler_us_per_step"),
            scheduler_off_us=off_us,
            thread_ratio=med("on", "scheduler_us_per_step") / off_us,
            aa_ratio=med("aa", "scheduler_us_per_step") / off_us if has_aa else None,
            others_off_us=med("off", "others_us_per_step"),
            inproc_us=med("on", "inproc_us_per_step"),
            inproc_ratio=med("on", "inproc_ratio"),
            relay_ms_per_k=med("on", "relay_ms_per_k"),
            relay_idle_share=med("on", "relay_idle_share"),
            relay_rss_mib=max(m.relay_rss_mib for m in runs if m.kind == "on" and m.batch == batch),
            tokens_per_s_on=med("on", "tokens_per_s"),
            tokens_per_s_off=off_tps,
            tps_ratio=med("on", "tokens_per_s") / off_tps,
            tps_aa=med("aa", "tokens_per_s") / off_tps if has_aa else None,
        )

    def line(self) -> str:
        aa = f" (A/A {self.aa_ratio:.3f})" if self.aa_ratio is not None else ""
        tps_aa = f" (A/A {self.tps_aa:.3f})" if self.tps_aa is not None else ""
        return (
            f"batch {self.batch:3d}: scheduler thread {self.scheduler_on_us:,.0f} / "
            f"{self.scheduler_off_us:,.0f} us/step on/off = {self.thread_ratio:.3f}{aa}; "
            f"other threads (off) {self.others_off_us:,.0f} us/step; in-proc {self.inproc_us:,.0f} "
            f"us/step, / scheduler {self.inproc_ratio:.3f}; relay {self.relay_ms_per_k:.1f} ms per 1k "
            f"request-steps ({self.relay_idle_share:.0%} at its idle rate), peak RSS "
            f"{self.relay_rss_mib:.0f} MiB; "
            f"tokens/s {self.tokens_per_s_on:,.0f} / {self.tokens_per_s_off:,.0f} = "
            f"{self.tps_ratio:.3f}{tps_aa}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--max-new", type=int, default=128, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-aa", action="store_true", help="leave out the second plugin-off server")
    parser.add_argument(
        "--omp-threads", type=int, default=1, help="torch's threads in the server (0: torch's default)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 rounds of on/off/A-A at batch 64 (3-7 minutes here, with the load)",
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.batches = 2, "64"
    if not SGLANG_PYTHON.exists():
        raise SystemExit(f"{SGLANG_PYTHON} is missing: scripts/setup_sglang.sh builds SGLang's venv")

    from sparseety.broker import EmbeddedBroker
    from sparseety.config import load_config, to_env
    from sparseety.kafka import ensure_topics
    from sparseety.stack.tiny_models import build_tiny_model
    from tests.e2e.conftest import MODEL_CACHE
    from tests.helpers import free_port

    model = build_tiny_model("llama", MODEL_CACHE / "llama")
    batches = tuple(int(b) for b in args.batches.split(","))
    kinds = KINDS[:2] if args.no_aa else KINDS
    print(
        f"bench_sglang_plugin: the real SGLang CPU server (.venv-sglang), tiny Llama; "
        f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
        f"{args.rounds} rounds of {'/'.join(kinds)} servers; batches {list(batches)} x "
        f"{args.max_new} output tokens, prompts of {PROMPT_LEN}; OMP_NUM_THREADS "
        f"{args.omp_threads or 'unset'} in the server",
        flush=True,
    )
    wall0 = time.monotonic()
    runs: list[Measure] = []
    served_on = 0
    with tempfile.TemporaryDirectory(prefix="sparseety-bench-sglang-") as tmp:
        cfg = load_config(data_dir=tmp, broker={"port": free_port()})
        broker = EmbeddedBroker(cfg)
        broker.start(create_topics=False)
        try:
            ecfg = broker.client_config().replace(
                data_dir=tmp,
                topics={**cfg.topics.model_dump(), "engine_events": TOPIC, "partitions": 1},
                producer={"engine_name": "bench-sglang"},
            )
            ensure_topics(ecfg, [TOPIC])
            tail = TopicTail(ecfg)
            base = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
            envs = {"on": {**base, **to_env(ecfg)}, "off": base, "aa": base}
            settings = Settings(batches, args.max_new, args.omp_threads, Path(tmp))
            try:
                for n in range(args.rounds):
                    order = kinds if n % 2 == 0 else (kinds[1], kinds[0], *kinds[2:])
                    for kind in order:
                        on = kind == "on"
                        measures, served = one_server(
                            model, envs[kind], kind, n, settings, tail if on else None, show_layout=n == 0
                        )
                        runs += measures
                        served_on += served if on else 0
            finally:
                tail.close()
            ours = tuple(f"r{n}on-" for n in range(args.rounds))
            finished = sum(r.startswith(ours) for r in tail.finished)
        finally:
            broker.stop()
    print(
        f"delivered: {finished} RequestFinished events on the topic for the {served_on} requests "
        f"the plugin-on servers served; {time.monotonic() - wall0:.0f} s in all; "
        f"load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rows = [Row.of(b, runs) for b in batches]
    for row in rows:
        print(row.line(), flush=True)
    big = max(rows, key=lambda r: r.batch)
    print(
        f"bench_sglang_plugin: plugin in-process cpu / scheduler cpu {big.inproc_ratio:.3f}; "
        f"scheduler thread on/off {big.thread_ratio:.3f}; relay cpu ms per 1,000 request-steps "
        f"{big.relay_ms_per_k:.1f}; tokens/s on/off {big.tps_ratio:.3f}"
    )


if __name__ == "__main__":
    main()
