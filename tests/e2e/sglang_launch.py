"""SGLang's HTTP server with the e2e tier's ground-truth recorder in its scheduler process.

Run as ``python -m tests.e2e.sglang_launch <sglang server args>`` from the repository root, in
SGLang's environment (.venv-sglang). SGLang starts its scheduler with multiprocessing's spawn
method, which imports the launching module again in the child (as ``__mp_main__``): the
module-level ``install_truth`` below therefore runs in the scheduler process too, where it wraps
SGLang's radix cache. The SparSEEty producer itself loads through its plugin entry point, exactly
as in production; this file only adds the test's independent record.

The truth is written as JSON lines to ``$E2E_SGLANG_TRUTH`` (appended and flushed per
record, so it survives the server's shutdown): one ``{"event_loop": name}`` line when the
scheduler enters its loop, one ``{"resumed": rid, "hit": prefix}`` line at each first extend
of a retracted request (the cached prefix it reads back), then per request, at its first
extend batch:

* ``hit``: the radix-cache prefix SGLang matched (``req.prefix_len``);
* ``recomputed_blocks``: full prompt blocks of ``BLOCK`` tokens at or past the hit whose token
  prefix the radix tree had held and evicted before this admission (the Python TreeCore's
  ``_release_all_component_layers``/``_demote``: SGLang's own choice of leaves, read as token
  paths, independent of the producer's recorder hooks and hashes; under the Rust TreeCore,
  SGLang's own converted KV events, ``BlockStored.token_ids`` chained by its own parent hashes,
  as ``_RustKVCacheEventRecorder.take`` returns them to whoever drains the queue).
"""

from __future__ import annotations

import json
import os
from typing import Any

BLOCK = 16  # the producer's block size on a page-size-1 radix cache


def _path_tokens(node: Any) -> list[int]:
    keys = []
    while node is not None and node.parent is not None:
        keys.append(node.key)
        node = node.parent
    out: list[int] = []
    for key in reversed(keys):
        out.extend(key.token_ids[: len(key)])
    return out


def install_truth(path: str) -> None:
    import wrapt

    evicted: set[tuple[int, ...]] = set()
    seen: set[str] = set()
    out = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def note_evicted(node: Any) -> None:
        tokens = _path_tokens(node)
        depth = len(tokens) - len(node.key)
        for end in range((depth // BLOCK + 1) * BLOCK, len(tokens) + 1, BLOCK):
            evicted.add(tuple(tokens[:end]))

    def on_tree_core(module: Any) -> None:
        # The Python TreeCore of SGLang's UnifiedRadixCache: a device leaf leaves the tree here
        # (released, or demoted to a host tier, which this CPU run does not have).
        cls = module.UnifiedTreeCore
        orig_release, orig_demote = cls._release_all_component_layers, cls._demote

        def _release_all_component_layers(self: Any, node: Any, medium: Any, *args: Any, **kw: Any) -> Any:
            if getattr(medium, "name", str(medium)) == "GPU":
                note_evicted(node)
            return orig_release(self, node, medium, *args, **kw)

        def _demote(self: Any, node: Any, *args: Any, **kw: Any) -> Any:
            note_evicted(node)
            return orig_demote(self, node, *args, **kw)

        cls._release_all_component_layers = _release_all_component_layers
        cls._demote = _demote

    pages: dict[int, tuple[tuple[int, ...], int]] = {}  # SGLang's page hash -> (path, page size)

    def note_rust(events: list[Any]) -> None:
        # SGLang's own KV events of the Rust TreeCore (its BlockStored/BlockRemoved, its hashes
        # and token ids): each page's token path; an evicted page evicts the block that ends in it.
        for e in events:
            kind = type(e).__name__
            if kind == "AllBlocksCleared":
                pages.clear()
            elif getattr(e.medium, "value", e.medium) != "GPU":
                continue
            elif kind == "BlockStored":
                parent = pages.get(e.parent_block_hash) if e.parent_block_hash is not None else None
                base = parent[0] if parent is not None else ()
                # under EAGLE the Rust core keys by bigrams: one (t[i], t[i + 1]) per position
                tokens = [t[0] if isinstance(t, tuple | list) else t for t in e.token_ids]
                page = len(tokens) // len(e.block_hashes)
                for i, h in enumerate(e.block_hashes):
                    pages[h] = (base + tuple(tokens[: (i + 1) * page]), page)
            elif kind == "BlockRemoved":
                for h in e.block_hashes:
                    path, page = pages.pop(h, ((), 1))
                    end = len(path) // BLOCK * BLOCK
                    if end > 0 and end > len(path) - page:
                        evicted.add(path[:end])

    def on_rust_adapter(module: Any) -> None:
        cls = module._RustKVCacheEventRecorder
        orig_take = cls.take

        def take(self: Any) -> Any:
            out = orig_take(self)
            note_rust(out)
            return out

        cls.take = take

    def on_batch(module: Any) -> None:
        cls = module.ScheduleBatch
        orig = cls.prepare_for_extend

        def prepare_for_extend(self: Any, *args: Any, **kwargs: Any) -> Any:
            tree = getattr(self, "tree_cache", None)
            if getattr(tree, "_tree_core_backend", None) == "rust":
                tree.take_events()  # what the Rust core queued before this batch (seen by take)
            for req in self.reqs:
                if req.rid in seen and getattr(req, "is_retracted", False):
                    # a retracted request's first extend again: the prefix it reads back
                    out.write(json.dumps({"resumed": req.rid, "hit": int(req.prefix_len)}) + "\n")
                if req.rid in seen or req.rid.startswith("HEALTH_CHECK"):
                    continue
                seen.add(req.rid)
                prompt = list(req.origin_input_ids)
                hit = int(req.prefix_len)
                first = -(-hit // BLOCK)  # the fold counts blocks that start at or past the hit
                recomputed = sum(
                    1
                    for k in range(first, len(prompt) // BLOCK)
                    if tuple(prompt[: (k + 1) * BLOCK]) in evicted
                )
                out.write(json.dumps({"rid": req.rid, "hit": hit, "recomputed_blocks": recomputed}) + "\n")
            return orig(self, *args, **kwargs)

        cls.prepare_for_extend = prepare_for_extend

    def on_scheduler(module: Any) -> None:
        # Which of SGLang's event loops the scheduler runs (the overlap one is its GPU default).
        cls = module.Scheduler
        for name in ("event_loop_overlap", "event_loop_normal"):
            orig_loop = getattr(cls, name)

            def loop(self: Any, *args: Any, _orig: Any = orig_loop, _name: str = name, **kw: Any) -> Any:
                out.write(json.dumps({"event_loop": _name}) + "\n")
                return _orig(self, *args, **kw)

            setattr(cls, name, loop)

    wrapt.register_post_import_hook(on_scheduler, "sglang.srt.managers.scheduler")
    wrapt.register_post_import_hook(on_tree_core, "sglang.srt.mem_cache.unified_cache.unified_tree_core")
    wrapt.register_post_import_hook(on_batch, "sglang.srt.managers.schedule_batch")
    wrapt.register_post_import_hook(on_rust_adapter, "sglang.srt.mem_cache.rust_tree_core.adapter")


if os.environ.get("E2E_SGLANG_TRUTH"):
    install_truth(os.environ["E2E_SGLANG_TRUTH"])

if __name__ == "__main__":
    # sglang.launch_server's own main, called from here so that this module stays ``__main__``
    # (runpy would make sglang.launch_server the module the spawned children import).
    import sys

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    try:
        run_server(prepare_server_args(sys.argv[1:]))
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
