"""Issue 38.2: a busy engine is never paged as stalled. The engine-step counter
(vllm:iteration_tokens_total_count) stops moving while the engine generates 500 tokens/s with 4 requests running
(a detached stats logger, a data-parallel coordinator's copy of the series): tokens cannot be generated without
steps, so the step counter is a stale witness, said as a diagnosis, and neither the stalled_engine set nor the
signature holds. End to end: a simulated vLLM 0.33 on loopback whose step histogram is frozen, read by a real
`kvwatt run` subprocess (the derivation's own cases are in tests/test_offload_collapse.py)."""

from __future__ import annotations

import re
import time

import pytest

from tests.support import vllm_sim as sim
from tests.support.daemon import KvwattDaemon, pick
from tests.support.loopback import FakeVllm

STEP_LINE = re.compile(r"^vllm:iteration_tokens_total_(?:bucket|count|sum)\{.*$", re.M)


class FrozenStepsVllm(FakeVllm):
    """A fake vLLM whose step histogram keeps the values of its first scrape (every other series moves)."""

    frozen: dict[str, str] | None = None

    def exposition(self) -> str:
        text = super().exposition()
        if self.frozen is None:
            self.frozen = {m.group(0).rsplit(" ", 1)[0]: m.group(0) for m in STEP_LINE.finditer(text)}
        return STEP_LINE.sub(lambda m: self.frozen.get(m.group(0).rsplit(" ", 1)[0], m.group(0)), text)


def busy() -> sim.Scenario:
    phase = sim.Phase(name="busy", generation_tokens_per_second=500.0, prompt_tokens_per_second=2000.0,
                      kv_usage_ratio=0.4, running=4, waiting=0, gpu_power_watts=400.0, ttft_seconds=0.2,
                      itl_seconds=0.03)
    return sim.Scenario("busy_frozen_steps", (phase,), offload_buffer_gib=None, version="0.33", seed=38)


@pytest.mark.slow  # real time: ~15 s for the 10 s window to fill, then a few ticks watched
def test_a_busy_engine_with_a_frozen_step_counter_is_not_paged_as_stalled():
    with FrozenStepsVllm(busy()) as fv, \
            KvwattDaemon(servers={"busy": fv.url}, config={"windows": ["10s"]}, interval="250ms") as d:
        def settled(d):
            col = next(s for s in d.status()["servers"] if s["server"] == "busy").get("collapse") or {}
            cond = col.get("conditions", {})
            return col if None not in (cond.get("engine_steps_stopped"), cond.get("requests_pending")) else None

        col = d.wait_for(settled, timeout=40, what="the stalled_engine conditions decided (a covered window)")
        seen = []
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:  # watched over several ticks: never a stall, never a page
            m = d.metrics()
            st = next(s for s in d.status()["servers"] if s["server"] == "busy")
            seen.append((pick(m, "kvwatt_collapse_signature", server="busy"),
                         pick(m, "kvwatt_collapse_condition_set", server="busy", condition_set="stalled_engine"),
                         pick(m, "kvwatt_collapse_condition", server="busy", condition="engine_steps_stopped"),
                         [a["kind"] for a in st["advice"]]))
            time.sleep(0.5)
        log = d.log()
    assert col["conditions"]["requests_pending"] is True, col  # busy: 4 running at every sample
    assert col["conditions"]["engine_steps_stopped"] is False and col["signature"] is not True, col
    assert col["condition_set"] is None and col["condition_sets"]["stalled_engine"] is False, col
    stale = col["stale_witnesses"]["engine_steps"]
    assert "stale" in stale and "generation tokens" in stale, stale
    assert "stale witness engine_steps" in col["reason"], col["reason"]
    assert all(sig != 1 and stalled == 0 and cond == 0 and "stalled_engine" not in kinds
               for sig, stalled, cond, kinds in seen), seen
    assert log.count("the step counter is stale") == 1, log[-3000:]  # said once, not per tick
