"""Test-only ground truth of a vLLM engine's encoder work (tests/e2e/test_vllm_multimodal.py).

On ``PYTHONPATH`` of a vLLM server started by that test, Python imports this module in every
process; in the engine core (once vLLM's scheduler module is imported) it wraps
``Scheduler.schedule`` and ``EncoderCacheManager.check_and_update_cache`` and appends one JSON
line per fact to ``$TEST_MM_TRUTH_FILE``:

* ``{"run": request id, "index": i, "embeds": n}`` for each item the scheduler sent to the encoder;
* ``{"hit": request id, "index": i, "embeds": n}`` for each True answer of the encoder cache.

It is independent of the plugin's own capture (``producers/vllm/multimodal.py``).
"""

from __future__ import annotations

import json
import os
import threading

_PATH = os.environ.get("TEST_MM_TRUTH_FILE")
_lock = threading.Lock()


def _write(record: dict) -> None:
    with _lock, open(_PATH, "a") as f:  # type: ignore[arg-type]
        f.write(json.dumps(record) + "\n")


def _patch() -> None:
    from vllm.v1.core import encoder_cache_manager as ecm
    from vllm.v1.core.sched import scheduler as sched

    check = ecm.EncoderCacheManager.check_and_update_cache

    def check_and_update_cache(self, request, input_id):  # type: ignore[no-untyped-def]
        found = check(self, request, input_id)
        if found:
            embeds = request.mm_features[input_id].mm_position.get_num_embeds()
            _write({"hit": request.request_id, "index": input_id, "embeds": int(embeds)})
        return found

    ecm.EncoderCacheManager.check_and_update_cache = check_and_update_cache
    schedule = sched.Scheduler.schedule

    def schedule_(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = schedule(self, *args, **kwargs)
        for rid, indices in (out.scheduled_encoder_inputs or {}).items():
            req = self.requests[rid]
            for i in indices:
                embeds = req.mm_features[i].mm_position.get_num_embeds()
                _write({"run": rid, "index": i, "embeds": int(embeds)})
        return out

    sched.Scheduler.schedule = schedule_


if _PATH:
    import wrapt

    wrapt.register_post_import_hook(lambda _module: _patch(), "vllm.v1.core.sched.scheduler")
