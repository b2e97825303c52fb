"""The dashboard's cost-over-time chart draws an empty minute as 0, not as a line across it."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from sparseety.api.figures import bucket_axis, over_time_figure


def row(tenant: str, bucket: str, usd: str, tokens: int) -> dict[str, object]:
    return {
        "tenant": tenant,
        "bucket": bucket,
        "cost_usd": Decimal(usd),  # money is Decimal, from the store and the API client alike
        "input_tokens": tokens,
        "cached_tokens": 0,
        "output_tokens": 0,
    }


def test_an_empty_minute_is_drawn_as_zero() -> None:
    # acme at 10:00 and 10:03, globex at 10:01 (as the API sends buckets: strings)
    rows = [
        row("acme", "2026-12-04 10:00:00", "0.5", 100),
        row("acme", "2026-12-04 10:03:00", "0.25", 50),
        row("globex", "2026-12-04 10:01:00", "1", 10),
    ]
    fig = over_time_figure(rows, rows, "1m")
    acme_cost, acme_tokens, globex_cost, _ = fig["data"]
    minutes = ["2026-12-04 10:00:00", "2026-12-04 10:01:00", "2026-12-04 10:02:00", "2026-12-04 10:03:00"]
    assert acme_cost["x"] == acme_tokens["x"] == globex_cost["x"] == minutes
    assert acme_cost["y"] == [0.5, 0, 0, 0.25]
    assert acme_cost["text"] == ["$0.5", "$0", "$0", "$0.25"]
    assert acme_tokens["y"] == [100, 0, 0, 50]
    assert globex_cost["y"] == [0, 1.0, 0, 0]


def test_the_axis_takes_datetimes_and_the_bucket_step() -> None:
    t0 = datetime(2026, 12, 4, 10, 0, tzinfo=UTC)
    rows = [{"bucket": t0}, {"bucket": t0.replace(hour=11)}]
    axis = bucket_axis(rows, "15m")
    assert len(axis) == 5 and axis[0] == t0 and axis[-1] == t0.replace(hour=11)
    assert bucket_axis([], "1m") == []
