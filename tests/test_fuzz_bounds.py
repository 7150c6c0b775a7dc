"""Property-based: generated engine sequences (tests/support/fuzz_engine.py: counters that reset, jump, go back and
stall, two processes behind one URL, start times that move, energy missing, token mixes that shift, offloading on
and off, NaN/Inf/negative KV usage) through the real vLLM adapter and the real Model. After every tick, every
family of the served snapshot is within its declared bound (exporter/catalog/bounds.py), and the check rejects nothing
that an implausible input does not explain (fuzz_engine.EXPLAINS: tokens/s after a start time moved forward, a
second process or a counter jump; J/token < 0 after a stale P_idle): every other rejection is a figure the model
derived wrongly. Every declared relation between figures (bounds.RELATIONS) holds on what is served, no figure
computed from counts shown implausible (bounds.DEPENDENCIES) is served, and no implausible window enters the
per-phase history (a one-off 3e8 jump of the generation counter is one of the events). bench/fuzz_bounds.py runs
>= 10,000 such sequences."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings

from exporter import catalog
from tests.support import fuzz_engine
from tests.support.fuzz_engine import Step

EXAMPLES = 200  # x up to 30 ticks: ~10 s of CPU (46 ms a sequence measured), under 30 s on the 2-core machine


def _run(seq):
    with tempfile.TemporaryDirectory(prefix="kvwatt-fuzz-") as tmp:
        return fuzz_engine.run(seq, Path(tmp))


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(fuzz_engine.sequences)
def test_every_served_figure_is_within_its_declared_bound(seq):
    out = _run(seq)
    assert not out.served, out.served[:5]
    assert not fuzz_engine.own_rejections(out), fuzz_engine.own_rejections(out)


def test_a_start_time_in_the_future_is_neither_counted_whole_nor_served():
    """A start time that moves into the future without the counters going down is the same process
    (store/identity.py): no counter is counted whole, so no generated tokens/s beyond any engine is served, nor
    needs the check to reject it (before that fix the check rejected a token_rate it caused)."""
    base = Step("normal", 100.0, 1000.0, 0.5, 0.0, 300.0, True, 0.5, 0.0)
    served_before = Step("jump", 100.0, 1000.0, 0.5, 0.0, 300.0, True, 0.5, 0.0)  # the first read: 1e7 tokens
    seq = [served_before, base, base, Step("start_future", 100.0, 1000.0, 0.5, 0.0, 300.0, True, 0.5, 0.0), base]
    out = _run(seq)
    assert not out.served
    assert not [r for r in out.rejected if r[1] == "token_rate"], out.rejected


def test_shrunk_a_prompt_token_after_idle_ticks_is_not_taxed_beyond_the_power():
    """Hypothesis' shrunk case on the pricing before the fix (methods.md s12): three ticks at 0 W (below P_idle),
    then one computed prompt token at 121 W; kvwatt_recompute_tax_watts exceeded the window's marginal power."""
    idle = Step("normal", 0.0, 0.0, 0.0, 0.0, 0.0, True, 0.0, 0.0)
    seq = [idle, idle, idle, Step("normal", 0.0, 1.0, 1.0, 0.0, 121.0, True, 0.0, 0.0)]
    out = _run(seq)
    assert not out.served and not fuzz_engine.own_rejections(out), out.rejected


def test_a_failing_bystander_degrades_itself_only():
    """Issue 38 item 1 in the fuzzer: the bystander q's derivation, then its learning, raise; s keeps its figures
    and the snapshot its time (fuzz_engine.isolation_broken), q says derivation_failed. Without the per-server
    isolation (Model._isolated) the snapshot raises: the sequence fails, it does not pass quietly."""
    base = Step("normal", 100.0, 1000.0, 0.5, 0.0, 300.0, True, 0.5, 0.0)
    seq = [base, base, Step("derive_fail", 100.0, 1000.0, 0.5, 0.0, 300.0, True, 0.5, 0.0), base,
           Step("learn_fail", 100.0, 1000.0, 0.5, 0.0, 300.0, True, 0.5, 0.0), base]
    out = _run(seq)
    assert out.ticks == len(seq) and not out.served, out.served
    assert fuzz_engine.isolation_broken(_FakeSnap(0.0, "", ""), 1.0, "figures") == [
        "snapshot of t=0.0, not this tick's 1.0", "q's failing figures not said: ''"]


class _FakeSnap:
    """The three fields isolation_broken reads, to show it reports what it should."""

    def __init__(self, t, s_reason, q_reason):
        from types import SimpleNamespace as NS
        self.t = t
        self.servers = (NS(name="s", status=NS(reason=s_reason)), NS(name="q", status=NS(reason=q_reason)))


def test_a_gpu_at_exactly_its_idle_power_gives_no_negative_marginal_j_per_token():
    """The 10,000-sequence run's 24 unexplained rejections (seed 20261129): a GPU drawing exactly its P_idle (60 W)
    for ticks on end sums E and P_idle x dt that differ in their last bits, and marginal J/token read -1.1e-20,
    rejected as if P_idle were stale. The difference is rounding: 0 (derive/marginal.py above_idle)."""
    seq = [Step("normal", 1.1125369292536007e-308, 4681.3710440320665, 0.38179525711193907, 1e-300,
                951.0716624486096, True, 1.7, 0.0),
           Step("normal", 2371.3004184005563, 1679.3711539351366, 0.18724349751923589, 0.3031417726715407, 60.0,
                True, float("nan"), 0.0),
           Step("jump", 1.1754943508222875e-38, 28527.320812169346, 0.5717355599580353, 1.1754943508222875e-38,
                60.0, True, 0.92, 0.0)]
    out = _run(seq)
    assert not fuzz_engine.own_rejections(out), out.rejected


def test_the_generated_sequences_serve_every_tier_family():
    """The generator reaches vLLM's tiering (cached tokens by tier, kv_offload_tiering_* by tier, back-pressure
    drops, failed promotions and cascades) on a server with a configured fs tier: every per-tier family
    (fuzz_engine.TIER_FAMILIES) is served, so the bounds and relations above hold on them too. Before the generator
    counted them, none was served: the tier figures went unchecked."""
    seen: set[str] = set()

    @settings(max_examples=40, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(fuzz_engine.sequences)
    def one(seq):
        seen.update(_run(seq).covered)

    one()
    assert fuzz_engine.TIER_FAMILIES <= {m.name for m in catalog.METRICS}  # the list names real families
    assert not fuzz_engine.TIER_FAMILIES - seen, sorted(fuzz_engine.TIER_FAMILIES - seen)


def test_a_disk_dearer_than_a_recompute_is_served_within_its_bounds():
    """A sequence priced with the dearest disk (fuzz_engine.DISK_JOULES_PER_BYTE by the sequence's length): the
    fs tier's break-even ratio above 1 and its net saving below 0 are served, inside their bounds and relations."""
    on = Step("offload_toggle", 100.0, 1000.0, 0.3, 0.8, 300.0, True, 0.5, 0.0, 1.0, 1.0)
    base = Step("normal", 100.0, 1000.0, 0.3, 0.8, 300.0, True, 0.5, 0.0, 0.5, 1.0)
    seq = [on] + [base] * (11 + fuzz_engine.DISK_JOULES_PER_BYTE.index(max(fuzz_engine.DISK_JOULES_PER_BYTE)))
    out = _run(seq)
    assert not out.served and not fuzz_engine.own_rejections(out), (out.served[:5], out.rejected)
    assert fuzz_engine.TIER_FAMILIES <= out.covered, sorted(fuzz_engine.TIER_FAMILIES - out.covered)
    disk = {dict(labels)["tier"]: v for labels, v in _fill(out.snapshot, "kvwatt_offload_tier_breakeven_ratio")}
    saved = {dict(labels)["tier"]: v for labels, v in _fill(out.snapshot, "kvwatt_offload_tier_saved_watts")}
    assert disk["disk"] > 1 > disk["host"] and saved["disk"] < 0 < saved["host"], (disk, saved)


def _fill(snap, name):
    """The 5 s window's (labels, value) of one family."""
    d = catalog.BY_NAME[name]
    rows = [(dict(zip(d.labels, labels)), v) for labels, v in d.fill(snap)]
    return [(labels, v) for labels, v in rows if labels["window"] == "5s"]
