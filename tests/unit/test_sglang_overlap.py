"""The SGLang session under the overlap scheduler's order (pure logic; the real scheduler runs in
tests/harness/test_sglang_matrix.py and the real CPU server in tests/e2e).

``event_loop_overlap`` launches batch N+1 (``run_batch``) before it processes batch N's result,
and hands ``process_batch_result`` a copy of the batch: the session must match results to
launches by the result object, count tokens across the processing, and hold a finish until the
last batch that scheduled the request is processed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import load_config
from sparseety.producers.privacy import PromptPolicy
from sparseety.producers.sglang.records import RecordBuilder
from sparseety.producers.sglang.session import SglangSession

pytestmark = pytest.mark.unit


class Captured:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def emit(self, build: Any, *args: Any) -> None:
        self.records.append(build(*args))

    def emit_many(self, count: int, build: Any, *args: Any) -> None:
        self.records.extend(build(*args))

    def emit_record(self, payload_type: str, payload: dict[str, Any]) -> None:
        self.records.append((payload_type, payload))


@dataclass
class Req:
    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    finished_reason: Any = None
    cached_tokens: int = 0
    retraction_count: int = 0
    finished_len: int | None = None
    extra_key: Any = None
    sampling_params: Any = field(
        default_factory=lambda: SimpleNamespace(max_new_tokens=3, custom_params=None)
    )

    def finished(self) -> bool:
        return self.finished_reason is not None


def _mode(extend: bool) -> Any:
    return SimpleNamespace(is_extend=lambda: extend, is_decode=lambda: not extend)


def extend(*reqs: Req) -> Any:
    return SimpleNamespace(
        forward_mode=_mode(True),
        reqs=list(reqs),
        prefix_lens=[0] * len(reqs),
        extend_lens=[len(r.origin_input_ids) for r in reqs],
    )


def decode(*reqs: Req) -> Any:
    return SimpleNamespace(forward_mode=_mode(False), reqs=list(reqs))


class Loop:
    """SGLang's two call sites, as the hooks call the session."""

    def __init__(self) -> None:
        builder = RecordBuilder(
            policy=PromptPolicy(load_config().privacy), served_model_name="m", block_size=4
        )
        self.s = SglangSession(load_config(), Captured(), builder)  # type: ignore[arg-type]

    def run(self, batch: Any) -> object:
        self.s.before_run(batch)
        result = object()
        self.s.launched(result)
        return result

    def process(self, result: object, produce: dict[str, int | None]) -> None:
        """``produce``: per request, the token its result appends (None: SGLang skips it, as it
        does a request finished or retracted in an earlier batch)."""
        self.s.before_result(result)
        for req, token in produce.items():
            if token is not None:
                self.reqs[req].output_ids.append(token)
        self.s.after_result()

    @property
    def records(self) -> list[tuple[str, dict[str, Any]]]:
        return self.s.emitter.records  # type: ignore[attr-defined,no-any-return]


def test_overlap_order_attributes_tokens_and_holds_finishes() -> None:
    loop = Loop()
    a, b = Req("a", [1, 2, 3]), Req("b", [4, 5])
    loop.reqs = {"a": a, "b": b}  # type: ignore[attr-defined]
    r_ext = loop.run(extend(a, b))  # N
    r_d1 = loop.run(decode(a, b))  # N+1, launched before N's result
    loop.process(r_ext, {"a": 10, "b": 20})
    r_d2 = loop.run(decode(a, b))  # N+2
    loop.process(r_d1, {"a": 11, "b": 21})
    b.finished_reason = "FINISH_MATCHED_TOKEN"  # b stopped in N+1, but it is in N+2 already
    a.finished_reason = "FINISH_LENGTH"  # a's next token finishes it: SGLang leaves it out of N+3
    loop.process(r_d2, {"a": 12, "b": None})  # b's overshoot entry: computed, its token dropped
    kinds = [(t, p.get("request_id") or p.get("req_ids")) for t, p in loop.records]
    steps = [p for t, p in loop.records if t == ev.STEP_BATCH]
    assert [s["num_new_tokens"] for s in steps] == [[1, 1], [1, 1], [1, 0]]
    assert [s["num_computed_before"] for s in steps] == [[0, 0], [3, 2], [4, 3]]
    assert [s["new_token_ids"] for s in steps][:2] == [[10, 20], [11, 21]]
    # b's finish comes after the StepBatch of the last batch that scheduled it (N+2), with a's
    assert kinds[-2:] == [(ev.REQUEST_FINISHED, "a"), (ev.REQUEST_FINISHED, "b")]
    assert kinds.index((ev.STEP_BATCH, ["a", "b"])) < kinds.index((ev.REQUEST_FINISHED, "b"))
    finished = {p["request_id"]: p for t, p in loop.records if t == ev.REQUEST_FINISHED}
    assert finished["a"]["num_output_tokens"] == 3 and finished["b"]["num_output_tokens"] == 2
    assert loop.s._flights == {} and loop.s._inflight == {}


def test_an_unknown_result_is_ignored() -> None:
    """Idle and prebuilt batches are never held; their results pass without a StepBatch."""
    loop = Loop()
    loop.reqs = {}  # type: ignore[attr-defined]
    loop.process(object(), {})
    assert loop.records == []


def test_an_abort_while_a_batch_of_the_request_is_in_flight_waits_for_it() -> None:
    """A request retracted from the running batch while its previous batch is still in flight,
    then aborted from the waiting queue (SGLang leaves its finished_reason unset there): it
    finishes once that batch is processed, never before its StepBatch."""
    loop = Loop()
    a = Req("a", [1, 2, 3])
    loop.reqs = {"a": a}  # type: ignore[attr-defined]
    r_ext = loop.run(extend(a))
    r_d1 = loop.run(decode(a))
    loop.process(r_ext, {"a": 10})
    loop.s.on_retract([a])
    loop.s.on_finished_outside_step(a)  # aborted while waiting; d1 is still in flight
    assert [t for t, _ in loop.records].count(ev.REQUEST_FINISHED) == 0
    loop.process(r_d1, {"a": None})  # retracted: SGLang skips it
    kinds = [t for t, _ in loop.records]
    assert kinds[-2:] == [ev.STEP_BATCH, ev.REQUEST_FINISHED]
    fin = loop.records[-1][1]
    assert (fin["request_id"], fin["finish_reason"], fin["num_output_tokens"]) == ("a", "abort", 1)


def test_a_verify_reports_its_drafts_and_stops_where_sglang_cuts_the_output() -> None:
    """EAGLE (SGLang's spec v2, normal loop): each decode batch is a verify of 3 drafts per
    request; ``accept_lens`` (drafts accepted + the bonus) moves the position and is the
    verifier's acceptance; a verify appends its whole run to ``output_ids`` past the stop, and
    ``finished_len`` says where the output ends (the harness's EAGLE mode: 11 tokens counted for
    an 8-token answer, positions moved by 1 per verify)."""
    loop = Loop()
    a, b = Req("a", [1, 2, 3]), Req("b", [4, 5])
    loop.reqs = {"a": a, "b": b}  # type: ignore[attr-defined]
    spec = SimpleNamespace(is_none=lambda: False)

    def verify(lens: list[int]) -> object:
        batch = decode(a, b)
        batch.spec_algorithm = spec
        loop.s.before_run(batch)
        result = SimpleNamespace(
            speculative_num_draft_tokens=4, accept_lens=SimpleNamespace(tolist=lambda: lens)
        )
        loop.s.launched(result)
        return result

    loop.process(loop.run(extend(a, b)), {"a": 10, "b": 20})
    r1 = verify([4, 1])  # a accepts its 3 drafts, b none
    loop.s.before_result(r1)
    a.output_ids += [11, 12, 13, 14]
    b.output_ids += [21]
    loop.s.after_result()
    r2 = verify([3, 2])
    loop.s.before_result(r2)
    a.output_ids += [15, 16, 17]
    a.finished_len, a.finished_reason = 6, "FINISH_LENGTH"  # max_new_tokens 6: 17 is past it
    b.output_ids += [22, 23]
    loop.s.after_result()
    steps = [p for t, p in loop.records if t == ev.STEP_BATCH][1:]
    assert [s["num_computed_before"] for s in steps] == [[3, 2], [7, 3]]
    assert [s["num_scheduled_tokens"] for s in steps] == [[4, 4], [4, 4]]
    assert [s["spec_proposed"] for s in steps] == [[3, 3], [3, 3]]
    assert [s["spec_accepted"] for s in steps] == [[3, 0], [2, 1]]
    assert [s["num_new_tokens"] for s in steps] == [[4, 1], [1, 2]]
    assert steps[1]["new_token_ids"] == [15, 22, 23]
    fin = next(p for t, p in loop.records if t == ev.REQUEST_FINISHED)
    assert (fin["request_id"], fin["num_output_tokens"]) == ("a", 6)


def test_a_verify_launched_before_the_previous_ones_result_starts_where_it_ended() -> None:
    """EAGLE under the overlap loop: verify N+1 launches before N's ``accept_lens`` are known; its
    position is where N's accepted run ended (the harness's overlap EAGLE mode: every request
    inconsistent when it was taken at launch)."""
    loop = Loop()
    a = Req("a", [1, 2, 3])
    loop.reqs = {"a": a}  # type: ignore[attr-defined]
    spec = SimpleNamespace(is_none=lambda: False)

    def verify(lens: list[int]) -> object:
        batch = decode(a)
        batch.spec_algorithm = spec
        loop.s.before_run(batch)
        result = SimpleNamespace(
            speculative_num_draft_tokens=4, accept_lens=SimpleNamespace(tolist=lambda: lens)
        )
        loop.s.launched(result)
        return result

    r_ext = loop.run(extend(a))
    r1 = verify([3])
    loop.process(r_ext, {"a": 10})
    r2 = verify([2])  # launched before r1's result
    loop.s.before_result(r1)
    a.output_ids += [11, 12, 13]
    loop.s.after_result()
    loop.s.before_result(r2)
    a.output_ids += [14, 15]
    loop.s.after_result()
    steps = [p for t, p in loop.records if t == ev.STEP_BATCH][1:]
    assert [s["num_computed_before"] for s in steps] == [[3], [6]]
    assert [s["num_new_tokens"] for s in steps] == [[3], [2]]
