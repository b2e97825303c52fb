"""A CPU KV offload tier for vLLM's own ``OffloadingConnector`` on this CPU build (test support).

vLLM 0.32's ``CPUOffloadingSpec`` refuses a CPU platform in ``get_worker`` ("only supported on
CUDA-alike and XPU GPUs", ``vllm/v1/kv_offload/cpu/spec.py``): its worker copies blocks with CUDA
streams and events. Its scheduler side (the ``CPUOffloadingManager``: which blocks are offloaded,
lookups, evictions, KV events with medium "CPU") has no such limit. This subclass keeps all of
that and gives it a worker that copies the same blocks with plain torch indexing, synchronously,
so a transfer is finished when it is submitted. vLLM loads it through the connector's
``kv_connector_extra_config`` (``spec_name`` / ``spec_module_path``, ``vllm/v1/kv_offload/
factory.py``), as any out-of-tree spec.

Only what the scheduler side sees matters to the accounting tested with it (which tier served
which tokens); the copies are real all the same, so a load restores the KV it stored.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

SPEC_NAME = "TorchCPUOffloadingSpec"
SPEC_MODULE = __name__


class TorchCopyWorker(OffloadingWorker):
    """GPU blocks <-> CPU chunks by tensor indexing (one KV-cache group, as the tiny models have)."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int) -> None:
        self.device = [t.tensor for t in kv_caches.tensors]
        self.bpc = max(1, blocks_per_chunk)
        rows = max(1, num_chunks) * self.bpc
        self.host = [torch.zeros((rows, *t.shape[1:]), dtype=t.dtype) for t in self.device]
        self.finished: list[TransferResult] = []

    def _rows(self, gpu_spec: Any, chunks: Any) -> tuple[list[int], list[int]]:
        """(device blocks, host rows) of one transfer: logical block ``first + i`` of the request
        is slot ``(first + i) % bpc`` of the chunk listed for it."""
        first = int(gpu_spec.block_indices[0]) if len(gpu_spec.block_indices) else 0
        base = first // self.bpc
        blocks = [int(b) for b in gpu_spec.block_ids]
        rows = []
        for i in range(len(blocks)):
            logical = first + i
            chunk = int(chunks[logical // self.bpc - base])
            rows.append(chunk * self.bpc + logical % self.bpc)
        return blocks, rows

    def _done(self, job_id: int, blocks: list[int]) -> bool:
        size = sum(int(t[0].numel() * t.element_size()) for t in self.device) * len(blocks)
        self.finished.append(
            TransferResult(job_id=job_id, success=True, transfer_size=size, transfer_time=0.0)
        )
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        blocks, rows = self._rows(src_spec, dst_spec.block_ids)
        for dev, host in zip(self.device, self.host, strict=True):
            host[rows] = dev[blocks].to("cpu")
        return self._done(job_id, blocks)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        blocks, rows = self._rows(dst_spec, src_spec.block_ids)
        for dev, host in zip(self.device, self.host, strict=True):
            dev[blocks] = host[rows].to(dev.device)
        return self._done(job_id, blocks)

    def get_finished(self) -> list[TransferResult]:
        out, self.finished = self.finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return None  # every transfer finished when it was submitted


class TorchCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec with :class:`TorchCopyWorker` as its worker."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = TorchCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]


def kv_transfer_config(cpu_bytes: int = 64 << 20) -> dict[str, Any]:
    """The ``kv_transfer_config`` of an engine with this CPU tier behind vLLM's OffloadingConnector."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": SPEC_NAME,
            "spec_module_path": SPEC_MODULE,
            "cpu_bytes_to_use": cpu_bytes,
        },
    }
