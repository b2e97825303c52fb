"""MoE routing capture in the model-runner (worker) process: expert counts per request, layer
and expert for every engine step, on stream ``worker-<rank>``.

vLLM 0.32's own routed-experts output needs Model Runner V2 (Triton), so on CPU (and wherever
it is off) routing is read from the router gates with forward hooks:

* The hooks are installed on every ``<...>.gate`` module whose parent owns ``experts`` (Mixtral
  ``block_sparse_moe.gate``, Qwen-MoE ``mlp.gate``, ...) when the model is loaded.
* Each call keeps a copy of the router logits (nothing else happens in the forward pass); the
  emitter thread takes ``torch.topk(router_logits, top_k)`` — the experts a softmax-top-k router
  picks (routers with grouped top-k or score bias, e.g. DeepSeek-V3, are approximated).
* The runner's ``execute_model`` wrapper knows the step (the core stamps ``SchedulerOutput``) and,
  after the forward pass, the batch layout (``input_batch.req_ids``, ``query_start_loc``); it hands
  all of it to the emitter, whose thread counts experts per request with numpy.
* Warm-up and dummy runs carry no stamp and are ignored.

Compiled models: a plain hook's Python runs once, at trace time. In eager mode
(``enforce_eager=True``) the hook is plain Python; otherwise the hook calls a
``torch.library.custom_op`` that mutates a dummy buffer, which torch.compile keeps in the graph
and runs every step. CUDA-graph replay runs no Python at all: with CUDA graphs on, capture is
disabled (``routing_enabled`` in ``stamp.py``) and the log says so; use ``enforce_eager``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
from typing import Any

from sparseety import events as ev
from sparseety.config import Config, load_config

from ..emitter import Emitter
from .stamp import STEP_STAMP, routing_enabled

log = logging.getLogger("sparseety.producer.vllm")

_CAPTURES: dict[int, RoutingCapture] = {}
_op: Any = None


def _custom_op() -> Any:
    """``sparseety::record_routing``: runs the capture inside compiled graphs."""
    global _op
    if _op is not None:
        return _op
    import torch

    def record_routing(logits: Any, sink: Any, slot: int, layer: int) -> None:
        cap = _CAPTURES.get(slot)
        if cap is not None:
            cap.record(layer, logits)

    def fake(logits: Any, sink: Any, slot: int, layer: int) -> None:
        return None

    # Real types, not the postponed strings of ``from __future__ import annotations``: the
    # schema is inferred from them.
    types = {"logits": torch.Tensor, "sink": torch.Tensor, "slot": int, "layer": int, "return": None}
    record_routing.__annotations__ = dict(types)
    fake.__annotations__ = dict(types)
    op = torch.library.custom_op("sparseety::record_routing", record_routing, mutates_args=("sink",))
    op.register_fake(fake)
    _op = op
    return _op


def find_gates(model: Any) -> list[tuple[str, Any]]:
    """Router gate modules in layer order."""
    modules = dict(model.named_modules())
    gates = []
    for name, module in modules.items():
        if not name.endswith(".gate"):
            continue
        parent = modules.get(name.rsplit(".", 1)[0])
        if parent is not None and hasattr(parent, "experts"):
            gates.append((name, module))
    return gates


def routing_counts(
    step: int, req_ids: list[str], qsl: Any, layers: list[tuple[int, Any]], num_experts: int, top_k: int
) -> tuple[str, dict[str, Any]]:
    """Emitter-thread builder: the experts each token chose (top-k of the router logits), counted
    per request, layer and expert for one step."""
    import numpy as np
    import torch

    n_req = len(req_ids)
    layers = sorted(layers, key=lambda x: x[0])
    counts = np.zeros((n_req, len(layers), num_experts), dtype=np.int64)
    per_req = np.diff(np.asarray(qsl[: n_req + 1], dtype=np.int64))
    row_req = np.repeat(np.arange(n_req), per_req)
    for li, (_, logits) in enumerate(layers):
        top = torch.topk(logits.float(), top_k, dim=-1).indices.cpu().numpy()
        rows = min(top.shape[0], row_req.shape[0])
        k = top.shape[1]
        np.add.at(counts[:, li, :], (np.repeat(row_req[:rows], k), top[:rows].reshape(-1)), 1)
    return ev.MOE_ROUTING, {
        "step": int(step),
        "req_ids": list(req_ids),
        "num_layers": len(layers),
        "num_experts": int(num_experts),
        "expert_counts": counts.reshape(-1).tolist(),
    }


class RoutingCapture:
    """Routing capture of one model runner.

    Args:
        cfg: Configuration (read from the environment when the worker loaded the model).
        runner: The vLLM model runner.
        num_experts, top_k: From the model config.
        rank: Global rank of this worker (names the stream).
    """

    def __init__(self, cfg: Config, runner: Any, num_experts: int, top_k: int, rank: int) -> None:
        self.cfg = cfg
        self.runner = runner
        self.num_experts = num_experts
        self.top_k = top_k
        self.stream = f"worker-{rank}"
        # Started now, bound to the engine epoch at the first step: the Kafka client connects
        # during warm-up instead of lagging behind the engine core's stream.
        self.emitter = Emitter(cfg, engine_name=None, epoch=None, stream=self.stream)
        self.current: tuple[str, str, int] | None = None
        self.layers: list[tuple[int, Any]] = []
        self.num_layers = 0

    def install(self, model: Any, compiled: bool) -> int:
        import torch

        gates = find_gates(model)
        slot = id(self)
        _CAPTURES[slot] = self
        if compiled:
            op = _custom_op()
            sink = torch.zeros(1)
        for layer, (_, gate) in enumerate(gates):
            if compiled:

                def hook(_m: Any, _i: Any, out: Any, layer: int = layer) -> None:
                    op(out[0] if isinstance(out, tuple) else out, sink, slot, layer)

            else:

                def hook(_m: Any, _i: Any, out: Any, layer: int = layer) -> None:
                    self.record(layer, out[0] if isinstance(out, tuple) else out)

            gate.register_forward_hook(hook)
        self.num_layers = len(gates)
        return len(gates)

    # --- hot path (forward pass) ----------------------------------------------------------

    def record(self, layer: int, logits: Any) -> None:
        if self.current is None:
            return
        # A copy (the MoE kernels may reuse the buffer); top-k runs on the emitter thread, where
        # torch releases the GIL: on CPU, topk of bf16 logits costs more than the copy.
        self.layers.append((layer, logits.detach().clone()))

    def begin(self, so: Any) -> None:
        self.current = getattr(so, STEP_STAMP, None)
        if self.layers:
            self.layers = []

    def end(self) -> None:
        stamp = self.current
        self.current = None
        if stamp is None or not self.layers:
            return
        layers, self.layers = self.layers, []
        em = self.emitter
        if not em.bound:
            em.bind(stamp[0], stamp[1])
        elif em.epoch != stamp[1]:  # a new engine epoch in the same worker process
            em.close(1.0)
            em = self.emitter = Emitter(self.cfg, engine_name=stamp[0], epoch=stamp[1], stream=self.stream)
        batch = self.runner.input_batch
        n = batch.num_reqs
        req_ids = list(batch.req_ids[:n])
        qsl = self.runner.query_start_loc.np[: n + 1].copy()
        em.emit(routing_counts, stamp[2], req_ids, qsl, layers, self.num_experts, self.top_k)

    def close(self) -> None:
        _CAPTURES.pop(id(self), None)
        self.emitter.close()


def flush_in_process(timeout: float) -> None:
    """Deliver routing captured in this process (engine core and worker share one process when
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) before the engine core's EngineStopped goes out."""
    for cap in list(_CAPTURES.values()):
        if cap.emitter.bound:
            cap.emitter.wait_idle(timeout)


def _worker_rank() -> tuple[int, bool]:
    """(global rank, whether this rank should capture: tensor-parallel rank 0 only)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_world_group

        return get_world_group().rank, get_tensor_model_parallel_rank() == 0
    except Exception:
        return 0, True


def _after_load_model(runner: Any) -> None:
    cfg = load_config(env=os.environ)
    vc = runner.vllm_config
    if not routing_enabled(cfg, vc):
        if cfg.producer.routing_capture:
            log.info(
                "sparseety: MoE routing capture off for this model (dense, or CUDA graphs without eager)"
            )
        return
    rank, capture = _worker_rank()
    if not capture:
        return
    mc = vc.model_config
    compiled = not getattr(mc, "enforce_eager", False)
    cap = RoutingCapture(cfg, runner, mc.get_num_experts(), mc.get_num_experts_per_tok(), rank)
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    n = cap.install(model, compiled)
    if not n:
        log.warning("sparseety: routing capture found no MoE router gates in %s", type(model).__name__)
        return
    runner._sparseety_routing = cap
    atexit.register(cap.close)
    log.info(
        "sparseety: capturing MoE routing of %d layers on stream %s (%s)",
        n,
        cap.stream,
        "custom op in the compiled graph" if compiled else "eager forward hooks",
    )


def patch_runner_module(module: Any) -> list[str]:
    """Patch the model-runner classes a module defines (called when vLLM imports it, which
    happens only in processes that run a model)."""
    patched = []
    for name in ("GPUModelRunner", "CPUModelRunner"):
        cls = getattr(module, name, None)
        if cls is None or cls.__module__ != module.__name__:
            continue
        if "load_model" in cls.__dict__ and not getattr(cls.load_model, "_sparseety", False):
            cls.load_model = _wrap_load_model(cls.load_model)
            patched.append(f"{name}.load_model")
        if "execute_model" in cls.__dict__ and not getattr(cls.execute_model, "_sparseety", False):
            cls.execute_model = _wrap_execute_model(cls.execute_model)
            patched.append(f"{name}.execute_model")
    return patched


def _wrap_load_model(orig: Any) -> Any:
    @functools.wraps(orig)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, *args, **kwargs)
        try:
            _after_load_model(self)
        except Exception as exc:
            log.warning("sparseety: MoE routing capture not installed: %r", exc)
        return result

    load_model._sparseety = True  # type: ignore[attr-defined]
    return load_model


def _wrap_execute_model(orig: Any) -> Any:
    @functools.wraps(orig)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        cap = getattr(self, "_sparseety_routing", None)
        if cap is None:
            return orig(self, scheduler_output, *args, **kwargs)
        try:
            cap.begin(scheduler_output)
        except Exception:
            cap.current = None
        try:
            return orig(self, scheduler_output, *args, **kwargs)
        finally:
            try:
                cap.end()
            except Exception as exc:
                log.warning("sparseety: MoE routing capture stopped after an error: %r", exc)
                self._sparseety_routing = None

    execute_model._sparseety = True  # type: ignore[attr-defined]
    return execute_model
