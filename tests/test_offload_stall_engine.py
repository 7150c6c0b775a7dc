"""A REAL stall of an offloading engine (vLLM #57841 "steps scheduled nothing", #49829): vLLM's own
OffloadingConnector with the lab's tier (lab/kvwatt_lab/cpu_offload.py) on a slow host link, a large host pool
and sustained pressure, watched by kvwatt.

The link is 0.00005 GiB/s (54 kB/s: a 28-block request's stores take ~8 s) and the pool 0.25 GiB (16,384
blocks: everything is stored, every turn's prefix hits). Eight clients resend growing conversations into 130
blocks. vLLM stores finished and preempted requests' blocks before it reuses them: when the scheduler needs
them it makes the worker wait for those stores (``jobs_to_flush`` -> ``OffloadingWorker.wait``, a CUDA event
synchronize on a GPU), and the whole engine steps no more until the link has carried them: requests pending,
no step, no token, no preemption. Measured (docs/offload.md §6): 34 s of that at once, then stretches of ~12 s.

kvwatt must say so: ``condition_set="stalled_engine"`` within about its 10 s window, with the collapse
conditions ``offload_enabled`` and ``zero_preemptions``; checked against an independent scrape of the engine's
own counters over the same stretch (steps and tokens flat, preemptions flat, requests pending). The classic set's
power condition is unknown here (no GPU), so only engine liveness can carry the signature.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import requests

from tests.support.daemon import KvwattDaemon, parse_exposition
from tests.support.engine import VllmEngine, build_tiny_model

pytestmark = [pytest.mark.engine, pytest.mark.slow]
LINK_GIB_PER_SECOND, HOST_POOL_GIB, BLOCKS, CLIENTS = 0.00005, 0.25, 130, 8
WINDOW_SECONDS = 10.0


def counters(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (name, _), v in parse_exposition(requests.get(url + "/metrics", timeout=10).text).items():
        if name in ("vllm:iteration_tokens_total_count", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_offload_cpu_cache_usage_perc"):
            out[name] = out.get(name, 0.0) + v
    return out


def _client(url: str, seed: int, stop: threading.Event) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(4, 2048) for _ in range(700)]
    while not stop.is_set():
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 200, "min_tokens": 200, "ignore_eos": True,
                "temperature": 0.0}
        try:
            requests.post(url + "/v1/completions", json=body, timeout=300)
        except requests.RequestException:
            return
        prompt = (prompt + [rng.randrange(4, 2048) for _ in range(50)])[-1800:]  # the next turn: same prefix


def test_a_slow_host_tier_stalls_the_real_engine_and_kvwatt_says_so(tmp_path):
    engine = VllmEngine(build_tiny_model(), num_gpu_blocks=BLOCKS, max_model_len=2048,
                        extra_args=["--enable-prefix-caching"], offload_gib=HOST_POOL_GIB,
                        offload_link=LINK_GIB_PER_SECOND)
    stop = threading.Event()
    with engine:
        config = {"windows": ["10s"], "nvml": False, "state_dir": str(tmp_path / "state"),
                  "collapse_reference_window": "30s"}
        with KvwattDaemon(servers={"stall": {"url": engine.url, "gpus": []}}, config=config,
                          interval="500ms") as d:
            clients = [threading.Thread(target=_client, args=(engine.url, i, stop), daemon=True)
                       for i in range(CLIENTS)]
            for c in clients:
                c.start()
            try:
                samples, flagged = [], None
                started = time.monotonic()
                while time.monotonic() - started < 150 and flagged is None:
                    samples.append((time.monotonic(), counters(engine.url)))
                    if d.value("kvwatt_collapse_condition_set", server="stall", condition_set="stalled_engine") == 1:
                        flagged = (time.monotonic(), d.metrics(), counters(engine.url))
                    time.sleep(1.0)
            finally:
                stop.set()
    assert flagged is not None, f"no stall flagged in 150 s; last engine counters {samples[-1][1]}"
    t_flag, m, at_flag = flagged
    # the engine's own record of the stretch kvwatt judged: the samples of the last window before the flag
    recent = [c for t, c in samples if t >= t_flag - WINDOW_SECONDS + 1.5] + [at_flag]
    first, last = recent[0], recent[-1]
    print(f"\nstall flagged {t_flag - samples[0][0]:.1f} s into the load; engine over the window: {first} -> {last}")
    assert len(recent) >= 5
    for name in ("vllm:iteration_tokens_total_count", "vllm:generation_tokens_total", "vllm:num_preemptions_total"):
        assert last[name] == first[name], (name, first, last)  # no step, no token, no preemption
    assert all(c["vllm:num_requests_running"] + c["vllm:num_requests_waiting"] > 0 for c in recent)
    assert last["vllm:kv_offload_cpu_cache_usage_perc"] > 0  # the stores it waits for pin part of the pool

    def cond(name):
        return next(v for (n, lab), v in m.items() if n == "kvwatt_collapse_condition"
                    and dict(lab) == {"server": "stall", "condition": name})
    assert next(v for (n, lab), v in m.items() if n == "kvwatt_collapse_signature") == 1
    assert cond("engine_steps_stopped") == 1 and cond("requests_pending") == 1
    assert cond("offload_enabled") == 1 and cond("zero_preemptions") == 1
    # the in-flight gauge is not occupancy: kvwatt shows none for vLLM even while it is non-zero
    assert not any(n == "kvwatt_offload_buffer_used_ratio" for (n, _) in m)
