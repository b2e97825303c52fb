"""Process and thread plumbing shared by the components (sparseety/lifecycle.py)."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

from sparseety.lifecycle import GC_YOUNG_THRESHOLD, name_os_thread, tune_gc


def test_a_thread_gets_its_linux_name() -> None:
    seen: list[str] = []

    def body() -> None:
        name_os_thread("sparseety-emitter-core")
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == ["sparseety-emitt"]  # Linux keeps 15 characters
    assert Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip() != seen[0]


def test_tune_gc_freezes_start_up_objects_and_collects_less_often() -> None:
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
