"""Ordering and dedup of one engine epoch's events: a gap-free ``seq`` per stream.

Every event carries a ``seq`` that counts up from 0 per (engine epoch, stream). Per stream the
epoch keeps the next expected seq: an older event is a duplicate and dropped; a newer one waits
in the epoch's reorder buffer until the gap before it fills, or until the gap is declared lost
(the buffer is full, or its newest event is ``lateness`` ahead of its oldest in event time).

:func:`admit` is the pure step ``(epoch, event) -> (epoch, released events)``: it updates the
epoch's ordering fields (``next_seq``, ``pending``, ``duplicates``, ``gaps``) and returns the
events the fold may now apply, in seq order. Applying them is the caller's business; effects on
the epoch therefore happen once per seq, which is what makes a replay after a crash converge.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .caveats import history_lost_at
from .state import EpochState


class Admission(NamedTuple):
    """What one event released.

    Attributes:
        ready: Events to apply now, in seq order (the event itself first when it was next).
        duplicate: The event's seq was applied or buffered before; nothing else changed.
        buffered: The event waits for earlier seqs (it may still be in ``ready`` when a gap was
            declared at once).
        lost: Seqs declared lost before ``ready``: every request open on the epoch at this
            point missed events (the fold flags them ``seq_gap``).
    """

    ready: tuple[dict[str, Any], ...] = ()
    duplicate: bool = False
    buffered: bool = False
    lost: int = 0


_DUPLICATE = Admission(duplicate=True)
_BUFFERED = Admission(buffered=True)


def admit(epoch: EpochState, event: dict[str, Any], *, max_pending: int, lateness_ns: int) -> Admission:
    """Order ``event`` on its epoch's stream; return what it released."""
    stream = event["stream"]
    seq = event["seq"]
    nxt = epoch.next_seq.setdefault(stream, 0)
    if seq < nxt:
        epoch.duplicates += 1
        return _DUPLICATE
    if seq > nxt:
        pending = epoch.pending.setdefault(stream, {})
        if str(seq) in pending:
            epoch.duplicates += 1
            return _DUPLICATE
        pending[str(seq)] = event
        lost = _declare_gap(epoch, stream, max_pending, lateness_ns)
        if not lost:
            return _BUFFERED
        return Admission(ready=_release(epoch, stream), buffered=True, lost=lost)
    epoch.next_seq[stream] = seq + 1
    if not epoch.pending.get(stream):
        return Admission(ready=(event,))
    return Admission(ready=(event, *_release(epoch, stream)))


def next_in_line(epoch: EpochState, event: dict[str, Any]) -> bool:
    """Whether ``event`` is its stream's next seq with nothing buffered after it: then it is
    admitted (``next_seq`` advanced) as :func:`admit` would, without an :class:`Admission`
    (the common case, once per event in the worker). Otherwise nothing changes: call
    :func:`admit`."""
    stream = event["stream"]
    seq = event["seq"]
    if epoch.next_seq.get(stream) != seq or epoch.pending.get(stream):
        return False
    epoch.next_seq[stream] = seq + 1
    return True


def _declare_gap(epoch: EpochState, stream: str, max_pending: int, lateness_ns: int) -> int:
    """Give up on the missing seqs once the buffer is full or far ahead in event time.

    Returns how many seqs were declared lost (0: keep waiting); the stream then resumes at the
    oldest buffered event.
    """
    pending = epoch.pending[stream]
    seqs = sorted(int(s) for s in pending)
    newest = max(pending[str(s)]["ts_ns"] for s in seqs[-8:])
    oldest = pending[str(seqs[0])]["ts_ns"]
    if len(pending) < max_pending and newest - oldest < lateness_ns:
        return 0
    missing = seqs[0] - epoch.next_seq[stream]
    epoch.gaps += missing
    first_after = pending[str(seqs[0])]["ts_ns"]
    epoch.history_lost_ts_ns = history_lost_at(stream, missing, first_after, epoch.history_lost_ts_ns)
    epoch.next_seq[stream] = seqs[0]
    return missing


def _release(epoch: EpochState, stream: str) -> tuple[dict[str, Any], ...]:
    """Pop the buffered events that now follow without a gap, advancing ``next_seq``."""
    pending = epoch.pending.get(stream)
    ready = []
    while pending:
        nxt = epoch.next_seq[stream]
        event = pending.pop(str(nxt), None)
        if event is None:
            break
        ready.append(event)
        epoch.next_seq[stream] = nxt + 1
    if pending is not None and not pending:
        del epoch.pending[stream]
    return tuple(ready)
