"""Tumbling event-time windows of finished requests' usage, per engine, model, adapter and tenant.

A request belongs to the window holding its finish time. A window closes once the engine's
watermark (its highest event time) passes the window end plus the allowed lateness; it is then
emitted once as a ``final`` UsageWindow. A request finishing into a window already closed is
emitted alone as a ``correction`` (its own delta, with an id derived from the request), so
late data is never dropped and never counted twice: final + corrections = the truth.
"""

from __future__ import annotations

from typing import Any

from .state import WINDOW_COUNTERS, EpochState

_FLOAT_COUNTERS = {"est_flops"}
#: Separates a LoRA adapter from the base model in a window's key (``start|model<US>adapter|tenant``);
#: keys persisted before adapters were a key have none, and read as the base model's.
_ADAPTER_SEP = "\x1f"


def _model_slot(acc: dict[str, Any]) -> str:
    adapter = acc.get("lora_name") or ""
    return f"{acc['model']}{_ADAPTER_SEP}{adapter}" if adapter else acc["model"]


def window_start(ts_ns: int, window_ns: int) -> int:
    return ts_ns - ts_ns % window_ns


def counters_of(acc: dict[str, Any]) -> list[Any]:
    """A RequestAccounting record's contribution, in WINDOW_COUNTERS order."""
    return [1, 0 if acc["complete"] else 1, *(acc.get(name, 0) for name in WINDOW_COUNTERS[2:])]


def _padded(counters: list[Any]) -> list[Any]:
    """Counters of a window persisted before counters were appended, extended with zeros."""
    return counters + [0] * (len(WINDOW_COUNTERS) - len(counters))


def _record(
    epoch: EpochState,
    start: int,
    window_ns: int,
    model: str,
    tenant: str,
    counters: list[Any],
    kind: str,
    uid: str,
) -> dict[str, Any]:
    model, _, adapter = model.partition(_ADAPTER_SEP)
    # the id producers before issue 23 gave it (their model was the adapter's name): one engine
    # epoch serves one base model, so the adapter names the window, and a replay overwrites it
    named = adapter or model
    usage_id = f"{epoch.engine_id}/{named}/{tenant}/{start}/{kind}" + (f"/{uid}" if uid else "")
    rec: dict[str, Any] = {
        "usage_id": usage_id,
        "kind": kind,
        "window_start_ns": start,
        "window_ns": window_ns,
        "engine_name": epoch.engine_name,
        "model": model,
        "tenant": tenant,
        "lora_name": adapter,
    }
    for name, value in zip(WINDOW_COUNTERS, _padded(counters), strict=True):
        rec[name] = float(value) if name in _FLOAT_COUNTERS else int(value)
    return rec


def add(
    epoch: EpochState, acc: dict[str, Any], window_ns: int, *, retract: bool = False
) -> list[dict[str, Any]]:
    """Add a closed request to its window; returns a correction record if that window had closed.

    With ``retract``, take out what an earlier version of the request's record added (a request
    closed by the idle timeout that later got its finish is counted once, by its last version).
    """
    start = window_start(acc["finished_ts_ns"], window_ns)
    contribution = counters_of(acc)
    if retract:
        contribution = [-x for x in contribution]
    if start < epoch.closed_through:
        return [
            _record(
                epoch,
                start,
                window_ns,
                _model_slot(acc),
                acc["tenant"],
                contribution,
                "correction",
                acc["request_uid"] + ("/retract" if retract else ""),
            )
        ]
    key = f"{start}|{_model_slot(acc)}|{acc['tenant']}"
    current = epoch.windows.get(key)
    if current is None:
        epoch.windows[key] = contribution
    else:
        epoch.windows[key] = [a + b for a, b in zip(_padded(current), contribution, strict=True)]
    return []


def close_due(
    epoch: EpochState, window_ns: int, lateness_ns: int, *, flush: bool = False
) -> list[dict[str, Any]]:
    """Emit and forget windows the watermark has passed (all of them when ``flush``)."""
    # Once per event in the worker: no list, sort or call when nothing is due.
    horizon = epoch.watermark - lateness_ns
    last = horizon - window_ns  # a window starting at or before it ends by the horizon
    out = []
    due = None
    starts = _STARTS
    for key in epoch.windows:
        start = starts.get(key)
        if start is None:
            if len(starts) >= _STARTS_KEPT:
                starts.clear()
            start = starts[key] = int(key.split("|", 1)[0])
        if flush or start <= last:
            if due is None:
                due = []
            due.append((start, key))
    if due is not None:
        for start, key in sorted(due):
            _, model, tenant = key.split("|", 2)
            out.append(_record(epoch, start, window_ns, model, tenant, epoch.windows.pop(key), "final", ""))
            epoch.closed_through = max(epoch.closed_through, start + window_ns)
    if not flush:
        # Windows that end before the horizon are closed even if they never saw a request.
        h = horizon if horizon > 0 else 0
        passed = h - h % window_ns  # window_start(h), inline: this runs after every event
        if passed > epoch.closed_through:
            epoch.closed_through = passed
    return out


#: Window keys' starts, parsed once (close_due reads them after every event); bounded.
_STARTS: dict[str, int] = {}
_STARTS_KEPT = 4096
