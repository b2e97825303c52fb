"""Real vLLM engines for the e2e tier, started once per session and shared.

Engines run in vLLM's real multiprocess layout (front end, EngineCore, worker), so the plugin is
loaded through its entry point in every process, exactly as in production. At most two engines
are alive at a time (:class:`EnginePool`); each engine kind is used by one test module, so each
starts once. Tiny models are built locally (nothing is downloaded) and cached across sessions
in ``~/.cache/sparseety-tiny-models``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sparseety.config import Config, to_env
from sparseety.kafka import ensure_topics
from sparseety.stack.server_process import ServerProcess

MODEL_CACHE = Path(os.environ.get("TINY_MODEL_CACHE", "~/.cache/sparseety-tiny-models")).expanduser()
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def tiny_model(kind: str) -> Path:
    """A tiny random-weight checkpoint of ``kind`` (llama, mixtral, mistral-sw), built once."""
    from sparseety.stack.tiny_models import build_tiny_model

    return build_tiny_model(kind, MODEL_CACHE / kind)


def server_args(model: Path, *extra: str, max_num_seqs: int = 8) -> list[str]:
    """The vLLM server arguments the e2e servers share (``model`` served as "tiny", prefix
    caching on 32-token blocks, 1024 positions, eager, prompt token details), then ``extra``."""
    return [
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--enable-prefix-caching",
        "--block-size",
        "32",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        str(max_num_seqs),
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        *extra,
    ]


@contextlib.contextmanager
def environ(updates: dict[str, str]) -> Iterator[None]:
    """Set variables for engines started inside the block (spawned processes copy them)."""
    old = {k: os.environ.get(k) for k in updates}
    cleared = {k: v for k, v in os.environ.items() if k.startswith("SPARSEETY_") and k not in updates}
    for k in cleared:
        del os.environ[k]
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.environ.update(cleared)


def engine_config(broker: Config, data_dir: Path, name: str, **producer: Any) -> Config:
    """Config an engine publishes with: its own topic (1 partition) and data dir."""
    suffix = uuid.uuid4().hex[:8]
    cfg = broker.replace(
        data_dir=str(data_dir),
        topics={
            **broker.topics.model_dump(),
            "engine_events": f"e2e-{name}-{suffix}.engine-events",
            "partitions": producer.pop("partitions", 1),
        },
        producer={"engine_name": f"e2e-{name}", "heartbeat_interval_s": 2.0, **producer},
    )
    ensure_topics(cfg, [cfg.topics.engine_events])
    return cfg


class EnginePool:
    """Keeps at most ``capacity`` engines alive; the least recently used one closes first."""

    def __init__(self, capacity: int = 2) -> None:
        self.capacity = capacity
        self.live: OrderedDict[str, Any] = OrderedDict()

    def get(self, name: str, factory: Callable[[], Any]) -> Any:
        if name in self.live:
            self.live.move_to_end(name)
            return self.live[name]
        while len(self.live) >= self.capacity:
            _, engine = self.live.popitem(last=False)
            engine.close()
        engine = self.live[name] = factory()
        return engine

    def close_all(self) -> None:
        while self.live:
            _, engine = self.live.popitem(last=False)
            with contextlib.suppress(Exception):
                engine.close()


@pytest.fixture(scope="session")
def engine_pool(broker: Config) -> Iterator[EnginePool]:
    """Engines close before the broker they publish to stops (they flush on the way out)."""
    pool = EnginePool()
    try:
        yield pool
    finally:
        pool.close_all()


class OfflineEngine:
    """``vllm.LLM`` in this process (EngineCore and worker are child processes)."""

    def __init__(self, cfg: Config, llm: Any, **extra: Any) -> None:
        self.cfg = cfg
        self.llm = llm
        self.extra = extra

    def close(self) -> None:
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        with contextlib.suppress(Exception):
            core.shutdown()
        self.llm = None
        gc.collect()
        closer = self.extra.get("on_close")
        if closer is not None:
            closer()


def start_offline(cfg: Config, model: Path, **llm_kwargs: Any) -> Any:
    """Start ``LLM(model, **llm_kwargs)`` with the plugin configured by ``cfg``."""
    from vllm import LLM

    env = {**ENGINE_ENV, **to_env(cfg), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    with environ(env):
        return LLM(model=str(model), seed=0, disable_log_stats=False, **llm_kwargs)


def run_driver(code: str, cfg: Config, args: list[str], workdir: Path, timeout: float = 600) -> str:
    """Run ``code`` (a script with an ``if __name__ == "__main__"`` guard) as an in-process engine
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with the plugin configured by ``cfg``; returns stderr."""
    driver = workdir / f"driver_{uuid.uuid4().hex[:8]}.py"
    driver.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
    env.update({**ENGINE_ENV, **to_env(cfg), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    run = subprocess.run(
        [sys.executable, str(driver), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout + run.stderr


class ServerEngine(ServerProcess):
    """``python -m vllm.entrypoints.openai.api_server`` with the plugin configured by ``cfg``
    (the product's launcher, :class:`~sparseety.stack.server_process.ServerProcess`)."""

    def __init__(self, cfg: Config, args: list[str], log: Path, timeout_s: float = 240.0) -> None:
        self.cfg = cfg
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
        env.update({**ENGINE_ENV, **to_env(cfg)})
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]
        super().__init__(command, env, log, what="the vLLM server", timeout_s=timeout_s)


@pytest.fixture(scope="session")
def e2e_dir(session_dir: Path) -> Path:
    d = session_dir / "e2e"
    d.mkdir(exist_ok=True)
    return d
