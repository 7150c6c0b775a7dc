"""The lab's CPU offloading worker (lab/kvwatt_lab/cpu_offload.py) in vLLM's own interpreter, against vLLM
0.32.0's real spec classes (no engine start: ~15 s of importing vLLM). The whole tier on a running engine is
tests/test_offload_real_engine.py."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.support.engine import engine_available, offload_env, vllm_python

pytestmark = pytest.mark.engine

ROUNDTRIP = r"""
import json, time, torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from kvwatt_lab.cpu_offload import TorchCopyWorker, GIB
torch.manual_seed(0)
plain = torch.randint(-128, 127, (10, 64), dtype=torch.int8)
wide = torch.randint(-128, 127, (10, 128), dtype=torch.int8)
strided = wide[:, :64]  # rows 128 bytes apart, as a layer's view of an interleaved cache
caches = CanonicalKVCaches([CanonicalKVCacheTensor(plain, 64), CanonicalKVCacheTensor(strided, 64)],
                           [[CanonicalKVCacheRef(0, 64), CanonicalKVCacheRef(1, 64)]])
out = {}
w = TorchCopyWorker(caches, blocks_per_chunk=2, num_chunks=4, link_gib_per_second=None)
before = [plain[[3, 7, 1]].clone(), strided[[3, 7, 1]].clone()]
# logical blocks 1..3 of a request: the first host chunk's first half belongs to block 0 (skipped)
host = CPULoadStoreSpec([2, 0])
w.submit_store(1, GPULoadStoreSpec([3, 7, 1], [3], [1]), host)
plain[[3, 7, 1]] = 0; strided[[3, 7, 1]] = 0
tail = wide[:, 64:].clone()  # the bytes between the strided rows: not the layer's, never written
w.submit_load(2, host, GPULoadStoreSpec([4, 5, 6], [3], [1]))
done = w.get_finished()
out["results"] = sorted((r.job_id, r.success, r.transfer_size) for r in done)
out["restored"] = bool(torch.equal(plain[[4, 5, 6]], before[0]) and torch.equal(strided[[4, 5, 6]], before[1]))
out["other_rows_kept"] = bool(torch.equal(wide[:, 64:], tail))
slow = TorchCopyWorker(caches, blocks_per_chunk=2, num_chunks=4, link_gib_per_second=1000 / GIB)  # 1 kB/s
t0 = time.monotonic()
slow.submit_store(3, GPULoadStoreSpec([4, 5, 6], [3], [1]), host)
out["finished_at_once"] = [r.job_id for r in slow.get_finished()]
slow.wait({3})
out["waited"] = time.monotonic() - t0
[r] = slow.get_finished()
out["slow"] = [r.job_id, r.transfer_size, r.transfer_time]
print(json.dumps(out))
"""


def _run(code: str) -> subprocess.CompletedProcess:
    if not engine_available():
        pytest.fail(f"no vLLM interpreter at {vllm_python()} (make lab)")
    return subprocess.run([vllm_python(), "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **offload_env()})


def test_blocks_round_trip_through_the_host_pool_and_the_link_sets_the_transfer_time():
    out = _run(ROUNDTRIP)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # 3 blocks x 2 tensors x 64 bytes each way; both finish at once without a link
    assert got["results"] == [[1, True, 384], [2, True, 384]]
    assert got["restored"] and got["other_rows_kept"]
    # at 1 kB/s the 384 bytes take 0.384 s: not finished at submission, wait() blocks until they are
    assert got["finished_at_once"] == []
    assert got["slow"][:2] == [3, 384] and got["slow"][2] == pytest.approx(0.384, rel=0.02)
    assert got["waited"] >= 0.38


def test_another_vllm_is_refused_in_one_line():
    out = _run("import vllm; vllm.__version__ = '0.33.0'; import kvwatt_lab.cpu_offload")
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("kvwatt_lab.cpu_offload.InterfaceMoved: ") and "0.32.0" in last and "0.33.0" in last, last
