"""Import-time fixes for SGLang on this CPU (SGLang tests and demo only; docs/sglang.md).

Loaded from ``sparseety_sglang_cpu_shims.pth`` in .venv-sglang's site-packages. It imports nothing
heavy: it puts one finder on ``sys.meta_path`` that acts once, just before ``torchvision`` is
imported.

PyPI's torchvision wheel is built against CUDA torch; beside the CPU build of torch its C++ ops
do not load, and ``torchvision/_meta_registrations.py`` then fails on import with "operator
torchvision::nms does not exist" (the same failure as beside vLLM, where setup.sh removes
torchvision). SGLang imports torchvision on its startup path, so the operator schemas are defined
here first, without kernels: a text model never calls them.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder
from typing import Any

#: Schemas of the torchvision ops whose meta kernels torchvision registers at import.
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: Any = None


class _TorchvisionOps(MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            _define_ops()
        return None  # the normal finders import the module


def _define_ops() -> None:
    global _library
    import torch

    try:
        if torch._C._dispatch_has_kernel_for_dispatch_key("torchvision::nms", "CPU"):
            return  # a torchvision build that loads its own ops
    except RuntimeError:
        pass  # the operator does not exist: define it
    _library = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        _library.define(schema)


def install() -> None:
    if not any(isinstance(f, _TorchvisionOps) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionOps())
