"""Issue 36 parts 3 and 4, the pure logic: the vLLM plugin's multimodal tally and P/D fields, the
usage details request-level producers read, and the fold's multimodal counts.

The real engines check the same things end to end: ``tests/e2e/test_vllm_multimodal.py`` (a tiny
Idefics3 on vLLM's CPU server) and ``tests/harness/test_pd.py`` (two engine cores, P/D).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.producers.logs.errors import BadTraceLineError
from sparseety.producers.logs.jsonl import parse_line, request_payloads
from sparseety.producers.usage_details import modality_tokens
from sparseety.producers.vllm.multimodal import (
    ENCODER_HITS,
    EncoderHit,
    EncoderTally,
    mm_inputs,
    watch_encoder_cache,
)
from sparseety.producers.vllm.request_ids import pd_fields
from sparseety.streams import multimodal
from tests import factories as f
from tests.unit.test_assembler import accounts, run

pytestmark = pytest.mark.unit


def _feature(modality: str, offset: int, length: int, embeds: int, ident: str) -> Any:
    position = SimpleNamespace(offset=offset, length=length, get_num_embeds=lambda: embeds)
    return SimpleNamespace(modality=modality, identifier=ident, mm_position=position)


def _step(runs: dict[str, list[int]] | None = None, hits: list[tuple[str, int]] | None = None) -> Any:
    out = SimpleNamespace(scheduled_encoder_inputs=runs or {})
    if hits:
        setattr(out, ENCODER_HITS, [EncoderHit(rid, i) for rid, i in hits])
    return out


# --- the plugin ------------------------------------------------------------------------------------


def test_the_tally_counts_runs_every_time_and_a_hit_once_never_on_an_item_the_request_ran() -> None:
    req = SimpleNamespace(
        mm_features=[
            _feature("image", 3, 7, 4, "a"),
            _feature("image", 12, 7, 4, "b"),
            _feature("audio", 20, 5, 5, "c"),
        ]
    )
    items = mm_inputs(req)
    assert items[0] == {"modality": "image", "offset": 3, "length": 7, "num_embeds": 4, "identifier": "a"}
    tally = EncoderTally()
    tally.admitted("r", items)
    tally.step(_step({"r": [0]}, [("r", 1)]))  # item 0 run, item 1 from the encoder cache
    tally.step(_step({}, [("r", 0), ("r", 1)]))  # asked again (a chunk later): no new hit
    tally.step(_step({"r": [2]}, [("other", 0)]))
    assert tally.finished("r") == {
        "prompt_tokens_by_modality": {"image": 14, "audio": 5},
        "num_encoder_compute_tokens": 9,
        "num_encoder_cache_hit_tokens": 4,
    }
    # a text request: nothing; the tally forgot the finished one
    assert (
        tally.finished("r")
        == tally.finished("t")
        == {
            "prompt_tokens_by_modality": {},
            "num_encoder_compute_tokens": 0,
            "num_encoder_cache_hit_tokens": 0,
        }
    )


def test_the_encoder_cache_watch_notes_only_true_answers_and_wraps_once() -> None:
    class Manager:
        def check_and_update_cache(self, request: Any, input_id: int) -> bool:
            return input_id == 1

    scheduler = SimpleNamespace(encoder_cache_manager=Manager())
    hits: list[EncoderHit] = []
    assert watch_encoder_cache(scheduler, hits)
    assert not watch_encoder_cache(scheduler, hits)  # already wrapped
    req = SimpleNamespace(request_id="r")
    answers = [scheduler.encoder_cache_manager.check_and_update_cache(req, i) for i in (0, 1)]
    assert answers == [False, True] and hits == [EncoderHit("r", 1)]
    assert not watch_encoder_cache(SimpleNamespace(), [])  # no encoder cache: nothing wrapped


@pytest.mark.parametrize(
    ("external", "params", "kv_role", "want"),
    [
        ("chatcmpl-abc", {"do_remote_decode": True}, None, ("prefill", "abc")),
        (
            "chatcmpl-abc",
            {"do_remote_prefill": True, "remote_request_id": "chatcmpl-abc-1234abcd"},
            None,
            ("decode", "abc"),
        ),
        ("cmpl-abc-0", None, "kv_producer", ("prefill", "abc-0")),
        ("chatcmpl-abc", None, "kv_consumer", ("decode", "abc")),
        ("chatcmpl-abc", None, "kv_both", ("none", "")),
        ("chatcmpl-abc", None, None, ("none", "")),
        (
            "",
            {"do_remote_prefill": True, "remote_request_id": "chatcmpl-xyz-1234abcd"},
            None,
            ("decode", "xyz"),
        ),
    ],
)
def test_pd_role_and_join_key(external: str, params: Any, kv_role: str | None, want: tuple[str, str]) -> None:
    got = pd_fields(external, params, kv_role)
    assert (got["pd_role"], got["pd_join_id"]) == want


# --- request-level producers ---------------------------------------------------------------------


def test_usage_details_per_modality() -> None:
    assert modality_tokens({"multimodal_tokens": {"image": 7, "audio": 0, "text": 3}}, 33) == (
        {"image": 7},
        None,
    )
    assert modality_tokens({"audio_tokens": 12, "image_tokens": 5}, 40) == ({"image": 5, "audio": 12}, None)
    assert modality_tokens({"cached_tokens": 4}, 10) == ({}, None)
    assert modality_tokens({"multimodal_tokens": {"image": 7}, "image_tokens": 99}, 10)[0] == {"image": 7}
    for bad in (
        {"multimodal_tokens": [7]},
        {"image_tokens": -1},
        {"video_tokens": True},
        {"image_tokens": 11},
    ):
        counts, problem = modality_tokens(bad, 10)
        assert counts == {} and problem, bad


def test_a_log_line_carries_its_modalities_and_a_bad_count_is_a_bad_line() -> None:
    line = {
        "id": "chatcmpl-1",
        "model": "m",
        "arrival": 1,
        "usage": {
            "prompt_tokens": 33,
            "completion_tokens": 4,
            "prompt_tokens_details": {"multimodal_tokens": {"image": 7}},
        },
    }
    req = parse_line(json.dumps(line), 1)
    assert req is not None
    finished = dict(request_payloads(req))[ev.REQUEST_FINISHED]
    assert finished["prompt_tokens_by_modality"] == {"image": 7}
    line["usage"]["prompt_tokens_details"] = {"image_tokens": 40}  # type: ignore[index]
    with pytest.raises(BadTraceLineError, match="exceed prompt_tokens"):
        parse_line(json.dumps(line), 1)


# --- the fold ------------------------------------------------------------------------------------


def test_placeholders_below_the_admission_hit_are_cached_the_rest_computed() -> None:
    items = [
        {"modality": "image", "offset": 2, "length": 7},
        {"modality": "image", "offset": 30, "length": 7},
        {"modality": "video", "offset": 10, "length": 8},
        {"modality": "smell", "offset": 40, "length": 3},
    ]
    # image, audio, video; then of each, the positions below 14
    assert multimodal.admitted(items, 14) == [14, 0, 8, 7, 0, 4]


def test_the_fold_carries_multimodal_counts_from_items_or_from_the_usage() -> None:
    items = [{"modality": "image", "offset": 1, "length": 7, "num_embeds": 4, "identifier": "a"}]
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(12)), cached=4, mm_inputs=items)),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 8, 4, [7])])),
        f.wrap(
            3,
            ev.REQUEST_FINISHED,
            f.request_finished(
                "r1",
                prompt=12,
                output=1,
                cached=4,
                prompt_tokens_by_modality={"image": 7},
                num_encoder_compute_tokens=0,
                num_encoder_cache_hit_tokens=4,
            ),
        ),
    ]
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    assert (acc["image_tokens"], acc["image_cached_tokens"]) == (7, 3)
    assert (acc["audio_tokens"], acc["video_tokens"]) == (0, 0)
    assert (acc["encoder_compute_tokens"], acc["encoder_cache_hit_tokens"]) == (0, 4)
    # a producer without items (the proxy, a log): the usage's counts, none known to be cached
    assert multimodal.record_fields([], {"prompt_tokens_by_modality": {"audio": 9}}) == {
        "image_tokens": 0,
        "audio_tokens": 9,
        "video_tokens": 0,
        "image_cached_tokens": 0,
        "audio_cached_tokens": 0,
        "video_cached_tokens": 0,
        "encoder_compute_tokens": 0,
        "encoder_cache_hit_tokens": 0,
    }
    # records written before schema v7: -1 (not reported) reads as no encoder work
    assert multimodal.record_fields([], {"num_encoder_compute_tokens": -1})["encoder_compute_tokens"] == 0
