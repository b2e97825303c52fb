"""``sparseety demo``: the whole pipeline on one machine, ending in a cost-attribution report.

1. build the tiny local MoE model with a sliding window (unless ``--model`` names a checkpoint);
2. prepare the store (migrations, demo prices) and start the embedded stack;
3. run a real vLLM engine with the plugin (prefix caching, ngram drafts, MoE routing capture, a
   small KV cache) under a workload that makes every token status happen;
4. wait until every request the engine served is visible in SQL;
5. print the report — per tenant: requests, token classes, cost in each attribution mode;
   prefix-cache savings, waste, speculative efficiency, expert load, a short modelled "what if"
   and the current sparsity regressions ("regressions: none") — and check it: per-tenant
   totals equal the sum over requests, and request and token counts equal what vLLM returned;
6. write the HTML dashboard and stop the stack.

``--engine sglang`` runs step 3 on a real SGLang server instead (``sparseety.stack.sglang_engine``:
the same workload, the tiny Llama, SGLang's own venv) and checks the report against SGLang's
``meta_info`` and ``/metrics``; the vLLM-only counters (drafts, preemptions, reasoning parser,
MoE routing) are not part of that check (docs/sglang.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from sparseety.api.client import RemoteApiError, RemoteQueries
from sparseety.api.params import scope
from sparseety.config import Config, to_env
from sparseety.errors import SparseetyError
from sparseety.queries.registry import QueryError, Scope
from sparseety.sinks.output import render
from sparseety.stack.engine import TINY_ENGINE, TINY_REASONING_PARSER
from sparseety.stack.engine_checks import check_engine_counters, reasoning_by_tenant, same_text
from sparseety.stack.supervisor import Stack

Say = Callable[[str], None]

#: Demo prices (USD per million tokens, per GPU-hour): list prices of a mid-size model.
DEMO_PRICES = {"input": "3.00", "cached_input": "0.30", "output": "15.00", "gpu_hour": "2.50"}
#: The per-request columns the report sums per tenant, their short names, and what each means
#: (docs/streams.md has the classes and the identity they satisfy).
CLASS_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("prompt_tokens", "prompt", "prompt positions"),
    ("output_tokens", "output", "output positions"),
    (
        "cache_read_tokens",
        "cache_read",
        "positions read from the prefix cache; a re-read after a preemption counts again",
    ),
    ("uncached_computed_tokens", "computed", "first-time computation (not drafts, not recomputes)"),
    ("recomputed_preemption_tokens", "re_preempt", "re-prefill after a preemption: waste"),
    (
        "recomputed_eviction_tokens",
        "re_evict",
        "blocks the prefix cache had evicted, computed again: a bigger KV cache avoids it",
    ),
    ("draft_accepted_tokens", "drafts_ok", "speculative drafts verified and kept as output"),
    ("draft_rejected_tokens", "drafts_rej", "speculative drafts verified and rejected: waste"),
    (
        "draft_cut_tokens",
        "drafts_cut",
        "drafts thrown away because the request ended (cut by its stop, or never verified): waste",
    ),
    ("window_released_tokens", "win_released", "KV freed by a sliding window or chunk while the request ran"),
    (
        "skipped_tokens",
        "skipped",
        "positions attention never looked at by the end (outside the window, or never computed)",
    ),
)
TOKEN_CLASSES = tuple(col for col, _, _ in CLASS_COLUMNS)
REASONING_MEANING = (
    "of output, the positions inside the think section (the engine's reasoning parser; "
    "vLLM's reasoning_tokens)"
)


class DemoError(SparseetyError):
    """The demo could not complete (the message says which step and where its log is)."""


@dataclass
class DemoResult:
    """What the demo produced (also used by the end-to-end test)."""

    run_dir: Path
    engine: dict[str, Any]
    requests: list[dict[str, Any]]
    by_tenant: dict[str, dict[str, Any]]
    report: str
    dashboard: Path
    problems: list[str] = field(default_factory=list)


def last_day() -> Scope:
    """What the report reads: requests finished in the last day (the demo's store is fresh)."""
    return scope(None, since="1d", now_ns=time.time_ns())


def _model(cfg: Config, model: Path | None, say: Say, engine: str = "vllm") -> tuple[Path, str]:
    if model is not None:
        return model, model.name
    from sparseety.stack.tiny_models import build_tiny_model

    if engine == "sglang":  # SGLang's CPU path serves a plain Llama (docs/sglang.md)
        path = cfg.data_path / "models" / "llama"
        say(f"model: building the tiny Llama under {path} (once)")
        return build_tiny_model("llama", path), "tiny-llama"

    path = cfg.data_path / "models" / "mixtral-sw-think"
    say(f"model: building the tiny MoE model with a sliding window under {path} (once)")
    return build_tiny_model("mixtral-sw-think", path), "tiny-mixtral-sw"


def _prepare_store(cfg: Config, model_name: str, say: Say) -> None:
    from sparseety.sinks.clickhouse.client import Store
    from sparseety.sinks.clickhouse.migrate import migrate
    from sparseety.sinks.clickhouse.prices import Price, set_prices

    say(f"store: migrating {cfg.clickhouse_dsn} and setting demo prices for {model_name}")
    store = Store.open(cfg, owner="sparseety demo")
    try:
        migrate(store, ttl_days=cfg.clickhouse.ttl_days)
        set_prices(store, [Price(model_name, c, Decimal(p)) for c, p in DEMO_PRICES.items()])
    finally:
        store.close()


def _run_engine(
    stack: Stack,
    model: Path,
    model_name: str,
    run_dir: Path,
    sessions: int,
    quick: bool,
    engine_args: dict[str, Any] | None,
    say: Say,
) -> dict[str, Any]:
    out = run_dir / "engine.json"
    cfg = _engine_config(stack)
    args = {**(engine_args or TINY_ENGINE), "served_model_name": model_name}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
    env.update(to_env(cfg))
    # The engine core runs in this child (one process, starts in seconds instead of ~40 s on CPU);
    # the MoE routing still comes from the model-runner hooks, on its own worker stream.
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    cmd = [
        sys.executable,
        "-m",
        "sparseety.stack.engine",
        "--model",
        str(model),
        "--out",
        str(out),
        "--sessions",
        str(sessions),
        "--engine-args",
        json.dumps(args),
    ]
    if quick:
        cmd.append("--quick")
    log_path = run_dir / "engine.log"
    say(f"engine: starting vLLM with the SparSEEty plugin (log {log_path})")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log)
        assert proc.stdout is not None
        for line in proc.stdout:
            text = line.decode(errors="replace").rstrip()
            log.write(line)
            if text.startswith("engine:"):
                say(text)
        code = proc.wait()
    if code != 0 or not out.exists():
        raise DemoError(f"the engine failed (exit {code}); see {log_path}")
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def _engine_config(stack: Stack) -> Config:
    return stack.cfg.replace(
        producer={
            **stack.cfg.producer.model_dump(),
            "engine_name": "demo-engine",
            "routing_capture": True,
            "heartbeat_interval_s": 1.0,
        },
    )


def _run_sglang(
    stack: Stack,
    python: Path,
    model: Path,
    model_name: str,
    run_dir: Path,
    sessions: int,
    quick: bool,
    say: Say,
) -> dict[str, Any]:
    from sparseety.stack import sglang_engine

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
    env.update(to_env(_engine_config(stack)))
    try:
        result = sglang_engine.run(python, model, model_name, env, run_dir, sessions, quick, say)
    except (OSError, SparseetyError) as exc:
        raise DemoError(f"the SGLang engine failed: {exc}") from exc
    (run_dir / "engine.json").write_text(json.dumps(result, indent=1))
    return result


def default_sglang_python() -> Path:
    """``.venv-sglang/bin/python`` beside this checkout (scripts/setup_sglang.sh makes it)."""
    return Path(__file__).resolve().parents[2] / ".venv-sglang" / "bin" / "python"


def _wait_visible(
    api: RemoteQueries, expected: int, say: Say, timeout_s: float = 120.0
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    seen = -1
    while True:
        rows = api.requests(limit=10_000, scope=last_day())
        if len(rows) != seen:
            say(f"pipeline: {len(rows)}/{expected} requests visible in SQL")
            seen = len(rows)
        if len(rows) >= expected:
            return rows
        if time.monotonic() > deadline:
            raise DemoError(f"only {len(rows)} of {expected} requests reached the store in {timeout_s:.0f} s")
        time.sleep(1.0)


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """``rows`` in ``columns`` as the CLI prints tables (:func:`sparseety.sinks.output.render`)."""
    return render([{c: r.get(c, "") for c in columns} for r in rows], "table")


def build_report(
    api: RemoteQueries, engine: dict[str, Any], stored: list[dict[str, Any]]
) -> tuple[str, dict[str, Any], list[str]]:
    """The report text, per-tenant totals, and any mismatch against the engine's own answers."""
    kind = engine.get("kind", "vllm")
    label = ENGINE_LABELS[kind]
    tenants: dict[str, dict[str, Any]] = {}
    for r in stored:
        t = tenants.setdefault(
            r["tenant"], {"tenant": r["tenant"], "requests": 0, **dict.fromkeys(TOKEN_CLASSES, 0)}
        )
        t["requests"] += 1
        for k in TOKEN_CLASSES:
            t[k] += int(r[k])
    costs: dict[str, dict[str, Any]] = {}
    for mode in ("list", "actual", "amortized", "gpu"):
        for row in api.cost(by=["tenant"], mode=mode, scope=last_day()):
            costs.setdefault(row["tenant"], {})[mode] = row
    problems = []
    for name, t in tenants.items():
        row = costs.get(name, {}).get("actual", {})
        # the stored rows are engine requests: the cost query's sequences (its requests count
        # API requests, an n = 2 completion once; the demo sends none)
        if int(row.get("sequences", -1)) != t["requests"]:
            problems.append(
                f"tenant {name}: cost query counts {row.get('sequences')} engine requests, "
                f"the rows say {t['requests']}"
            )
        for k in ("prompt_tokens", "output_tokens"):
            if k in row and int(row[k]) != t[k]:
                problems.append(f"tenant {name}: cost query {k} {row[k]} != sum over requests {t[k]}")
        for mode in ("list", "actual", "amortized", "gpu"):
            t[f"cost_{mode}"] = costs.get(name, {}).get(mode, {}).get("cost_usd", "?")
        # KV memory-time held, amortized (shared prefix blocks split among holders), GiB-seconds
        amortized = costs.get(name, {}).get("amortized", {})
        kv = amortized.get("kv_byte_ms")
        t["kv_gib_s"] = f"{int(kv) / (1 << 30) / 1000:.3g}" if kv is not None else "not observed"
        if amortized and (kv is None or int(amortized.get("kv_not_observed", 0)) or int(kv) <= 0):
            problems.append(f"tenant {name}: KV memory-time not observed for every request")
    eng = engine["requests"]
    if len(stored) != len(eng):
        problems.append(f"{len(stored)} requests stored, the engine served {len(eng)}")
    details = _details(api, stored)
    problems += check_engine_counters(details, engine, kind)
    for name, count in reasoning_by_tenant(details).items():
        tenants[name]["reasoning"] = "not observed" if count is None else count
    lines = ["", "SparSEEty demo report", "=" * 21, ""]
    lines.append(f"engine: {len(eng)} requests served by {label}; {len(stored)} accounted in ClickHouse")
    if kind == "sglang":
        m = {k.rsplit("=", 1)[-1]: v for k, v in engine.get("metrics", {}).items()}
        lines.append(
            "engine metrics (sglang:realtime_tokens_total): prefill computed "
            f"{m.get('prefill_compute', '?')}, prefill from cache {m.get('prefill_cache', '?')}, "
            f"decode {m.get('decode', '?')}"
        )
    else:
        m = {k.removeprefix("vllm:"): v for k, v in engine.get("metrics", {}).items()}
        lines.append(
            f"engine metrics: prompt {m.get('prompt_tokens', '?')}, "
            f"generated {m.get('generation_tokens', '?')}, "
            f"prefix-cache hits {m.get('prefix_cache_hits', '?')}, drafts verified "
            f"{m.get('spec_decode_num_draft_tokens', '?')} and accepted "
            f"{m.get('spec_decode_num_accepted_tokens', '?')}, preemptions {m.get('num_preemptions', '?')}"
        )
    lines += [
        "",
        "Tokens per tenant. Compute: computed + re_preempt + re_evict + drafts_ok + drafts_rej + drafts_cut",
        "= every token the engine computed. Positions: prompt + output, each obtained once by cache_read,",
        "computed or a recompute (not additive with compute: re-reads and re-prefill repeat positions).",
        "",
    ]
    lines += [f"  {name:<12} {meaning}" for _, name, meaning in CLASS_COLUMNS]
    lines.append(f"  {'reasoning':<12} {REASONING_MEANING}")
    lines.append("")
    short = {col: name for col, name, _ in CLASS_COLUMNS}
    rows = [
        {
            "tenant": t["tenant"],
            "requests": t["requests"],
            **{short[k]: t[k] for k in TOKEN_CLASSES},
            "reasoning": t.get("reasoning", "not observed"),
        }
        for t in sorted(tenants.values(), key=lambda x: x["tenant"])
    ]
    lines.append(_table(rows, ["tenant", "requests", *short.values(), "reasoning"]))
    lines += ["", "Cost per tenant, USD (docs/cost-model.md):", ""]
    rows = [
        {
            "tenant": t["tenant"],
            **{mode: t[f"cost_{mode}"] for mode in ("list", "actual", "amortized", "gpu")},
            "kv_GiB_s": t["kv_gib_s"],
        }
        for t in sorted(tenants.values(), key=lambda x: x["tenant"])
    ]
    lines.append(_table(rows, ["tenant", "list", "actual", "amortized", "gpu", "kv_GiB_s"]))
    lines.append("  kv_GiB_s: KV cache held x time, amortized (docs/cost-model.md, kv); not priced here")
    lines += bill_2026_lines(details, engine)  # whole rows (the listing has no such columns)
    for title, ask, drafts in (
        ("Prefix-cache savings", api.savings, False),
        (
            "Waste (re-prefill after preemption + rejected and cut drafts; re_evict apart as evictable)",
            api.waste,
            False,
        ),
        ("Speculative decoding", api.spec_efficiency, True),
    ):
        if kind == "sglang" and drafts:
            # not 0 drafts: SGLang's CPU path runs no speculative decoding (docs/sglang.md)
            lines += ["", f"{title}: not observed (SGLang's CPU path runs none; docs/sglang.md)"]
            continue
        try:
            data = ask(by=["tenant"], scope=last_day())
        except (RemoteApiError, QueryError) as exc:
            data = [{"error": str(exc)}]
        if data:
            lines += ["", f"{title}:", "", _table(data, list(data[0]))]
    try:
        experts = api.expert_load(scope=last_day())
    except (RemoteApiError, QueryError):
        experts = []
    if experts:
        by_layer: dict[Any, list[dict[str, Any]]] = {}
        for e in experts:
            by_layer.setdefault(e.get("layer"), []).append(e)
        lines += ["", "MoE expert load (tokens routed per expert):"]
        for layer, rows_ in sorted(by_layer.items(), key=lambda kv: str(kv[0])):
            counts = ", ".join(f"e{r.get('expert')}={r.get('tokens', r.get('count', '?'))}" for r in rows_)
            lines.append(f"  layer {layer}: {counts}")
    lines += _whatif_and_regressions(api)
    restored, mismatch = restored_request(api, engine, stored)
    lines += restored
    problems += mismatch
    lines += [
        "",
        f"{CHECK_LINES[kind]}: " + ("OK" if not problems else "MISMATCH"),
    ]
    lines += [f"  - {p}" for p in problems]
    return "\n".join(lines), tenants, problems


#: The cache-tier columns of the report (sparseety/billing.py): short name, RequestAccounting field.
TIER_COLUMNS = (
    ("gpu", "cache_read_tokens"),
    ("cpu_offload", "cache_read_cpu_offload_tokens"),
    ("host", "cache_read_host_tokens"),
    ("storage", "cache_read_storage_tokens"),
    ("external", "external_kv_tokens"),
)


def bill_2026_lines(stored: list[dict[str, Any]], engine: dict[str, Any]) -> list[str]:
    """The report's cache writes and cache tiers per tenant (docs/cost-model.md, "The bill of
    2026"): SparSEEty's cache writes beside vLLM's own count, and the reads of each tier."""
    theirs: dict[str, int | None] = {}
    for r in engine.get("requests", []):
        n = r.get("num_cache_creation_tokens")
        prev = theirs.get(r["tenant"])
        theirs[r["tenant"]] = prev if n is None else (prev or 0) + int(n)
    by: dict[str, dict[str, Any]] = {}
    for r in stored:
        t = by.setdefault(
            r["tenant"], {"tenant": r["tenant"], "cache_write": 0, **{k: 0 for k, _ in TIER_COLUMNS}}
        )
        t["cache_write"] += int(r.get("cache_write_tokens", 0))
        for short, column in TIER_COLUMNS:
            t[short] += int(r.get(column, 0))
    rows = [
        {**t, "cache_write_engine": "not reported" if theirs.get(name) is None else theirs[name]}
        for name, t in sorted(by.items())
    ]
    columns = ["tenant", "cache_write", "cache_write_engine", *(k for k, _ in TIER_COLUMNS)]
    return [
        "",
        "Cache writes and cache reads by tier, tokens (docs/cost-model.md, The bill of 2026):",
        "",
        _table(rows, columns),
        "  cache_write: prompt positions a request computed and wrote to the prefix cache (a new entry);",
        "  cache_write_engine: vLLM's created_cache_tokens, which also counts a copy two requests computed",
        "  in one step; gpu .. external: where each cached prompt position came from",
    ]


def _whatif_and_regressions(api: RemoteQueries) -> list[str]:
    """The report's "what if" (modelled, docs/cost-model.md) and "regressions" lines."""
    lines = ["", "What if (modelled; docs/cost-model.md, What if):", ""]
    rows = []
    for scenario in ("no-cache", "kv-x2", "no-spec"):
        try:
            got = api.whatif(scenario=scenario, by=["model"], scope=last_day())
        except (RemoteApiError, QueryError) as exc:
            got = [{"scenario": scenario, "error": str(exc)}]
        rows += [
            {
                k: r.get(k, "")
                for k in ("scenario", "model", "delta_computed_tokens", "delta_cost_usd", "error")
            }
            for r in got
        ]
    errors = ["error"] if any(r["error"] for r in rows) else []
    lines.append(_table(rows, ["scenario", "model", "delta_computed_tokens", "delta_cost_usd", *errors]))
    try:
        found = api.regressions()
        lines += ["", "regressions: none" if not found else "regressions:"]
        lines += [f"  {r['engine']} {r['signal']}: {r['baseline']:.3g} -> {r['current']:.3g}" for r in found]
    except (RemoteApiError, QueryError) as exc:
        lines += ["", f"regressions: not known ({exc})"]
    return lines


#: The report's check line; every engine counter the report prints is compared (see below).
CHECK_LINE = (
    "Check: per-tenant totals = sum over requests; prompt, output, cached, reasoning (per tenant), "
    "drafts and preemptions = what vLLM counted; cache writes (per tenant) = vLLM's created_cache_tokens "
    "as carried, SparSEEty's at most that; cached by tier = vllm:prompt_tokens_cached_by_source; "
    "the restored request's output ids and text = vLLM's; "
    "KV memory-time observed for every request (checked against vLLM's KV-cache manager in "
    "tests/e2e/test_engine_truth.py)"
)
#: The check line of ``--engine sglang``: SGLang's meta_info per request, summed per tenant, and
#: its /metrics (drafts, preemptions and reasoning are not observed there: docs/sglang.md).
CHECK_LINE_SGLANG = (
    "Check: per-tenant totals = sum over requests; prompt, output and cached (per tenant) = what "
    "SGLang returned (meta_info); cached (engine) = sglang:realtime_tokens_total{mode=prefill_cache}; "
    "the restored request's output ids and text = SGLang's"
)
CHECK_LINES = {"vllm": CHECK_LINE, "sglang": CHECK_LINE_SGLANG}
ENGINE_LABELS = {"vllm": "vLLM", "sglang": "SGLang"}


def restored_request(
    api: RemoteQueries, engine: dict[str, Any], stored: list[dict[str, Any]], shown: int = 4
) -> tuple[list[str], list[str]]:
    """One request restored from its token records (the one with the most cached positions), a
    few of its tokens with their status, and whether its output equals what vLLM returned."""
    if not stored:
        return [], []
    pick = max(stored, key=lambda r: (int(r["cache_read_tokens"]), int(r["draft_accepted_tokens"])))
    uid = pick["request_uid"]
    got = api.token_records(uid, per_position=True)
    if got is None:
        return [], [f"restored request {uid}: the API has no token records of it"]
    lines = ["", f"Restored request {uid} (privacy {got['privacy']}, content {got['content']}):"]
    if got["content"] != "ids":
        return [*lines, f"  {got['note']}"], []
    records = got["records"]
    first_out = next((i for i, r in enumerate(records) if r["is_output"]), len(records))
    cached = [i for i, r in enumerate(records) if r["is_cached"]][:1]
    drafts = [i for i, r in enumerate(records) if r["is_draft"]][:1]
    picks = sorted({*range(min(shown, first_out)), *cached, *drafts, *range(first_out, first_out + shown)})
    rows = [
        {
            "position": records[i]["position"],
            "token_id": records[i]["token_id"],
            "text": repr(records[i]["text"]),
            "kind": "output" if records[i]["is_output"] else "prompt",
            "status": records[i]["status"],
            "kv_fate": records[i]["kv_fate"],
            "draft": records[i]["is_draft"],
        }
        for i in picks
        if i < len(records)
    ]
    lines += ["", _table(rows, list(rows[0])) if rows else "  (no positions)"]
    lines.append(f"  output text: {got['output_text']!r}"[:200])
    rid = uid.split("/", 1)[1]
    # vLLM's request ids carry a suffix its RequestOutput does not; SGLang's are the client's rid
    engine_rid = rid if engine.get("kind") == "sglang" else rid.rsplit("-", 1)[0]
    theirs = next((r for r in engine["requests"] if str(r["request_id"]) == engine_rid), None)
    problems = []
    if theirs is None or "output_token_ids" not in theirs:
        problems.append(f"restored request {uid}: the engine's own output is not in its answers")
    elif got["output_token_ids"] != theirs["output_token_ids"]:
        problems.append(f"restored request {uid}: output ids differ from vLLM's RequestOutput")
    elif got["output_text"] is not None and not same_text(got["output_text"], theirs["output_text"]):
        problems.append(f"restored request {uid}: output text differs from vLLM's RequestOutput")
    return lines, problems


def _details(api: RemoteQueries, stored: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every stored count of each request (the list rows omit engine_cached_tokens, preemptions)."""
    found = api.requests_by_uid([r["request_uid"] for r in stored])
    return [found[r["request_uid"]] for r in stored if r["request_uid"] in found]


def run_demo(
    cfg: Config,
    *,
    model: Path | None = None,
    sessions: int = 4,
    quick: bool = False,
    keep_running: bool = False,
    engine_args: dict[str, Any] | None = None,
    engine: str = "vllm",
    sglang_python: Path | None = None,
    say: Say = print,
) -> DemoResult:
    """Run the demo on the stack of ``cfg`` (its data dir); see the module docstring."""
    run_dir = cfg.data_path / "demo" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    say(f"demo: working in {run_dir}")
    if engine not in ENGINE_LABELS:
        raise DemoError(f"unknown engine {engine!r}: one of {', '.join(ENGINE_LABELS)}")
    model_path, model_name = _model(cfg, model, say, engine)
    # the served name is not a path: tell the API where its tokenizer is (token records' text)
    cfg = cfg.replace(api={**cfg.api.model_dump(), "tokenizers": {model_name: str(model_path)}})
    stack = Stack(cfg)
    if stack.status()[1].state != "stopped":
        raise DemoError(
            "a stack is already running on this data dir: `sparseety down` first, or use --data-dir"
        )
    _prepare_store(stack.cfg, model_name, say)
    try:
        for row in stack.up(progress=say):
            say(f"  {row.name:<10} {row.state:<9} {row.endpoint}")
        if engine == "sglang":
            python = sglang_python or default_sglang_python()
            answers = _run_sglang(stack, python, model_path, model_name, run_dir, sessions, quick, say)
        else:
            if model is None and engine_args is None:
                # the tiny model's tokenizer has think tokens: the engine runs vLLM's reasoning parser
                engine_args = {**TINY_ENGINE, "reasoning_parser": TINY_REASONING_PARSER}
            answers = _run_engine(stack, model_path, model_name, run_dir, sessions, quick, engine_args, say)
        from sparseety.api.dashboard import render_dashboard

        with RemoteQueries(stack.api_url, timeout_s=30.0) as api:
            stored = _wait_visible(api, len(answers["requests"]), say)
            report, tenants, problems = build_report(api, answers, stored)
            # the CLI's `sparseety dashboard`: drawn here from the API's answers, plotly inlined
            dashboard = render_dashboard(
                api, run_dir / "dashboard.html", scope=last_day(), pipeline=api.pipeline()
            )
        (run_dir / "report.txt").write_text(report + "\n")
        say(report)
        say(f"\ndashboard: {dashboard}\nreport:    {run_dir / 'report.txt'}")
        return DemoResult(run_dir, answers, stored, tenants, report, dashboard, problems)
    finally:
        if keep_running:
            say(f"stack left running: API {stack.api_url}; `sparseety down` stops it")
        else:
            stack.down(progress=say)
