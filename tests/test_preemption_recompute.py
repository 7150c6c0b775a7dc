"""The recomputation after preemption (methods.md s4): vLLM's write-traffic estimate counts every scheduled
token, its token counters only first prefills and generated tokens; the difference is what a preempted request
computed again. The real engine's numbers are tests/test_offload_real_engine.py; here the arithmetic, the
states and the unknowns, on hand-built intervals and on the real 0.32 CPU capture."""

from __future__ import annotations

import pytest

from exporter.derive.phase_energy import PhaseCosts
from exporter.derive.recompute import PreemptionRecompute, preemption_recompute, preemption_recompute_watts
from exporter.samples import Interval
from exporter.sources import model_config
from exporter.sources.expfmt import parse
from exporter.sources.vllm import extract
from tests.conftest import FIXTURES
from tests.support.aggregates import aggregate_of

A, B = 5632.0, 4096.0  # the tiny Llama: bytes per scheduled token, per logits row (its config.json)


def window(computed, generated, recomputed, seconds=60.0, writes=None, **extra):
    scheduled = computed + generated + recomputed
    deltas = {"prompt_local_compute": computed, "generation_tokens": generated,
              "engine_write_bytes": A * scheduled + B * generated if writes is None else writes, **extra}
    return aggregate_of([Interval(t0=0.0, t1=seconds, deltas=deltas, gauges={})])


def test_the_tiny_models_coefficients_are_vllms_write_model():
    p = model_config.load_hf_config(str(FIXTURES / "model" / "config.json"))
    # per layer: q,k,v (4+2x2) x 32 x 2 + KV cache 2x2x32x2 + o 128x2 + MLP (3x256 + 128) x 2; LM head 2048 x 2
    assert (p.engine_write_bytes_per_token, p.engine_write_bytes_per_logits_token) == (A, B)


def test_moe_and_configured_shapes_are_not_modelled():
    moe = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
           "vocab_size": 100, "num_local_experts": 8, "num_experts_per_tok": 2}
    assert model_config.engine_write_bytes(moe, 2.0) == (None, None)
    p = model_config.model_params(str(FIXTURES / "model" / "config.json"), {"layers": 4})
    assert p.engine_write_bytes_per_token is None


def test_recomputed_tokens_and_share():
    r = preemption_recompute(window(6000, 3000, 1000), A, B, 60.0)
    assert r.state == "known" and r.reason == ""
    assert r.tokens_per_second == pytest.approx(1000 / 60) and r.share == pytest.approx(0.1)
    assert r.scheduled_tokens_per_second == pytest.approx(10000 / 60) and r.residual_share == pytest.approx(0.1)


def test_no_preemption_leaves_the_identity_residual_and_clips_at_zero():
    r = preemption_recompute(window(6000, 3000, 0, writes=A * 8990 + B * 3000), A, B, 60.0)
    assert r.tokens_per_second == 0 and r.share == 0 and r.residual_share == pytest.approx(-10 / 8990)


def test_a_window_less_covered_is_provisional():
    r = preemption_recompute(window(600, 300, 100, seconds=20.0), A, B, 60.0)
    assert r.state == "provisional" and "33% covered" in r.reason and r.share == pytest.approx(0.1)


@pytest.mark.parametrize("agg, a, why", [
    (aggregate_of([Interval(t0=0, t1=60, deltas={"prompt_local_compute": 5, "generation_tokens": 5}, gauges={})]), A,
     "exports no write-traffic estimate"),
    (window(100, 100, 0, writes=0.0), A, "--enable-mfu-metrics"),
    (aggregate_of([Interval(t0=0, t1=60, deltas={"engine_write_bytes": 1e6, "generation_tokens": 5}, gauges={})]), A,
     "prompt tokens by source"),
    (window(100, 100, 10), None, "config.json"),
])
def test_unknown_says_why(agg, a, why):
    r = preemption_recompute(agg, a, B, 60.0)
    assert r.state == "unknown" and why in r.reason and r.tokens_per_second is None and r.share is None


def test_its_power_is_priced_as_a_computed_prompt_token():
    r = preemption_recompute(window(6000, 3000, 600), A, B, 60.0)
    costs = PhaseCosts(scope="gpu", prompt_computed_j=0.02, prompt_computed_se=None, generated_j=0.05,
                       generated_se=None, reloaded_j=0.002, reloaded_se=None, windows=30, state="known", reason="",
                       source="measured")
    assert preemption_recompute_watts(r, costs) == pytest.approx(10 * 0.02)
    assert preemption_recompute_watts(preemption_recompute(window(1, 1, 0), None, B, 60.0), costs) is None


def test_the_real_low_pressure_capture_satisfies_the_identity():
    """The real 0.32 CPU engine, no preemption: 20,241 tokens scheduled by the write estimate against 8,280
    computed + 12,000 generated (-0.19 %)."""
    first, last = (extract(parse(p.read_text())).counters for p in
                   (FIXTURES / "idle" / "000.prom", sorted((FIXTURES / "low-pressure").glob("*.prom"))[-1]))
    deltas = {k: last[k] - first.get(k, 0.0) for k in ("engine_write_bytes", "generation_tokens",
                                                       "prompt_local_compute")}
    r = preemption_recompute(aggregate_of([Interval(t0=0, t1=60, deltas=deltas, gauges={})]), A, B, 60.0)
    assert r.share == 0 and r.residual_share == pytest.approx(-0.0019, abs=0.0002)


def test_the_figure_takes_its_write_models_state():
    """The write model's check on windows without preemption (derive/write_model.py, tests/test_write_model_fit.py)
    decides the figure's state: provisional while not checked, unknown when its check failed, with the reason."""
    from exporter.derive.recompute import WriteModel, judged
    busy = preemption_recompute(window(6000, 3000, 1000), A, B, 60.0)
    unchecked = WriteModel(bytes_per_token=A, bytes_per_logits_token=B, source="config.json", state="provisional",
                           reason="the write model is not yet checked on windows without preemption")
    assert judged(busy, unchecked).state == "provisional" and "not yet checked" in judged(busy, unchecked).reason
    assert judged(busy, unchecked).share == busy.share and judged(busy, unchecked).write_model is unchecked
    known = WriteModel(bytes_per_token=A, bytes_per_logits_token=B, source="fitted", state="known")
    assert judged(busy, known) == busy.__class__(**{**busy.__dict__, "write_model": known})
    # tensor parallel 2: the per-GPU estimate halves the heads; config.json's model fails, no fit yet
    wrong = judged(busy, WriteModel(state="unknown", reason="config.json's write model ... leaves 95.0%"))
    assert wrong.state == "unknown" and wrong.share is None and "95.0%" in wrong.reason


def test_a_handful_of_scheduled_tokens_gives_no_figure():
    """The demo's engine, stopped with requests in flight, wrote 7 tokens' worth (38,912 B) its counters never saw
    (the requests were aborted): before, "100 % recomputed after preemption", known, for a window of nothing (and
    its power, on the idle GPU, above the window's marginal power: rejected by the bounds)."""
    r = preemption_recompute(window(0, 0, 0, seconds=30.0, writes=38912.0), 5629.0, 3869.0, 30.0)
    assert r.state == "unknown" and "only 7 tokens scheduled" in r.reason
    assert r.share is None and r.tokens_per_second is None


def test_its_power_is_priced_within_the_windows_own_energy():
    """As the tax (methods.md s12): the recomputed tokens are computed prompt tokens beside the counted ones, so
    their price is capped at what the window's marginal energy allows for all of them (a GPU double that charges
    no re-prefill, as the demo's, or costs learned where no recomputation showed, would price it above)."""
    from exporter.derive.energy import priced_with_recomputation
    costs = PhaseCosts(scope="gpu", prompt_computed_j=0.05, prompt_computed_se=None, generated_j=0.3, generated_se=None,
                       reloaded_j=None, reloaded_se=None, windows=30, state="known", reason="", source="measured")
    deltas = {"prompt_local_compute": 600.0, "generation_tokens": 100.0, "engine_write_bytes": 1.0}
    iv = Interval(t0=0.0, t1=10.0, deltas=deltas, gauges={}, energy_joules={"gpu": 700.0 + 40.0},
                  idle_joules={"gpu": 700.0})
    agg = aggregate_of([iv])  # marginal 40 J over 10 s: 4 W; 600 counted + 900 recomputed prompt tokens
    again = PreemptionRecompute(tokens_per_second=90.0, state="known")
    assert preemption_recompute_watts(again, costs) == pytest.approx(4.5)  # 90 x 0.05: above the 4 W
    watts = preemption_recompute_watts(again, priced_with_recomputation(agg, costs, 90.0))
    assert watts == pytest.approx(90.0 * 40.0 / 1500.0) and watts <= 4.0
    assert priced_with_recomputation(agg, costs, 0.0) == costs  # 0.05 x 600 = 30 J <= 40 J: the price as learned
