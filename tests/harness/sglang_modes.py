"""SGLang's real scheduler with a simulated model worker: the modes, their workload, one run.

All modes run in one ``tests/harness/sglang_driver.py`` process in SGLang's venv (its imports
are most of the cost), each on its own ``sglang.Engine`` and its own topic of the session's real
broker; the events are read back and folded by the worker's pure core, the assembler. The truth
per request is SGLang's own: ``meta_info`` (prompt, completion and cached tokens, the device
tier of ``cached_tokens_details``, ``num_retractions``) and the radix-cache truth recorded in its
scheduler (``tests/e2e/sglang_launch.install_truth``: the hit at admission, the full blocks it
had evicted before, from the Python TreeCore's eviction or the Rust core's own KV events).

GPU defaults are set here, in test code only: the overlap scheduler (SGLang's default, on unless
a mode turns it off), the Rust TreeCore (SGLang's Linux default) with SGLang's KV events on.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparseety import events as ev
from sparseety.config import Config, to_env
from sparseety.stack.server_process import _free_port
from tests.e2e.engine_events import engine_events
from tests.harness.pipeline import engine_config, fold

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
BLOCK = 16
#: A small KV pool (tokens) and prefill chunk: the pressure phase retracts and evicts, the long
#: prompts are prefilled in chunks.
POOL = 600
CHUNK = 64


#: SGLang's own retraction switch (``SGLANG_TEST_RETRACT``: its scheduler retracts the decode
#: batch through the real ``retract_decode`` every ``INTERVAL`` forward steps). On this pool its
#: admission control keeps the pressure phase from outgrowing memory, so retraction is forced
#: where SGLang's own tests force it; the radix eviction is real pressure.
RETRACT_ENV = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "23"}


#: EAGLE-style speculation (``tests/harness/sglang_spec.py``): drafts per verify (topk 1, a chain
#: of ``SPEC_STEPS`` drafts, ``SPEC_STEPS + 1`` tokens verified) and the acceptance pattern (drafts
#: accepted per verify, cycled per request).
SPEC_STEPS = 3
ACCEPT = "3,0,1,2"


@dataclass(frozen=True)
class Mode:
    overlap: bool = True
    tree_core: str = "rust"
    spec: bool = False  #: EAGLE-style speculation (SGLang's simulated draft worker)

    @property
    def name(self) -> str:
        return f"{'overlap' if self.overlap else 'normal'}-{self.tree_core}{'-eagle' if self.spec else ''}"


def _ids(seed: int, n: int) -> list[int]:
    return [4 + (seed * 131 + i * 37 + (i * i) % 11) % 490 for i in range(n)]


def _req(rid: str, tenant: str, ids: list[int], max_new: int) -> dict[str, Any]:
    return {"rid": rid, "tenant": tenant, "input_ids": ids, "max_new_tokens": max_new}


SYSTEM = _ids(1, 48)


def workload() -> list[list[dict[str, Any]]]:
    """Phases, each one batch: prefix sharing (a system prompt across tenants, an identical
    prompt), a long prompt in chunks, pressure (concurrent decodes past the pool: retraction and
    radix eviction), then the long prompt again (recompute after eviction)."""
    return [
        [
            _req("sys-a1", "acme", SYSTEM + _ids(2, 20), 8),
            _req("same-1", "initech", _ids(5, 40), 8),
            _req("long-1", "acme", _ids(6, 200), 8),
        ],
        [
            _req("sys-a2", "acme", SYSTEM + _ids(3, 20), 8),
            _req("sys-b1", "globex", SYSTEM + _ids(4, 20), 8),
            _req("same-2", "initech", _ids(5, 40), 8),
        ],
        [_req(f"press-{i}", ("acme", "globex", "initech")[i % 3], _ids(10 + i, 50), 70) for i in range(6)],
        [_req("long-1-again", "acme", _ids(6, 200), 8)],
    ]


def engine_kwargs(mode: Mode, model: Path) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "model_path": str(model),
        "device": "cpu",
        "attention_backend": "torch_native",
        "disable_cuda_graph": True,
        "load_format": "dummy",  # the tiny config only: the simulated worker does no math
        "skip_tokenizer_init": True,
        "max_total_tokens": POOL,
        "chunked_prefill_size": CHUNK,
        "mem_fraction_static": 0.1,
        "random_seed": 0,
        "log_level": "warning",
        "disable_overlap_schedule": not mode.overlap,
    }
    if mode.spec:
        kw.update(
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=str(model),  # its config only: the draft worker is simulated
            speculative_num_steps=SPEC_STEPS,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=SPEC_STEPS + 1,
        )
    if mode.tree_core == "rust":
        endpoint = f"tcp://127.0.0.1:{_free_port()}"
        kw["kv_events_config"] = json.dumps({"publisher": "zmq", "endpoint": endpoint, "topic": "kv"})
    return kw


@dataclass
class ModeRun:
    mode: Mode
    answers: dict[str, Any]
    tenants: dict[str, str]
    truth: dict[str, dict[str, Any]]
    loops: list[str]
    events: list[dict[str, Any]]
    topic: str = ""
    accounts: dict[str, dict[str, Any]] = field(default_factory=dict)


def _truth(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per request: its admission hit, the evicted blocks it recomputed, and ``resume_hits``
    (the cached prefixes it read back after retractions)."""
    truth = {t["rid"]: {**t, "resume_hits": 0} for t in lines if "rid" in t}
    for t in lines:
        if "resumed" in t:
            truth[t["resumed"]]["resume_hits"] += t["hit"]
    return truth


def run_modes(modes: list[Mode], model: Path, broker: Config, workdir: Path) -> dict[str, ModeRun]:
    """Every mode in one driver process (each its own engine, topic and truth); read back, fold."""
    runs = []
    cfgs = {}
    phases = workload()
    for mode in modes:
        d = workdir / mode.name
        d.mkdir(parents=True, exist_ok=True)
        cfg = cfgs[mode.name] = engine_config(broker, d, f"sglang-{mode.name}-{uuid.uuid4().hex[:4]}")
        runs.append(
            {
                "name": mode.name,
                "engine": engine_kwargs(mode, model),
                "env": {
                    **to_env(cfg),
                    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": mode.tree_core,
                    **RETRACT_ENV,
                    "SGLANG_HARNESS_ACCEPT": ACCEPT,
                },
                "truth": str(d / "truth.jsonl"),
                "out": str(d / "answers.json"),
                "phases": phases,
            }
        )
    config = workdir / "driver.json"
    config.write_text(json.dumps({"runs": runs}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
    env.update({"SGLANG_HARNESS": "1", "SGLANG_USE_CPU_ENGINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    with open(workdir / "driver.log", "ab") as log:
        done = subprocess.run(
            [str(SGLANG_PYTHON), "-m", "tests.harness.sglang_driver", str(config)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900,
        )  # fmt: skip
    assert done.returncode == 0, f"the SGLang harness driver failed; see {workdir / 'driver.log'}"
    tenants = {r["rid"]: r["tenant"] for phase in phases for r in phase}
    out = {}
    for mode, run in zip(modes, runs, strict=True):
        cfg = cfgs[mode.name]
        events = engine_events(cfg, lambda es: any(ev.payload_type(e) == ev.ENGINE_STOPPED for e in es))
        lines = [json.loads(line) for line in Path(run["truth"]).read_text().splitlines()]
        out[mode.name] = ModeRun(
            mode=mode,
            answers=json.loads(Path(run["out"]).read_text()),
            tenants=tenants,
            truth=_truth(lines),
            loops=[t["event_loop"] for t in lines if "event_loop" in t],
            events=events,
            topic=cfg.topics.engine_events,
            accounts=fold(events),
        )
    return out
