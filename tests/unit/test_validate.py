"""The contract's count bounds (issue 12): one check, applied by validate_engine_event."""

from __future__ import annotations

from typing import Any

import pytest

from sparseety import events as ev
from sparseety.errors import InvalidEventError
from sparseety.validate import MAX_TOKENS, count_error
from tests import factories as f


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"output": -5}, "num_output_tokens"),
        ({"cached": -3}, "num_cached_tokens"),
        ({"prompt": 2**31 - 1}, "num_prompt_tokens"),
        ({"output": MAX_TOKENS + 1}, "num_output_tokens"),
        ({"num_preemptions": -1}, "num_preemptions"),
    ],
)
def test_out_of_range_counts_are_invalid_events(over: dict[str, Any], field: str) -> None:
    event = f.wrap(0, ev.REQUEST_FINISHED, f.request_finished(**over))
    with pytest.raises(InvalidEventError) as info:
        ev.validate_engine_event(event, raw=b"raw")
    assert info.value.fields["field"] == field and info.value.raw == b"raw"
    assert "outside 0.." in str(info.value)


def test_counts_at_the_bounds_are_valid() -> None:
    body = f.request_finished(prompt=MAX_TOKENS, output=MAX_TOKENS, cached=0)
    assert count_error("RequestFinished", body) is None
    assert ev.validate_engine_event(f.wrap(0, ev.REQUEST_FINISHED, body)) is not None
    for event in f.one_of_each():
        ev.validate_engine_event(event)


def test_array_counts_are_checked_element_by_element() -> None:
    step = f.step_batch(0, [("r1", 3, 0, [1])])
    step["num_computed_before"] = [-1]
    assert count_error("StepBatch", step) == (
        "num_computed_before",
        f"StepBatch.num_computed_before[0] = -1 is outside 0..{MAX_TOKENS}",
    )


def test_the_started_prompt_and_max_tokens_are_bounded() -> None:
    started = f.request_started("r1", cached=0)
    assert count_error("RequestStarted", {**started, "max_tokens": None}) is None
    assert count_error("RequestStarted", {**started, "max_tokens": 2**31 - 1}) is not None
    assert count_error("RequestStarted", {**started, "prompt_len": -1}) is not None


def _step_variants() -> list[dict[str, Any]]:
    """StepBatches valid and invalid in each way a StepBatch check knows."""
    base = f.step_batch(0, [("r1", 3, 0, [1]), ("r2", 1, 7, [4]), ("r3", 2, 5, [])])
    out = [base, f.step_batch(0, []), f.step_batch(0, [("r1", 3, 0, [1])], spec=[(2, 1)])]
    for col in ("num_scheduled_tokens", "num_computed_before", "num_new_tokens"):
        for bad in (-1, MAX_TOKENS, MAX_TOKENS + 1):
            v = {**base, col: list(base[col])}
            v[col][1] = bad
            out.append(v)
        out.append({**base, col: base[col][:2]})  # one entry short
    out.append({**base, "new_token_ids": [1]})  # fewer ids than new tokens
    out.append({**base, "spec_proposed": [1, 2, 3], "spec_accepted": [0, 1, 3]})
    out.append({**base, "spec_proposed": [1, 2], "spec_accepted": []})  # drafts for two of three rows
    return out


@pytest.mark.parametrize("i", range(len(_step_variants())))
def test_the_plain_step_shortcut_agrees_with_every_step_check(
    i: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``validate_engine_event`` passes an ordinary StepBatch on one combined check: a body it lets
    through that way is one the full checks pass too, and one it refuses is refused by them."""
    body = _step_variants()[i]

    def outcome() -> str | None:
        try:
            ev.validate_engine_event(f.wrap(0, ev.STEP_BATCH, body))
        except InvalidEventError as exc:
            return str(exc.fields["field"])
        return None

    fast = outcome()
    monkeypatch.setattr(ev, "_plain_step", lambda body: False)
    assert fast == outcome()
