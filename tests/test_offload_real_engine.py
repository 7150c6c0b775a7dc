"""A REAL offloading engine: vLLM's own OffloadingConnector on the CPU engine (the lab's tier,
lab/kvwatt_lab/cpu_offload.py), watched by kvwatt, against an OFF twin with the same KV cache.

ONE start of each engine serves every test here (module fixture ``lab``: an ON engine with a 16 MiB host pool
and an OFF engine, both 130 blocks of 32 tokens, started side by side) and ONE workload run feeds every check:
  1. an evict-and-reload: a 1,500-token prompt, five other prompts that evict it from the device, the same
     prompt again (ON: reloaded from the host tier; OFF: computed again);
  2. preemption: ten concurrent 700-token requests generating 900 tokens each, needing 500 blocks of 130
     (ON: preempted requests resume from the host tier; OFF: recomputed);
  3. a steady phase: 40 s of short fresh requests from three clients (no preemption), so that both engines
     generate through several 5 s windows and kvwatt has windows to pair (the phases before fill one or two).
The two engines start each phase together (a barrier at each checkpoint), so their windows carry the same phase
and kvwatt can pair them.
Each engine has its own core (VLLM_CPU_OMP_THREADS_BIND 0 and 1 for the worker, and the affinity of its API server
and engine core: unbound, an engine core's busy poll took the other engine's core and the two ran by turns),
both niced so that the watcher keeps some CPU. A kvwatt daemon (1 s ticks) watches both from before the first request
(ON paired with OFF, each with the tiny model's config.json). Every figure is compared with an independent scrape of the
engine's own /metrics (parsed with prometheus_client's parser, not kvwatt's), with the tolerance each test states. GPU
energy is the NVML test DOUBLE (tests/support/fake_gpus.py: no GPU here): each "GPU"'s energy counter is a known model
of its engine's generated tokens, 50 W idle (integrated by the double at each read) + J_ON = 0.6 J (ON) or J_OFF = 0.8 J
(OFF) per generated token, counted as the tokens stream to this test's clients (every request streams); so the energy
figures check kvwatt's windows, pairing and arithmetic on a real engine's token counts against a known answer
(dE = 1 - 0.6/0.8 = 0.25), not a GPU's costs.
"""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
from kvwatt_lab.replay.client import SseSplitter

from exporter.derive.phase_energy import PRIOR_PROMPT_TO_GENERATED_COST_RATIO
from tests.support.daemon import KvwattDaemon, parse_exposition
from tests.support.engine import VllmEngine, build_tiny_model
from tests.support.fake_gpus import FakeGpus

pytestmark = [pytest.mark.engine, pytest.mark.owns_cores]  # ON on core 0, OFF on core 1
BLOCKS = 130
HOST_POOL_GIB = 1 / 64  # 16 MiB: 1,024 blocks of the tiny model's 16 KiB
LONG, OTHERS, PRESSURE, PRESSURE_PROMPT, PRESSURE_OUTPUT = 1500, 5, 10, 700, 900
# the steady phase: STEADY_WINDOW ends STEADY_SECONDS into it (plus _settled's ~3 s), so it holds only the
# 5 s windows in which both engines generated all along (none of the ramp at its start)
STEADY_SECONDS, STEADY_CLIENTS, STEADY_OUTPUT, STEADY_WINDOW = 37.0, 3, 128, "30s"
IDLE_WATTS, J_ON, J_OFF = 50.0, 0.6, 0.8
WINDOW = "10m"  # longer than the run: every kvwatt window figure covers the whole run since the daemon started
# kvwatt's tick: its NVML reads have half of it; at 0.5 s ticks the reads of the double missed their 0.25 s
# deadline when both engines computed on the two cores, and an interval without energy leaves the priced figures
INTERVAL = "1s"
BLOCK_BYTES = 16 * 1024  # 2 layers x (K, V) x 2 KV heads x 32 dims x 32 tokens x 2 bytes


def engine_counters(url: str) -> dict[str, float]:
    """The engine's own counters, parsed by prometheus_client (independent of kvwatt), summed over labels
    other than ``source``: ``{"vllm:prompt_tokens_by_source_total{local_compute}": ...}``."""
    out: dict[str, float] = {}
    for (name, labels), v in parse_exposition(requests.get(url + "/metrics", timeout=10).text).items():
        if not name.startswith("vllm:") or name.endswith("_created") or name.endswith("_bucket"):
            continue
        lab = dict(labels)
        key = name + (f"{{{lab['source']}}}" if "source" in lab else "") + (
            f"{{{lab['transfer_type']}}}" if "transfer_type" in lab else "")
        out[key] = out.get(key, 0.0) + v
    return out


def delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


class Tally:
    """The generated tokens one engine has streamed to this test's clients so far (the energy double's input)."""

    def __init__(self) -> None:
        self.tokens = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.tokens += n


def _complete(url: str, prompt: list[int], n: int, tally: Tally) -> list[int]:
    """The request's generated token ids, streamed: each chunk's tokens reach ``tally`` as the API server sends
    them (a few ms after vLLM counts them in vllm:generation_tokens_total, in the same output loop)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "min_tokens": n, "ignore_eos": True,
            "temperature": 0.0, "return_token_ids": True, "stream": True}
    out: list[int] = []
    events = SseSplitter()  # the replayer's parser of server-sent events
    with requests.post(url + "/v1/completions", json=body, timeout=600, stream=True) as r:
        r.raise_for_status()
        for chunk in r.iter_content(chunk_size=None):
            for payload in events.feed(chunk):
                for choice in json.loads(payload).get("choices") or ():
                    ids = choice.get("token_ids") or []
                    out.extend(ids)
                    tally.add(len(ids))
    assert events.done and len(out) == n, (events.done, len(out), n)
    return out


def workload(url: str, tally: Tally, checkpoint=lambda name: None, in_steady_load=lambda: None) -> dict[str, list]:
    """The same token ids for ON and OFF (seeded), so their outputs can be compared token for token.
    ``checkpoint(name)`` runs between the phases (the fixture reads both engines and kvwatt there);
    ``in_steady_load()`` while the steady phase's clients run, which stop when it returns."""
    rng = random.Random(27)
    long_prompt = [rng.randrange(4, 2048) for _ in range(LONG)]
    others = [[rng.randrange(4, 2048) for _ in range(LONG)] for _ in range(OTHERS)]
    pressure = [[rng.randrange(4, 2048) for _ in range(PRESSURE_PROMPT)] for _ in range(PRESSURE)]
    out: dict[str, list] = {"first": _complete(url, long_prompt, 8, tally)}
    out["others"] = [_complete(url, p, 8, tally) for p in others]
    checkpoint("stored")  # ON has stored six prompts and reloaded nothing yet
    out["again"] = _complete(url, long_prompt, 8, tally)
    checkpoint("reloaded")  # no preemption so far
    out["pressure"] = _concurrently(PRESSURE, lambda i: _complete(url, pressure[i], PRESSURE_OUTPUT, tally))
    checkpoint("pressured")
    stop = threading.Event()
    clients = threading.Thread(target=_concurrently,
                               args=(STEADY_CLIENTS, lambda i: _steady(url, tally, stop, random.Random(i))))
    clients.start()
    try:
        in_steady_load()
    finally:
        stop.set()
        clients.join()
    return out


def _concurrently(n: int, fn) -> list:
    results: list = [None] * n

    def one(i):
        results[i] = fn(i)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _steady(url: str, tally: Tally, stop: threading.Event, rng: random.Random) -> None:
    """One client of the steady phase: short fresh requests back to back until ``stop`` (no preemption:
    3 x (256 + 128) tokens are 36 of the 130 blocks), so that both engines generate through every 5 s window
    of STEADY_WINDOW and kvwatt pairs them."""
    while not stop.is_set():
        _complete(url, [rng.randrange(4, 2048) for _ in range(rng.randrange(64, 256))], STEADY_OUTPUT, tally)


@dataclass
class Side:
    name: str
    engine: VllmEngine
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    at: dict = field(default_factory=dict)  # checkpoint -> the engine's counters there
    outputs: dict = field(default_factory=dict)
    tally: Tally = field(default_factory=Tally)  # tokens streamed to the clients: the energy double's input
    error: BaseException | None = None


@dataclass
class Lab:
    on: Side
    off: Side
    kvwatt_at_start: dict  # kvwatt's figures before any request (parsed exposition)
    kvwatt_at: dict  # checkpoint -> {server: kvwatt exposition parsed} (each side's own checkpoint)
    kvwatt_end: dict  # after the run, once kvwatt has read the final counters
    status_end: dict  # /api/status then
    engine_at_start: dict  # the ON engine's exposition before any request (parsed)
    energy_gaps: list  # kvwatt's log lines saying an NVML read failed or missed its deadline during the run


def kv(parsed: dict, name: str, **labels) -> float | None:
    want = set(labels.items())
    hits = [v for (n, lab), v in parsed.items() if n == name and want <= lab]
    assert len(hits) <= 1, (name, labels, hits)
    return hits[0] if hits else None


def _start(engines: list[VllmEngine]) -> None:
    """Start the engines side by side (each start is 80-140 s of compile on a loaded 2-core machine)."""
    errors: list[BaseException] = []

    def go(e):
        try:
            e.start(timeout=420)
        except BaseException as exc:  # noqa: BLE001 (re-raised below, with the engine's log tail)
            errors.append(exc)
    threads = [threading.Thread(target=go, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _settled(d: KvwattDaemon, side: Side, counters: dict) -> dict:
    """kvwatt's exposition once it has read counters at least as new as ``counters`` (two ticks later), with
    both engines read at that tick: a read that failed leaves a server "down" for that tick, and a down server's
    window figures are unknown (None), which CI once caught here (the OFF engine's /metrics slower than the
    read's timeout on a loaded machine)."""
    time.sleep(2.2)  # a tick (1 s) has read the engine after ``counters`` were scraped, and one more derived

    def both_read(d):
        m = d.metrics()
        return m if all(kv(m, "kvwatt_source_up", source="vllm", server=s) == 1 for s in ("on", "off")) else None
    return d.wait_for(both_read, timeout=60, what="both engines read at one tick")


def _run(side: Side, d: KvwattDaemon, kvwatt_at: dict, together: threading.Barrier) -> None:
    def in_steady_load():  # no barrier: each side's steady load runs until it has read kvwatt
        time.sleep(STEADY_SECONDS)
        kvwatt_at.setdefault("steady", {})[side.name] = _settled(d, side, {})

    def checkpoint(name):
        time.sleep(1.0)  # the engine's stats reach /metrics at its next step
        side.at[name] = engine_counters(side.engine.url)
        kvwatt_at.setdefault(name, {})[side.name] = _settled(d, side, side.at[name])
        together.wait(timeout=600)  # both engines start the next phase at once
    try:
        side.before = engine_counters(side.engine.url)
        side.outputs = workload(side.engine.url, side.tally, checkpoint, in_steady_load)
        time.sleep(1.0)
        side.after = engine_counters(side.engine.url)
    except BaseException as exc:  # noqa: BLE001 (reported by the tests that read this side)
        side.error = exc
        together.abort()  # the other side does not wait for this one


def _energy_gaps(d: KvwattDaemon) -> list[str]:
    return [line for line in Path(d.log_path).read_text().splitlines()
            if "nvml is down" in line or "nvml is degraded" in line]


def _energy_double(gpus: FakeGpus, sides, stop: threading.Event) -> None:
    """Each GPU's energy counter: the idle 50 W integrated by the NVML double itself at every read
    (counter_follows_power), plus its J per token x the tokens its engine has streamed to the clients, written
    every 20 ms when it changed. The tokens reach the clients a few ms after vLLM counts them, so a 5 s window's
    energy carries that window's tokens (a 5 Hz poll of the engine's /metrics lagged it by 0.2-1 s and more on
    a loaded machine: dE from -0.37 to +0.98 in one window)."""
    per_token = {"on": J_ON, "off": J_OFF}
    written = {s.name: -1 for s in sides}
    while not stop.wait(0.02):
        if all(s.tally.tokens == written[s.name] for s in sides):
            continue
        for s in sides:
            written[s.name] = s.tally.tokens
            gpus.gpu(f"GPU-{s.name}")["energy_mj"] = int(per_token[s.name] * written[s.name] * 1000)
        gpus.write()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload-real")
    model = build_tiny_model()
    # --stream-interval 16: a streamed chunk every 16 tokens, not every token (the API server shares its engine's
    # core; the double's tally lags by at most a chunk, ~20 ms at these speeds)
    common = dict(num_gpu_blocks=BLOCKS, max_model_len=2048,
                  extra_args=["--enable-prefix-caching", "--stream-interval", "16"])
    # each engine's worker on its own core (vLLM CPU binds core 0 unless told): two engines on one core would
    # halve each one's speed whenever both compute, and the pair would compare the core's sharing, not offloading;
    # niced, so that kvwatt and this test still get some of the cores when both engines compute
    on = VllmEngine(model, offload_gib=HOST_POOL_GIB, offload_link="pcie4x16", cpu=0, niceness=10, **common)
    off = VllmEngine(model, cpu=1, niceness=10, **common)
    gpus = FakeGpus(tmp / "gpus.json")
    for uuid in ("GPU-on", "GPU-off"):
        gpus.add(uuid, power_mw=IDLE_WATTS * 1000, energy_mj=0, counter_follows_power=True, t0=time.monotonic())
    try:
        _start([on, off])
        config = str(Path(model) / "config.json")
        servers = {"on": {"url": on.url, "gpus": ["GPU-on"], "pair_off_server": "off", "model_config": config},
                   "off": {"url": off.url, "gpus": ["GPU-off"], "model_config": config}}
        # http_timeout: the engines' /metrics answers within the default 2 s, but not always on a loaded 2-core
        # machine running two engines, this daemon and the energy double; a missed read drops that interval
        settings = {"windows": [WINDOW, STEADY_WINDOW], "min_load_duration": "5s", "state_dir": str(tmp / "state"),
                    "http_timeout": "10s",
                    "idle_power_watts": {"gpu:GPU-on": IDLE_WATTS, "gpu:GPU-off": IDLE_WATTS},
                    # opt-in families (docs/fleet.md "Series budget") these checks read on /metrics
                    "metrics_opt_in": ["kvwatt_cached_prompt_token_share_ratio", "kvwatt_comparison_windows",
                                       "kvwatt_preemption_recompute_tokens_per_second",
                                       "kvwatt_preemption_recompute_watts"]}
        with KvwattDaemon(servers=servers, config=settings, env=gpus.env(), interval=INTERVAL) as d:
            engine_at_start = parse_exposition(requests.get(on.url + "/metrics", timeout=10).text)
            d.wait_for(lambda d: d.value("kvwatt_offload_enabled", server="on") is not None
                       and d.value("kvwatt_offload_enabled", server="off") is not None, timeout=30)
            at_start, kvwatt_at = d.metrics(), {}
            sides = (Side("on", on), Side("off", off))
            stop = threading.Event()
            energy = threading.Thread(target=_energy_double, args=(gpus, sides, stop), daemon=True)
            energy.start()
            together = threading.Barrier(len(sides))
            threads = [threading.Thread(target=_run, args=(s, d, kvwatt_at, together)) for s in sides]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for s in sides:
                if s.error is not None:
                    raise AssertionError(f"workload failed on {s.name}: {s.error!r}\n{s.engine.log_tail()}")
            time.sleep(5.5)  # the last 5 s grid window completes and is read
            end, status = _settled(d, sides[0], sides[0].after), d.status()
            stop.set()
            shutil.copy(d.log_path, tmp / "kvwatt.log")  # kept with pytest's temporary directories
            yield Lab(*sides, at_start, kvwatt_at, end, status, engine_at_start, energy_gaps=_energy_gaps(d))
    finally:
        on.stop()
        off.stop()


def test_an_evicted_prompt_reloads_from_the_host_tier_with_outputs_identical_to_off(lab):
    # to the end of the pressure phase: the steady phase after it ran as many requests as each engine's speed allowed
    on_b, on_a, off_b, off_a = lab.on.before, lab.on.at["pressured"], lab.off.before, lab.off.at["pressured"]
    reloaded = delta(on_a, on_b, "vllm:prompt_tokens_by_source_total{external_kv_transfer}")
    host = delta(on_a, on_b, "vllm:prompt_tokens_cached_by_source_total{host}")
    # the 1,500-token prompt's whole blocks (46 x 32 = 1,472) come back from the host pool; with temperature 0
    # every token of every request equals the OFF engine's, which computed them all again
    assert reloaded >= 46 * 32 and host == reloaded, (reloaded, host)
    assert delta(off_a, off_b, "vllm:prompt_tokens_by_source_total{external_kv_transfer}") == 0
    assert delta(on_a, on_b, "vllm:kv_offload_load_bytes_total") > 0
    assert delta(on_a, on_b, "vllm:kv_offload_store_bytes_total") > 0
    # the sequential requests (the evicted prompt, the others, the reloaded one) are token-identical; the ten
    # concurrent ones under preemption are batched as the two engines' timing falls (bf16 kernels on CPU depend on
    # the batch), so they are compared by length only: each one finished its tokens
    for phase in ("first", "others", "again"):
        assert lab.on.outputs[phase] == lab.off.outputs[phase], phase
    assert [len(o) for o in lab.on.outputs["pressure"]] == [len(o) for o in lab.off.outputs["pressure"]]
    # fewer prompt tokens computed ON than OFF by at least the reloaded prompt
    computed_on = delta(on_a, on_b, "vllm:prompt_tokens_by_source_total{local_compute}")
    computed_off = delta(off_a, off_b, "vllm:prompt_tokens_by_source_total{local_compute}")
    assert computed_off - computed_on >= 46 * 32, (computed_on, computed_off)


def test_preempted_requests_resume_from_the_host_tier(lab):
    """The ten concurrent requests outgrow the 130 blocks: both engines preempt; ON reloads the preempted
    context (kv_offload_load_bytes beyond the evicted prompt's), OFF recomputes it. vLLM 0.32 counts neither in
    prompt_tokens_by_source (first prefills only, vllm/v1/core/sched/scheduler.py)."""
    for side in (lab.on, lab.off):
        assert delta(side.after, side.before, "vllm:num_preemptions_total") >= 1, side.engine.log_tail()
    loaded = delta(lab.on.after, lab.on.before, "vllm:kv_offload_load_bytes_total")
    assert loaded > 46 * BLOCK_BYTES, loaded  # more than the evicted prompt alone


# --- every "offloading on" figure against the engine's own counters ---------------------------------------
def test_offloading_is_on_before_the_first_transfer(lab):
    """vLLM 0.32 puts most kv_offload_* series on the wire only after the first transfer; kvwatt knows the
    server offloads from the start (cache_config_info kv_offloading_size, and the deprecated
    kv_offload_total_* series there at 0), with its buffer size."""
    assert kv(lab.engine_at_start, "vllm:kv_offload_store_bytes_total") is None  # not on the wire yet
    assert kv(lab.engine_at_start, "vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") == 0
    k = lab.kvwatt_at_start
    assert kv(k, "kvwatt_offload_enabled", server="on") == 1 and kv(k, "kvwatt_offload_enabled", server="off") == 0
    assert kv(k, "kvwatt_offload_buffer_bytes", server="on") == HOST_POOL_GIB * 2 ** 30
    # the collapse conditions' "offloading is on" (methods.md s5), ON and OFF, before and after the run
    for m in (k, lab.kvwatt_end):
        assert kv(m, "kvwatt_collapse_condition", server="on", condition="offload_enabled") == 1
        assert kv(m, "kvwatt_collapse_condition", server="off", condition="offload_enabled") == 0


def test_token_source_shares_on_and_off_equal_the_engines_counters(lab):
    """The 10 m window holds the whole run: kvwatt's shares are the engine's own deltas (to 1e-9)."""
    sources = ("local_compute", "local_cache_hit", "external_kv_transfer")
    for side in (lab.on, lab.off):
        counts = {src: delta(side.after, side.before, f"vllm:prompt_tokens_by_source_total{{{src}}}")
                  for src in sources}
        print(f"\n{side.name}: prompt tokens by source {counts}, preemptions "
              f"{delta(side.after, side.before, 'vllm:num_preemptions_total'):.0f}")
        for src in sources:
            got = kv(lab.kvwatt_end, "kvwatt_prompt_token_share_ratio", server=side.name, source=src, window=WINDOW)
            assert got == pytest.approx(counts[src] / sum(counts.values()), abs=1e-9), (side.name, src, counts)
    assert kv(lab.kvwatt_end, "kvwatt_prompt_token_share_ratio", server="on", source="external_kv_transfer",
              window=WINDOW) > 0.01
    assert kv(lab.kvwatt_end, "kvwatt_prompt_token_share_ratio", server="off", source="external_kv_transfer",
              window=WINDOW) == 0
    host = delta(lab.on.after, lab.on.before, "vllm:prompt_tokens_cached_by_source_total{host}")
    cached = sum(delta(lab.on.after, lab.on.before, f"vllm:prompt_tokens_cached_by_source_total{{{t}}}")
                 for t in ("device", "host", "disk", "p2p", "external_unspecified"))
    assert kv(lab.kvwatt_end, "kvwatt_cached_prompt_token_share_ratio", server="on", tier="host",
              window=WINDOW) == pytest.approx(host / cached, abs=1e-9)


def _covered(m: dict, server: str) -> float:
    return kv(m, "kvwatt_window_covered_seconds", server=server, window=WINDOW)


def test_offload_traffic_buffer_residency_and_recommendation_from_the_engines_bytes(lab):
    """Store and load bytes/s x the window's covered seconds = the engine's byte counters (1 %: the window's
    first reading came a tick after the daemon started, before any request); residency = buffer / write rate;
    the recommendation = the busiest window's write rate x p99 tool latency (20 s) x headroom (1.5), the
    defaults."""
    m, covered = lab.kvwatt_end, _covered(lab.kvwatt_end, "on")
    stored = delta(lab.on.after, lab.on.before, "vllm:kv_offload_store_bytes_total")
    loaded = delta(lab.on.after, lab.on.before, "vllm:kv_offload_load_bytes_total")
    write = kv(m, "kvwatt_offload_write_bytes_per_second", server="on", window=WINDOW)
    read = kv(m, "kvwatt_offload_read_bytes_per_second", server="on", window=WINDOW)
    print(f"\nstored {stored:.0f} B, loaded {loaded:.0f} B over {covered:.1f} s: kvwatt {write:.0f} / {read:.0f} B/s, "
          f"residency {kv(m, 'kvwatt_offload_buffer_residency_seconds', server='on', window=WINDOW):.1f} s, "
          f"recommended {kv(m, 'kvwatt_offload_recommended_buffer_bytes', server='on'):.0f} B")
    assert write * covered == pytest.approx(stored, rel=0.01) and read * covered == pytest.approx(loaded, rel=0.01)
    residency = kv(m, "kvwatt_offload_buffer_residency_seconds", server="on", window=WINDOW)
    assert residency == pytest.approx(HOST_POOL_GIB * 2 ** 30 / (stored / covered), rel=0.01)
    # the recommendation sizes for the busiest of kvwatt's windows (model/offload.buffer): the steady phase's
    # STEADY_WINDOW may be busier than the whole run
    busiest = max(stored / covered, kv(m, "kvwatt_offload_write_bytes_per_second", server="on", window=STEADY_WINDOW))
    assert kv(m, "kvwatt_offload_recommended_buffer_bytes", server="on") == pytest.approx(
        busiest * 20.0 * 1.5, rel=0.01)
    assert kv(m, "kvwatt_offload_write_bytes_per_second", server="off", window=WINDOW) is None


def test_the_in_flight_gauge_is_never_read_as_occupancy(lab):
    """vllm:kv_offload_cpu_cache_usage_perc is the share of the pool pinned by transfers in flight (0 here,
    the copies finish at once), not how full it is: kvwatt shows no occupancy for vLLM rather than that."""
    engine = parse_exposition(requests.get(lab.on.engine.url + "/metrics", timeout=10).text)
    assert kv(engine, "vllm:kv_offload_cpu_cache_usage_perc") is not None  # on the wire
    assert kv(lab.kvwatt_end, "kvwatt_offload_buffer_used_ratio", server="on") is None
    assert kv(lab.kvwatt_end, "kvwatt_offload_buffer_used_bytes", server="on") is None


def test_stores_that_nothing_reloaded_read_as_zero_reloads(lab):
    """After six prompts ON has stored every block and reloaded none: kvwatt says reads 0 B/s and kappa 0
    (offloading on, nothing reloaded), not unknown."""
    engine, m = lab.on.at["stored"], lab.kvwatt_at["stored"]["on"]
    assert delta(engine, lab.on.before, "vllm:kv_offload_store_bytes_total") > 0
    assert delta(engine, lab.on.before, "vllm:kv_offload_load_bytes_total") == 0
    assert kv(m, "kvwatt_offload_write_bytes_per_second", server="on", window=WINDOW) > 0
    assert kv(m, "kvwatt_offload_read_bytes_per_second", server="on", window=WINDOW) == 0
    assert kv(m, "kvwatt_cached_to_prefill_ratio", server="on", window=WINDOW) == 0
    assert kv(m, "kvwatt_prompt_token_share_ratio", server="on", source="external_kv_transfer", window=WINDOW) == 0


# --- energy, from the NVML double ----------------------------------------------------------------------
def test_paired_saving_on_a_real_on_off_pair(lab):
    """ON and OFF serve the same steady load side by side; kvwatt pairs the 5 s grid windows in which both
    generated tokens. The double prices a generated token at 0.6 J on ON and 0.8 J on OFF over the same idle
    (integrated exactly by the double), so every window's marginal J/token is that price up to the few ms between
    vLLM counting a token and the client receiving it (and kvwatt reading the engine a few ms after NVML), and
    dE = 1 - 0.6/0.8 = 0.25 whatever the engines' speeds. Read over STEADY_WINDOW while the load still runs: a
    window in which generation stops holds a few tokens against that lag's energy (one with 317 tokens read
    0.99 J for 0.8 here), so the phases' ends stay out. Tolerance: 3 of kvwatt's own standard errors (the spread
    of the per-window J/token), at least 0.03."""
    for side in (lab.on, lab.off):  # the double's input is the engine's own count of generated tokens
        assert side.tally.tokens == delta(side.after, side.before, "vllm:generation_tokens_total"), side.name
    m = lab.kvwatt_at["steady"]["on"]
    de = kv(m, "kvwatt_energy_saving_ratio", server="on", baseline="paired", window=STEADY_WINDOW)
    se = kv(m, "kvwatt_energy_saving_stderr_ratio", server="on", baseline="paired", window=STEADY_WINDOW)
    n = kv(m, "kvwatt_comparison_windows", server="on", baseline="paired", window=STEADY_WINDOW)
    gain = kv(m, "kvwatt_throughput_gain_ratio", server="on", baseline="paired", window=STEADY_WINDOW)
    whole = kv(lab.kvwatt_end, "kvwatt_energy_saving_ratio", server="on", baseline="paired", window=WINDOW)
    print(f"\npaired dE {de} +/- {se} over {n} windows of the steady phase (double: {1 - J_ON / J_OFF:+.3f}); "
          f"dTPS {gain}; over the whole run {whole}")
    assert n is not None and n >= 4 and se is not None, (de, se, n)
    assert de == pytest.approx(1 - J_ON / J_OFF, abs=max(0.03, 3 * se)), (de, se, n)
    assert kv(m, "kvwatt_energy_saving_ratio", server="off", baseline="paired", window=STEADY_WINDOW) is None


def test_the_per_phase_price_of_a_reloaded_token(lab):
    """Before the per-phase regression has its windows the costs are the prior (methods.md s12): a reloaded
    token costs load_to_compute_cost_ratio (0.1) x a computed one, a computed one PRIOR_PROMPT_TO_GENERATED_COST_RATIO
    (0.2) x a generated one; the offloading saving in W is the reloaded tokens/s x (J computed - J reloaded)."""
    m = lab.kvwatt_end
    cost = {p: kv(m, "kvwatt_phase_joules_per_token", server="on", scope="gpu", phase=p)
            for p in ("prompt_computed", "generated", "reloaded")}
    assert cost["reloaded"] == pytest.approx(0.1 * cost["prompt_computed"], rel=1e-9), cost
    assert cost["prompt_computed"] == pytest.approx(PRIOR_PROMPT_TO_GENERATED_COST_RATIO * cost["generated"],
                                                    rel=1e-9)
    reloaded = delta(lab.on.after, lab.on.before, "vllm:prompt_tokens_by_source_total{external_kv_transfer}")
    saved = kv(m, "kvwatt_offload_saved_watts", server="on", scope="gpu", window=WINDOW)
    # 25 %: kvwatt prices over the intervals whose energy is known and plausible (derive/energy.py
    # tax_in_energy), and with this double some are not: an NVML read that missed its deadline (the daemon's log
    # says so), or a short interval that got one of the double's 5 Hz steps of token energy and so read above
    # kvwatt's 3 kW glitch limit for one GPU; the reloaded-token rate over the rest differed from the whole
    # window's by 1.2-12 % in seven runs on the two cores. Still caught: no saving, a saving priced at a generated
    # token's cost (5x) or over all prompt tokens (~10x here); the 0.9 itself is checked exactly in
    # tests/test_phase_energy.py
    assert saved == pytest.approx(reloaded / _covered(m, "on") * 0.9 * cost["prompt_computed"], rel=0.25), \
        lab.energy_gaps


# --- the recomputation after preemption, which no token counter shows (methods.md s4) ----------------
def recomputed(after: dict, before: dict) -> tuple[float, float]:
    """(recomputed, scheduled) tokens from the engine's own counters: vLLM's write-traffic estimate over the tiny
    model's 5,632 bytes per scheduled token and 4,096 per logits row (its config.json, vLLM's perf.py)."""
    writes = delta(after, before, "vllm:estimated_write_bytes_per_gpu_total")
    generated = delta(after, before, "vllm:generation_tokens_total")
    computed = delta(after, before, "vllm:prompt_tokens_by_source_total{local_compute}")
    scheduled = (writes - 4096 * generated) / 5632
    return scheduled - computed - generated, scheduled


def test_without_preemption_the_token_identity_holds(lab):
    """Until the pressure phase neither engine preempted: every scheduled token is a first prefill or a generated
    one, to 0.5 % (a logits row the estimate bills per chunked-prefill step), and kvwatt says ~0."""
    for side in (lab.on, lab.off):
        at = side.at["reloaded"]
        assert delta(at, side.before, "vllm:num_preemptions_total") == 0
        again, scheduled = recomputed(at, side.before)
        assert abs(again) <= 0.005 * scheduled, (side.name, again, scheduled)
        share = kv(lab.kvwatt_at["reloaded"][side.name], "kvwatt_preemption_recompute_share_ratio",
                   server=side.name, window=WINDOW)
        assert share is not None and share <= 0.005


def test_the_recomputation_after_preemption_is_measured_on_and_off(lab):
    """The pressure phase preempts both: OFF computes the preempted context again, which kvwatt measures from
    the write-traffic estimate (the tax's counter does not move); ON reloads most of it from the host tier, so
    it recomputes less. kvwatt's share equals the one from the engine's counters (0.002 absolute: kvwatt's
    window started a tick before the run)."""
    got = {}
    for side in (lab.on, lab.off):
        again, scheduled = recomputed(side.after, side.before)
        share = kv(lab.kvwatt_end, "kvwatt_preemption_recompute_share_ratio", server=side.name, window=WINDOW)
        assert share == pytest.approx(max(again, 0) / scheduled, abs=0.002), (side.name, again, scheduled)
        rate = kv(lab.kvwatt_end, "kvwatt_preemption_recompute_tokens_per_second", server=side.name, window=WINDOW)
        assert rate * _covered(lab.kvwatt_end, side.name) == pytest.approx(max(again, 0), rel=0.02, abs=5)
        # ON against OFF to the end of the pressure phase: the steady phase after it ran as many requests as each
        # engine's speed allowed (no preemption in it, but the identity's 0.5 % slack grows with its tokens)
        got[side.name] = recomputed(side.at["pressured"], side.before)[0]
    status = {s["server"]: s["windows"][WINDOW]["preemption_recompute"] for s in lab.status_end["servers"]}
    print(f"\nrecomputed after preemption: {got}; kvwatt: {status}")
    assert got["off"] > 32, got  # at least a block of context computed again
    assert got["on"] < got["off"], got
    assert status["off"]["state"] == "known" or status["off"]["state"] == "provisional", status
    # its power with the per-phase price: recomputed tokens/s x J per computed prompt token, that price capped at
    # what the window's own energy allows (methods.md s4, s12: as the tax), so never above it
    j_c = kv(lab.kvwatt_end, "kvwatt_phase_joules_per_token", server="off", scope="gpu", phase="prompt_computed")
    watts = kv(lab.kvwatt_end, "kvwatt_preemption_recompute_watts", server="off", scope="gpu", window=WINDOW)
    priced = kv(lab.kvwatt_end, "kvwatt_preemption_recompute_tokens_per_second", server="off", window=WINDOW) * j_c
    assert watts == pytest.approx(priced, rel=1e-9) or 0 <= watts < priced, (watts, priced)
