"""The check of ``sparseety demo --engine sglang`` (pure logic; the run itself is
tests/e2e/test_demo.py::test_demo_sglang): stored counts against SGLang's own meta_info per tenant
and its /metrics cached total, and a mismatch of either is named."""

from __future__ import annotations

from typing import Any

from sparseety.stack.engine_checks import check_engine_counters

METRIC = "sglang:realtime_tokens_total|mode=prefill_cache"


def stored(tenant: str, prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {
        "tenant": tenant,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "engine_cached_tokens": cached,
        "reasoning_output_tokens": None,
    }


def engine(cached_metric: float | None) -> dict[str, Any]:
    reqs = [
        {"request_id": rid, "tenant": t, "prompt_tokens": p, "output_tokens": 8, "num_cached_tokens": c}
        for rid, t, p, c in (("a", "acme", 40, 0), ("b", "acme", 40, 39), ("c", "globex", 30, 16))
    ]
    for r in reqs:
        r["reasoning_tokens"] = None
    metrics = {} if cached_metric is None else {METRIC: cached_metric}
    return {"kind": "sglang", "requests": reqs, "metrics": metrics}


ROWS = [stored("acme", 40, 8, 0), stored("acme", 40, 8, 39), stored("globex", 30, 8, 16)]


def test_equal_counts_pass_and_vllm_only_counters_are_not_asked_for() -> None:
    eng = engine(55.0)
    assert check_engine_counters(ROWS, eng, "sglang") == []


def test_a_tenants_cached_tokens_that_differ_from_meta_info_are_named() -> None:
    eng = engine(55.0)
    rows = [*ROWS[:2], stored("globex", 30, 8, 15)]
    got = check_engine_counters(rows, eng, "sglang")
    assert "tenant globex: cached 15 stored, 16 from the engine" in got
    assert any(p.startswith("cached: 54 stored, 55 counted by SGLang") for p in got)


def test_the_engine_total_is_checked_against_sglangs_metric_and_its_absence_is_a_problem() -> None:
    eng = engine(60.0)
    assert check_engine_counters(ROWS, eng, "sglang") == [
        'cached: 55 stored, 60 counted by SGLang (sglang:realtime_tokens_total{mode="prefill_cache"})'
    ]
    eng = engine(None)
    assert check_engine_counters(ROWS, eng, "sglang") == [f"cached: the engine did not report {METRIC}"]
