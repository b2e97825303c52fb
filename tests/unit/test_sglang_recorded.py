"""The recorded SGLang run (``tests/data/sglang_radix/``) through the real fold, without an engine.

Recorded by ``tests/e2e/test_sglang_engine.py`` (``RECORD_SGLANG_FIXTURE=1``) from a real SGLang
0.5.23 server on this CPU: the events exactly as the producer sent them, and SGLang's own
``meta_info`` per request, its ``/metrics`` totals and the radix-cache truth. The same checks as
the live test (``tests/sglang_checks.py``) run on it.
"""

from __future__ import annotations

import pytest

from sparseety import events as ev
from tests.recorded import load_scenario
from tests.sglang_checks import check_run, fold

pytestmark = pytest.mark.unit


def test_recorded_sglang_run_equals_sglang() -> None:
    events, truth = load_scenario("sglang_radix")
    check_run(events, truth["requests"], truth["tenants"], truth["radix_truth"], truth["metrics"])


def test_recorded_sglang_accounting_is_labelled_sglang() -> None:
    events, _ = load_scenario("sglang_radix")
    started = next(ev.payload(e) for e in events if ev.payload_type(e) == ev.ENGINE_STARTED)
    assert (started["engine_kind"], started["engine_version"]) == ("sglang", "0.5.23")
    accounts = fold(events)
    assert {a["engine_kind"] for a in accounts.values()} == {"sglang"}
    # No speculative decoding is configured (EngineStarted.spec_method is null): no drafts.
    assert all(a["draft_accepted_tokens"] == 0 and a["draft_rejected_tokens"] == 0 for a in accounts.values())
