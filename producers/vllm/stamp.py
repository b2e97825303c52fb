"""What the engine core and its worker processes agree on, each without importing the other's
module: the stamp every SchedulerOutput carries to the workers (:mod:`.session` sets it,
:mod:`.routing` reads it), and whether MoE routing is captured (both decide the same way)."""

from __future__ import annotations

from typing import Any

from sparseety.config import Config

#: Attribute set on every SchedulerOutput: ``(engine_name, epoch, step)``. It is pickled to the
#: worker processes with the output and joins worker-side captures (MoE routing) to the step.
STEP_STAMP = "sparseety_step"


def routing_enabled(cfg: Config, vllm_config: Any) -> bool:
    """Whether MoE routing is captured for this engine (both processes decide the same way)."""
    if not cfg.producer.routing_capture:
        return False
    model_config = vllm_config.model_config
    try:
        is_moe = bool(getattr(model_config, "is_moe", False)) or model_config.get_num_experts() > 0
    except Exception:
        is_moe = False
    if not is_moe:
        return False
    if getattr(model_config, "enforce_eager", False):
        return True
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return True  # torch.compile without CUDA graphs: the custom-op hook runs per step
    except Exception:
        pass
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return mode is None or str(getattr(mode, "name", mode)).upper() == "NONE"
