"""Stand-in for ``sgl_kernel`` on a CPU without its wheel (SGLang tests and demo only).

SGLang 0.5.23 imports a few names from ``sgl_kernel`` at module level, also on its CPU path, but
``sgl_kernel`` has no CPU wheel on PyPI (its CPU build is C++ for Xeon AMX, built from source).
For a plain Llama with ``--attention-backend torch_native`` none of these names is ever called;
each one raises if it is, so a path that does need a kernel fails loudly instead of computing
something else. Installed by scripts/setup_sglang.sh into .venv-sglang only (docs/sglang.md).
"""

from __future__ import annotations

from typing import Any, NoReturn

__version__ = "0.0.0+sparseety-cpu-stand-in"


def _missing(name: str) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is a stand-in (deploy/sglang-cpu): this CPU has no sgl_kernel build"
        )

    kernel.__name__ = name
    return kernel


#: The names SGLang imports on the CPU path of a plain Llama (found by starting a server).
NAMES = (
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)

for _name in NAMES:
    globals()[_name] = _missing(_name)
