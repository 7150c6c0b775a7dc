"""The report's figures (matplotlib, Agg, no pyplot state: the same data give the same PNG).

- savings_vs_kv_p95.png: dE% of each ON condition (mean ± SE over runs, n stated) at its OFF baseline's KV p95
  (± SE), the individual runs as points, the located threshold as a band (the study's Figure 2).
- energy_throughput_bars.png: J/token and tokens/s per condition, each ON bar next to its OFF bar.
- frontier.png: J/token against tokens/s per condition, ON and OFF of a pair connected (the study's Figure 3).
- mechanism.png: preemptions per minute and the local_compute share against the OFF KV p95 (methods.md s4,
  the study's Table 2 as a plot).
- buffer_size.png: dE% of ON at several buffer sizes against one OFF, with the residency rule's verdict and
  the measured plateau (methods.md s6, the study's s4.2).

A figure with nothing to show (no ON/OFF pair for the savings, no buffer sweep) is not drawn; the report says
why. Artists carry a ``gid`` (``means``, ``runs``, ``bars-on`` ...) so tests can count what was plotted.

Rules every figure keeps (tests/test_experiment_figures.py inspects the Figure objects): no panel without data
(a quantity that is zero in every run is one line of words in the title instead), no legend entry for a kind
of condition that is absent, y limits that hold every plotted value without dwarfing its range, the threshold
interval as a band only where it is narrower than half the data's x range (else a line, the interval in the
legend), per-run crosses drawn over the means and in the legend, preemptions per minute (the daemon's unit),
run counts in words ("3 of 3 runs"), and "synthetic data" in the titles when the runs are marked synthetic.
"""

from __future__ import annotations

import io
import os
import sys
from typing import Callable

from exporter.config import ConfigError
from exporter.runtime import atomic

REQUIREMENT = "matplotlib>=3.8,<4"
OFF_COLOR, ON_COLOR, PAY_COLOR, NOISE_COLOR, BAND_COLOR = "#6b6b6b", "#1f6fb4", "#1f6fb4", "#9a9a9a", "#d62728"
RUN_COLOR = "#1a1a1a"      # per-run crosses: dark, drawn over the means
STYLE = {"font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8,
         "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.25,
         "savefig.dpi": 150, "svg.hashsalt": "kvwatt"}


class MissingDependency(ConfigError):
    """What the report needs is not installed: one line with the command that installs it (exit 2)."""


def install_hint() -> str:
    return (f"the experiment report needs matplotlib, which is not installed in {sys.executable}; install it "
            f"with: {sys.executable} -m pip install '{REQUIREMENT}'")


def require() -> None:
    """MissingDependency unless matplotlib imports (call before anything long runs)."""
    _figure_class()


def _figure_class():
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingDependency(install_hint()) from None
    return Figure


# ------------------------------------------------------------------------------------------------------
# data helpers
# ------------------------------------------------------------------------------------------------------
def _ms(summary: dict | None, key: str, scale: float = 1.0) -> tuple[float | None, float]:
    s = (summary or {}).get(key) or {}
    mean, se = s.get("mean"), s.get("se")
    return (None if mean is None else mean * scale), (se or 0.0) * scale


def _by_name(model: dict) -> dict[str, dict]:
    return {s["condition"]: s for s in model["conditions"]}


def _runs(model: dict, condition: str, key: str, scale: float = 1.0) -> list[float]:
    return [r[key] * scale for r in model["runs"] if r["condition"] == condition and r.get(key) is not None]


def _groups(model: dict) -> list[tuple[dict, list[dict]]]:
    """(OFF condition, its ON conditions) in plan order; an ON whose baseline is missing stands alone."""
    by_name = _by_name(model)
    out = []
    for s in model["conditions"]:
        if not s.get("baseline"):
            out.append((s, [o for o in model["conditions"] if o.get("baseline") == s["condition"]]))
    return out + [(s, []) for s in model["conditions"] if s.get("baseline") and s["baseline"] not in by_name]


def _energy_label(model: dict) -> str:
    scopes = sorted({s["energy_scope"] for s in model["conditions"] if s.get("energy_scope")})
    double = ", power double" if model.get("power_double") else ""
    # two lines: on one, the label outran a 4-inch panel's height (clipped in the bars figure)
    return f"J per generated token\n({model['energy_basis']}, {'/'.join(scopes) or 'no energy data'}{double})"


BAND_MAX_FRACTION = 0.5   # a threshold interval wider than this share of the data's x range is no band: it
                          # would cover most of the axis and inform nothing; a line at the estimate instead


def _band_informs(located: dict | None, xs: list[float]) -> bool:
    """Whether the located threshold's interval is narrow enough against the data's x range to be drawn."""
    if not located or len(xs) < 2 or max(xs) == min(xs):
        return False
    return (located["high"] - located["low"]) * 100 < BAND_MAX_FRACTION * (max(xs) - min(xs))


def _threshold_band(ax, located: dict | None, configured: float, xs: list[float], label: bool = True) -> None:
    """The located threshold as a band over its interval (its width stated) when the band informs, else a line
    at the estimate with the interval in the legend text; the configured threshold dashed when none is located."""
    if located:
        ratio, low, high = located["ratio"] * 100, located["low"] * 100, located["high"] * 100
        interval = f"interval {low:.1f}–{high:.1f} %"
        if _band_informs(located, xs):
            ax.axvspan(low, high, color=BAND_COLOR, alpha=0.12, lw=0, gid="threshold-band",
                       label=(f"located threshold {ratio:.1f} % (band: its {interval}, {high - low:.1f} points wide)"
                              if label else None))
            ax.axvline(ratio, color=BAND_COLOR, lw=1.2, gid="threshold")
        else:
            ax.axvline(ratio, color=BAND_COLOR, lw=1.2, gid="threshold",
                       label=(f"located threshold {ratio:.1f} % ({interval}, {high - low:.1f} points: too wide "
                              "for a band)" if label else None))
    else:
        ax.axvline(configured * 100, color=BAND_COLOR, lw=1, ls="--", gid="threshold",
                   label=f"configured threshold {configured * 100:.0f} % (none located)" if label else None)


def _xlim(ax, xs: list[float], located: dict | None, configured: float, right: float = 0.08,
          band: bool = True) -> None:
    """The axis range where the data (``xs``: points and their error bars' ends) and the threshold (its band,
    or its line when no band is drawn) are, with a margin (``right``: room for labels), at least 10 points of
    KV p95 wide."""
    if located:
        pts = list(xs) + ([located["low"] * 100, located["high"] * 100] if band else [located["ratio"] * 100])
    else:
        pts = list(xs) + [configured * 100]
    if not pts:
        return
    lo, hi = min(pts), max(pts)
    if hi - lo < 10.0:
        lo, hi = (lo + hi) / 2 - 5.0, (lo + hi) / 2 + 5.0
    span = hi - lo
    ax.set_xlim(max(lo - span * 0.06, 0.0), min(hi + span * right, 110.0))


def _ylim(ax, ys: list[float], margin: float = 0.08) -> None:
    """The y range of every plotted value (means, error-bar ends, runs) with a margin on both sides, so a
    point at zero is drawn whole above the axis instead of clipped on it."""
    lo, hi = min(ys), max(ys)
    span = hi - lo or max(abs(hi), 1.0) * 0.5
    ax.set_ylim(lo - span * margin, hi + span * margin)


def _runs_words(n: int | None, repeats: int | None) -> str:
    """'3 of 3 runs' (of the plan's repeats) rather than 'n=3'."""
    return f"{n} of {repeats} runs" if repeats else f"{n} run{'s' if n != 1 else ''}"


def _pair_words(n_on: int, n_off: int, repeats: int | None) -> str:
    if n_on == n_off:
        return _runs_words(n_on, repeats) + " each"
    return f"ON {_runs_words(n_on, repeats)},\nOFF {_runs_words(n_off, repeats)}"


def _label_points(ax, labels: list[tuple[float, float, str]], above: bool = False) -> None:
    """Condition labels beside their points; points sharing an x alternate right and left, so they do not
    print over each other."""
    seen: dict[float, int] = {}
    for x, y, text in sorted(labels, key=lambda t: (t[0], -t[1])):
        i = seen[x] = seen.get(x, -1) + 1
        right = i % 2 == 0
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(6 if right else -6, 5 if above else 2),
                    fontsize=7, color="#333333", ha="left" if right else "right",
                    va="bottom" if above else "center")   # above: clear of a wide x error bar


# ------------------------------------------------------------------------------------------------------
# (a) dE % against the OFF KV p95
# ------------------------------------------------------------------------------------------------------
def _savings(fig, model: dict) -> bool:
    by_name, analysis = _by_name(model), model["analysis"]
    located = analysis["threshold"]["located"]
    pays = {p["condition"]: p["pays"] for p in analysis["threshold"]["pairs"]}
    ax = fig.subplots()
    xs = []
    series: dict[str, tuple[list, list]] = {"pays": ([], []), "noise": ([], []), "unknown": ([], [])}
    run_x, run_y, labels, extent = [], [], [], []
    for s in model["conditions"]:
        c, off = s.get("comparison") or {}, by_name.get(s.get("baseline") or "")
        x, xerr = _ms(off, "kv_usage_p95_ratio", 100)
        if x is None or c.get("dE_percent") is None:
            continue
        kind = {True: "pays", False: "noise"}.get(pays.get(s["condition"]), "unknown")
        ax.errorbar([x], [c["dE_percent"]], yerr=[c["dE_se_percent"] or 0], xerr=[xerr], fmt="none",
                    ecolor="#444444", elinewidth=1, capsize=3, zorder=2)
        series[kind][0].append(x)
        series[kind][1].append(c["dE_percent"])
        runs = c.get("dE_runs_percent") or []
        run_x += [x] * len(runs)
        run_y += runs
        xs.append(x)
        extent += [x - xerr, x + xerr]
        pairs = _pair_words(c['n_on'], c['n_off'], model.get('repeats'))
        labels.append((x, c["dE_percent"], f"{s['condition']}\n{pairs}"))
    if not xs:
        return False
    _label_points(ax, labels)
    band = _band_informs(located, xs)
    _threshold_band(ax, located, model["kv_pressure_threshold"], xs)
    ax.axhline(0, color="black", lw=0.8, gid="zero")
    if run_x:   # above the means (zorder), so a run under a filled circle stays visible
        ax.scatter(run_x, run_y, s=14, marker="x", color=RUN_COLOR, lw=0.9, zorder=5, gid="runs",
                   label="individual runs (each ON run vs the OFF mean)")
    styles = {"pays": (PAY_COLOR, PAY_COLOR, f"mean ± SE, significant saving (dE > {model['analysis']['z']:g} SE)"),
              "noise": ("white", NOISE_COLOR, "mean ± SE, within noise"),
              "unknown": ("white", "black", "mean (SE n/a: one run on a side)")}
    means = 0
    for kind, (mx, my) in series.items():
        face, edge, label = styles[kind]
        if mx:
            ax.scatter(mx, my, s=42, facecolor=face, edgecolor=edge if kind != "noise" else "#333333",
                       lw=1.2, zorder=4, gid="means", label=label)
            means += len(mx)
    _xlim(ax, extent, located, model["kv_pressure_threshold"], right=0.16, band=band)
    ax.set_xlabel("KV-cache usage p95 of the OFF condition (%)")
    ax.set_ylabel("dE (%)  (positive = offloading saves energy)")
    ax.set_title(f"Energy saving of offloading against KV pressure ({means} ON/OFF pair{'s' if means != 1 else ''})")
    fig.legend(loc="outside lower center", ncols=1, frameon=False)
    return True


# ------------------------------------------------------------------------------------------------------
# (b) J/token and tokens/s, ON next to its OFF
# ------------------------------------------------------------------------------------------------------
def _by_off_kv(groups: list[tuple[dict, list[dict]]]) -> list[tuple[dict, list[dict]]]:
    """Groups ordered by their OFF condition's KV p95, as in Table 1 (no KV p95 yet: last, in plan order)."""
    def key(group):
        kv = _ms(group[0], "kv_usage_p95_ratio")[0]
        return (kv is None, kv or 0.0)
    return sorted(groups, key=key)


def _bars(fig, model: dict) -> bool:
    groups = _by_off_kv(_groups(model))
    order: list[tuple[float, dict]] = []
    pos = 0.0
    for off, ons in groups:
        for s in [off] + ons:
            order.append((pos, s))
            pos += 1.0
        pos += 0.6   # a gap between pairs
    quantities = (("joules_per_token", _energy_label(model), "Energy per generated token", "no energy figures"),
                  ("tokens_per_second", "generated tokens per second (tokens/s)", "Throughput", "no throughput"))
    has = {key: any(_ms(s, key)[0] is not None for _, s in order) for key, *_ in quantities}
    panels = [q[:3] for q in quantities if has[q[0]]]   # a quantity no condition has: no empty panel
    missing = [f"{q[3]} (J/token: panel omitted)" if q[0] == "joules_per_token" else f"{q[3]}: panel omitted"
               for q in quantities if not has[q[0]]]
    if not panels:
        return False
    if len(panels) == 1:
        fig.set_size_inches(max(4.0, 1.6 + 0.55 * len(order)), 4.2)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    kinds = set()
    for ax, (key, label, title) in zip(axes, panels):
        for x, s in order:
            mean, se = _ms(s, key)
            if mean is None:
                continue
            on = bool(s.get("baseline"))
            kinds.add("ON" if on else "OFF")
            ax.bar([x], [mean], yerr=[se], width=0.8, capsize=3, color=ON_COLOR if on else OFF_COLOR,
                   alpha=0.9, gid="bars-on" if on else "bars-off", error_kw={"elinewidth": 1})
            values = _runs(model, s["condition"], key) if key == "tokens_per_second" else _run_energy(model, s)
            ax.scatter([x] * len(values), values, s=9, color=RUN_COLOR, zorder=3, gid="runs")
        ax.set_xticks([x for x, _ in order])
        ax.set_xticklabels([s["condition"] for _, s in order], rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.grid(axis="x", visible=False)
        ax.set_title(f"{title} (mean ± SE, dots: runs)" + "".join(f"\n{m}" for m in missing))
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=OFF_COLOR, label="OFF (no offloading)")] if "OFF" in kinds else []
    handles += [Patch(color=ON_COLOR, label="ON (offloading), right of its OFF")] if "ON" in kinds else []
    handles += [Line2D([], [], ls="none", marker="o", ms=3, color=RUN_COLOR, label="individual runs")]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), frameon=False,
               title="conditions ordered by the OFF condition's KV p95 (low to high)", title_fontsize=8)
    return True


def _run_energy(model: dict, s: dict) -> list[float]:
    scope, basis = s.get("energy_scope"), model["energy_basis"]
    key = f"{scope}_{'marginal_joules_per_token' if basis == 'marginal' else 'joules_per_token'}"
    return _runs(model, s["condition"], key) if scope else []


# ------------------------------------------------------------------------------------------------------
# (c) energy-throughput frontier
# ------------------------------------------------------------------------------------------------------
def _frontier(fig, model: dict) -> bool:
    by_name = _by_name(model)
    ax = fig.subplots()
    drawn = {"OFF": ([], []), "ON": ([], [])}
    for s in model["conditions"]:
        x, xerr = _ms(s, "tokens_per_second")
        y, yerr = _ms(s, "joules_per_token")
        if x is None or y is None:
            continue
        on = bool(s.get("baseline"))
        ax.errorbar([x], [y], xerr=[xerr], yerr=[yerr], fmt="none", ecolor="#666666", elinewidth=0.8,
                    capsize=2, zorder=2)
        drawn["ON" if on else "OFF"][0].append(x)
        drawn["ON" if on else "OFF"][1].append(y)
        ax.annotate(s["condition"], (x, y), textcoords="offset points", xytext=(5, 5), fontsize=7)
        off = by_name.get(s.get("baseline") or "")
        ox, oy = _ms(off, "tokens_per_second")[0], _ms(off, "joules_per_token")[0]
        if on and ox is not None and oy is not None:
            ax.annotate("", xy=(x, y), xytext=(ox, oy), gid="pair-link",
                        arrowprops={"arrowstyle": "->", "color": ON_COLOR, "lw": 1, "shrinkA": 5, "shrinkB": 5})
    if not drawn["OFF"][0] and not drawn["ON"][0]:
        return False
    if drawn["OFF"][0]:   # a kind of condition that is absent gets no legend entry
        ax.scatter(*drawn["OFF"], s=40, facecolor="white", edgecolor=OFF_COLOR, lw=1.4, zorder=3, gid="off",
                   label="OFF (mean ± SE)")
    if drawn["ON"][0]:
        ax.scatter(*drawn["ON"], s=40, color=ON_COLOR, zorder=3, gid="on",
                   label="ON (mean ± SE); arrow from its OFF")
    ax.set_xlabel("generated tokens per second (tokens/s)")
    ax.set_ylabel(_energy_label(model))
    ax.set_title("Energy–throughput frontier (lower right is better)")
    fig.legend(loc="outside lower center", ncols=2, frameon=False)
    return True


# ------------------------------------------------------------------------------------------------------
# (d) mechanism: preemptions and local_compute share against the OFF KV p95
# ------------------------------------------------------------------------------------------------------
# (key, scale, y label, words for a panel whose every value is zero): preemptions per minute, the daemon's unit
MECHANISM_PANELS = (("preemptions_per_minute", 1.0, "preemptions per minute", "no run preempted"),
                    ("share_local_compute", 100.0, "prompt tokens recomputed\n(local_compute share, %)",
                     "no prompt token was recomputed"))


def _mechanism_points(model: dict, key: str, scale: float) -> list[dict]:
    """One point per condition with an x (its OFF's KV p95) and a y: mean, SE, runs, side."""
    by_name, out = _by_name(model), []
    for s in model["conditions"]:
        on = bool(s.get("baseline"))
        x, xerr = _ms(by_name.get(s["baseline"]) if on else s, "kv_usage_p95_ratio", 100)
        y, yerr = _ms(s, key, scale)
        if x is not None and y is not None:
            out.append({"name": s["condition"], "side": "ON" if on else "OFF", "x": x, "xerr": xerr, "y": y,
                        "yerr": yerr, "runs": _runs(model, s["condition"], key, scale)})
    return out


def _mechanism_panel(ax, points: list[dict]) -> None:
    for side in ("OFF", "ON"):
        pts = [p for p in points if p["side"] == side]
        if not pts:
            continue   # an absent kind of condition: nothing drawn, no legend entry
        for p in pts:
            ax.errorbar([p["x"]], [p["y"]], yerr=[p["yerr"]], xerr=[p["xerr"]], fmt="none", ecolor="#666666",
                        elinewidth=0.8, capsize=2, zorder=2)
        off = side == "OFF"
        ax.scatter([p["x"] for p in pts], [p["y"] for p in pts], s=40 if off else 26, zorder=4,
                   gid=f"means-{side.lower()}", facecolor="none" if off else ON_COLOR,
                   edgecolor=OFF_COLOR if off else ON_COLOR, lw=1.4, label=f"{side} mean ± SE")
        rx = [p["x"] for p in pts for _ in p["runs"]]
        ry = [v for p in pts for v in p["runs"]]
        if rx:   # over the means (zorder), so a run under its mean's circle stays visible
            ax.scatter(rx, ry, s=16, marker="x", lw=0.9, zorder=6, gid=f"runs-{side.lower()}",
                       color=RUN_COLOR if off else "#0b3d66", label=f"{side} runs")
    _ylim(ax, [p["y"] + d for p in points for d in (-p["yerr"], p["yerr"])] + [v for p in points for v in p["runs"]])


def _mechanism(fig, model: dict) -> bool:
    located = model["analysis"]["threshold"]["located"]
    panels, notes = [], []
    for key, scale, ylabel, none_words in MECHANISM_PANELS:
        points = _mechanism_points(model, key, scale)
        values = [p["y"] for p in points] + [v for p in points for v in p["runs"]]
        if any(values):
            panels.append((points, ylabel))
        elif values:   # all zero: a flat row of points on the axis informs less than one line of words
            runs = sum(len(p["runs"]) for p in points)
            notes.append(f"{none_words} ({ylabel.replace(chr(10), ' ')}: 0 in each of the {runs} runs; "
                         "panel omitted)")
    if not panels:
        return False
    if len(panels) == 1:
        fig.set_size_inches(7.2, 4.4)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    xs = sorted({p["x"] for points, _ in panels for p in points if p["side"] == "OFF"}
                or {p["x"] for points, _ in panels for p in points})
    band = _band_informs(located, xs)
    extent = []
    for i, (ax, (points, ylabel)) in enumerate(zip(axes, panels)):
        _mechanism_panel(ax, points)
        _threshold_band(ax, located, model["kv_pressure_threshold"], xs, label=i == 0)
        ax.set_ylabel(ylabel)
        extent += [p["x"] + d for p in points for d in (-p["xerr"], p["xerr"])]
    _label_points(axes[-1], [(p["x"], p["y"], p["name"]) for p in panels[-1][0] if p["side"] == "OFF"], above=True)
    _xlim(axes[-1], extent, located, model["kv_pressure_threshold"], right=0.12, band=band)
    any_on = any(p["side"] == "ON" for points, _ in panels for p in points)
    axes[-1].set_xlabel("KV-cache usage p95 of the OFF condition (%)\nconditions at their measured p95 (not in the "
                        "swept value's order)" + ("; ON at their OFF's p95" if any_on else ""))
    title = "Mechanism: " + " and ".join(
        {"preemptions per minute": "preemptions"}.get(y, "recomputation") for _, y in panels) + " against KV pressure"
    axes[0].set_title(title + "".join(f"\n{n}" for n in notes))
    handles, labels = {}, []
    for ax in axes:   # one legend entry per label across the panels
        for h, l in zip(*ax.get_legend_handles_labels()):
            if l not in handles:
                handles[l] = h
                labels.append(l)
    fig.legend([handles[l] for l in labels], labels, loc="outside lower center", ncols=2, frameon=False)
    return True


# ------------------------------------------------------------------------------------------------------
# (d2) the study's Table 2 as stacked bars: where each pair's prompt tokens came from, OFF next to ON
# ------------------------------------------------------------------------------------------------------
SOURCE_BARS = (("share_local_compute", "computed (local_compute)", "#d62728"),
               ("share_local_cache_hit", "prefix-cached (local_cache_hit)", "#bdbdbd"),
               ("share_external_kv_transfer", "reloaded from the offload tier (external_kv_transfer)", ON_COLOR))


def _sources(fig, model: dict) -> bool:
    by_name = _by_name(model)
    pairs = [(by_name[s["baseline"]], s) for s in model["conditions"]
             if s.get("baseline") in by_name and _ms(s, "share_local_compute")[0] is not None
             and _ms(by_name[s["baseline"]], "share_local_compute")[0] is not None]
    if not pairs:
        return False
    pairs.sort(key=lambda p: _ms(p[0], "kv_usage_p95_ratio")[0] or 0.0)
    ax = fig.subplots()
    ticks, labels, crosses = [], [], {"OFF": ([], []), "ON": ([], [])}
    pos, labelled = 0.0, set()
    for off, on in pairs:
        for side, s in (("OFF", off), ("ON", on)):
            bottom = 0.0
            for key, label, color in SOURCE_BARS:
                share = (_ms(s, key, 100)[0] or 0.0)
                bar = ax.bar([pos], [share], bottom=[bottom], width=0.8, color=color, edgecolor="white", lw=0.5,
                             hatch=None if side == "ON" else "//", gid=f"bars-{side.lower()}")
                if share > 0 and label not in labelled:   # one legend entry per source that has a share
                    bar.patches[0].set_label(label)
                    labelled.add(label)
                bottom += share
            runs = _runs(model, s["condition"], "share_local_compute", 100)
            crosses[side][0].extend([pos] * len(runs))
            crosses[side][1].extend(runs)
            ax.text(pos, 100.8, side, ha="center", va="bottom", fontsize=7)
            pos += 1.0
        kv = _ms(off, "kv_usage_p95_ratio", 100)[0]
        ticks.append(pos - 1.5)
        labels.append(f"{on['condition']}\nvs {off['condition']}" + ("" if kv is None else f"\nKV p95 {kv:.0f} %"))
        pos += 0.6
    for side, (xs, ys) in crosses.items():
        if xs:
            ax.scatter(xs, ys, s=16, marker="x", lw=0.9, zorder=6, color=RUN_COLOR if side == "OFF" else "#0b3d66",
                       gid=f"runs-{side.lower()}", label=f"{side} runs (computed share)")
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylim(0, 106)
    ax.set_ylabel("share of prompt tokens (%), first prefills\n(OFF hatched, ON plain)")
    ax.grid(axis="x", visible=False)
    ax.set_title("Token sources OFF vs ON, pairs by the OFF condition's KV p95\n(vLLM 0.32 counts first prefills only: "
                 "re-prefill after preemption is in no bar)")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=2, frameon=False)
    return True


# ------------------------------------------------------------------------------------------------------
# (e) buffer size
# ------------------------------------------------------------------------------------------------------
def _buffer(fig, model: dict) -> bool:
    groups = model["analysis"]["buffers"]
    if not groups:
        return False
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    for ax, g in zip(axes, groups):
        plateau = g["plateau_dE_percent"]
        ax.axhline(plateau, color="#333333", lw=0.8, ls="-", gid="plateau", label="plateau: dE of the largest buffer")
        ax.axhline(plateau * 0.9, color="#333333", lw=0.8, ls=":", label="90 % of the plateau")
        ax.axhline(0, color="black", lw=0.6)
        if g["rule_buffer_bytes"]:
            ax.axvline(g["rule_buffer_bytes"] / 2 ** 30, color=BAND_COLOR, ls="--", lw=1, gid="rule-buffer",
                       label="rule's minimum: write rate x p99 tool latency = "
                             f"{g['rule_buffer_bytes'] / 2 ** 30:.3g} GiB")
        for verdict, face, label in ((True, ON_COLOR, "rule: residency >= p99 tool latency"),
                                     (False, "white", "rule: residency < p99 tool latency (undersized)"),
                                     (None, "#bbbbbb", "rule: unknown (no write rate)")):
            rows = [r for r in g["rows"] if r["rule_sufficient"] is verdict]
            if not rows:
                continue
            xs = [r["buffer_bytes"] / 2 ** 30 for r in rows]
            ax.errorbar(xs, [r["dE_percent"] for r in rows], yerr=[r["dE_se_percent"] or 0 for r in rows],
                        fmt="none", ecolor="#666666", capsize=3, elinewidth=1, zorder=2)
            ax.scatter(xs, [r["dE_percent"] for r in rows], s=44, facecolor=face, edgecolor=ON_COLOR, lw=1.4,
                       zorder=4, gid="means", label=label)
        for r in g["rows"]:
            x = r["buffer_bytes"] / 2 ** 30
            ax.scatter([x] * len(r["dE_runs_percent"]), r["dE_runs_percent"], s=12, marker="x", color=RUN_COLOR,
                       lw=0.8, zorder=5, gid="runs", label="individual runs" if r is g["rows"][0] else None)
            res = "n/a" if r["residency_seconds"] is None else f"{r['residency_seconds']:.0f} s"
            ax.annotate(f"residency {res}\n{_runs_words(r['n'], model.get('repeats'))}", (x, r["dE_percent"]),
                        textcoords="offset points",
                        xytext=(6, -16), fontsize=7)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["buffer_bytes"] / 2 ** 30 for r in g["rows"]})
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in ticks])
        ax.set_xlim(ticks[0] / 1.3, ticks[-1] * 1.9)
        ax.minorticks_off()
        ax.set_xlabel("offload buffer (GiB, log scale)")
        ax.set_ylabel(f"dE (%) against {g['baseline']}")
        p99 = g["rows"][0]["p99_tool_latency_seconds"]
        judged = [r["rule_agrees"] for r in g["rows"] if r["rule_agrees"] is not None]
        ax.set_title(f"Buffer size against {g['baseline']} (p99 tool latency {p99:.3g} s)\n"
                     f"residency rule agrees with the measured plateau at {sum(judged)} of {len(judged)} sizes")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=2, frameon=False)
    return True



def _tiers(fig, model: dict) -> bool:
    """Tiered conditions (tiers.py): the bytes reloaded out of each tier, and the prompt tokens by source, per
    condition; the break-even per tier is Table T3."""
    tier = (model.get("analysis") or {}).get("tiers")
    if not tier:
        return False
    names = list(tier["conditions"])
    ax1, ax2 = fig.subplots(1, 2)
    hops = [("link (CPU tier -> GPU)", lambda t: t["link"].get("load_bytes"))]
    # the tiers that read something out (the primary tier's reads are the link's loads)
    labels = sorted({label for e in tier["conditions"].values() for label, t in e["totals"]["tiers"].items()
                     if t.get("read_bytes") is not None})
    hops += [(f"{label} read ({'disk -> CPU tier' if label.endswith(':fs') else 'into the CPU tier'})",
              lambda t, label=label: (t["tiers"].get(label) or {}).get("read_bytes")) for label in labels]
    width = 0.8 / len(hops)
    shown = []
    for i, (label, get) in enumerate(hops):
        ys = [(get(tier["conditions"][n]["totals"]) or 0.0) / 2 ** 20 for n in names]
        shown += [y for y in ys if y > 0]
        ax1.bar([x + i * width for x in range(len(names))], ys, width=width, label=label)
    ax1.set_xticks([x + 0.4 - width / 2 for x in range(len(names))])
    ax1.set_xticklabels(names)
    ax1.set_yscale("log")   # a disk tier may read a hundredth of what the link loads
    if shown:
        ax1.set_ylim(bottom=min(shown) / 10)
    ax1.set_ylabel("bytes reloaded in the windows (MiB, log scale)")
    ax1.set_title("Reloads per tier")
    ax1.legend(fontsize=7)
    bottom = [0.0] * len(names)
    for source in ("local_compute", "device", "host", "disk"):
        ys = []
        for n in names:
            t = tier["conditions"][n]["totals"]
            ys.append((t.get("local_compute") if source == "local_compute" else
                       (t.get("cached_tokens") or {}).get(source)) or 0.0)
        ax2.bar(range(len(names)), ys, bottom=bottom, label="computed" if source == "local_compute" else source)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax2.set_xticks(range(len(names)))
    ax2.set_xticklabels(names)
    ax2.set_ylabel("prompt tokens in the windows")
    ax2.set_title("Prompt tokens by source")
    ax2.legend(fontsize=7)
    return True

FIGURES: dict[str, tuple[Callable, tuple[float, float], str]] = {
    "savings_vs_kv_p95.png": (_savings, (7.2, 5.0),
                              "Energy saving of offloading, dE % (positive = saves), of each ON condition "
                              "against its OFF baseline, at the OFF condition's KV p95. Points: mean over runs with "
                              "± SE bars (dE: delta method; KV p95: over the OFF runs), the runs ON and OFF "
                              "(of the plan's repeats) beside each; "
                              "crosses, drawn over the means: each ON run against the OFF mean. "
                              "Band: the threshold located from the sweep with its uncertainty interval, drawn when "
                              "narrower than half the data's KV p95 range (else a line at it, the interval in the "
                              "legend; dashed line: the configured threshold, when none is located)."),
    "tiers.png": (_tiers, (10.0, 4.2),
                  "Tiered conditions: the bytes reloaded out of each tier (the link from the CPU tier to the GPU; a "
                  "disk tier's promotions into the CPU tier) and the prompt tokens by source (computed, or cached on "
                  "the device, in the CPU tier, on disk) over the measurement windows; totals over the runs."),
    "energy_throughput_bars.png": (_bars, (10.0, 4.2),
                                   "J/token and tokens/s per condition, each ON bar (blue) right of its "
                                   "OFF bar (grey), pairs ordered by the OFF condition's KV p95; bars: mean over runs, "
                                   "error bars ± SE, dots: individual runs; a quantity no condition has is not drawn."),
    "frontier.png": (_frontier, (7.2, 5.0),
                     "Energy–throughput frontier: J/token against tokens/s per condition (mean ± SE on "
                     "both axes); hollow: OFF, filled: ON, an arrow from each OFF to its ON condition."),
    "mechanism.png": (_mechanism, (7.2, 6.4),
                      "Mechanism (the study's Table 2 as a plot): preemptions per minute and the local_compute "
                      "share of prompt tokens, against the OFF condition's KV p95 (ON conditions at their OFF's p95; "
                      "conditions stand at their measured p95, not in the order of the swept value); mean ± SE, "
                      "crosses over the means: runs; a panel whose every run is zero is omitted and said in the "
                      "title; band: the located threshold's interval when narrower than half the data's KV p95 "
                      "range, else a line at it (dashed: the configured one, when none is located)."),
    "token_sources.png": (_sources, (7.2, 5.2),
                          "The study's Table 2 as stacked bars: the shares of prompt tokens computed, prefix-cached "
                          "and reloaded from the offload tier, OFF (hatched) next to ON, mean over runs, pairs by the "
                          "OFF condition's KV p95; crosses: each run's computed share. vLLM 0.32 counts a request's "
                          "first prefill only: the re-prefill of a preempted request is in no bar (Table 2c)."),
    "buffer_size.png": (_buffer, (7.2, 5.2),
                        "Buffer-size comparison: dE % of ON conditions at several offload buffer sizes "
                        "against one OFF condition (mean ± SE, crosses: runs), filled where the residency rule "
                        "(buffer / write rate >= p99 tool latency) calls the buffer sufficient; lines: the plateau "
                        "(largest buffer) and 90 % of it."),
}


def _say_synthetic(fig, model: dict) -> None:
    """Every titled panel says that its data are synthetic, so a figure copied alone still says it."""
    n, total = model["synthetic_runs"], len(model["runs"])
    words = "synthetic data" if n == total else f"synthetic data in {n} of {total} runs"
    for ax in fig.axes:
        if ax.get_title():
            first, *rest = ax.get_title().split("\n")
            ax.set_title("\n".join([f"{first} [{words}]", *rest]))


ENERGY_FIGURES = ("savings_vs_kv_p95.png", "energy_throughput_bars.png", "frontier.png", "buffer_size.png")


def _say_power_double(fig) -> None:
    """A figure drawn from a power double's energy says so in its first title, so a copy alone still says it: on
    a line of its own after the title's first (at its end, the bars figure's half-width title ran off the
    figure)."""
    for ax in fig.axes:
        if ax.get_title():
            first, *rest = ax.get_title().split("\n")
            ax.set_title("\n".join([first, "[energy: power double]", *rest]))
            return


def figures(model: dict) -> list[tuple[str, str, object]]:
    """(file name, caption, matplotlib Figure) for each figure with something to show, in report order."""
    Figure = _figure_class()
    import matplotlib

    out = []
    with matplotlib.rc_context(STYLE):
        for name, (draw, size, caption) in FIGURES.items():
            fig = Figure(figsize=size, layout="constrained")
            if draw(fig, model):
                if model.get("synthetic_runs"):
                    _say_synthetic(fig, model)
                if model.get("power_double") and name in ENERGY_FIGURES:
                    _say_power_double(fig)
                out.append((name, caption, fig))
    return out


def skipped(model: dict, drawn: list[str]) -> dict[str, str]:
    reasons = {"savings_vs_kv_p95.png": "no ON condition with a dE (an ON/OFF pair with energy data)",
               "buffer_size.png": "no OFF condition with ON conditions at two or more buffer sizes (reported by "
                                  "the engine in vllm:cache_config_info, or the conditions' params.buffer_gib)",
               "frontier.png": "no condition with both tokens/s and J/token",
               "mechanism.png": "no condition with a KV p95",
               "token_sources.png": "no ON/OFF pair with token-source shares",
               "tiers.png": "no tiered condition (conditions[].tiered)",
               "energy_throughput_bars.png": "no condition with J/token or tokens/s yet"}
    # the tier figure belongs to plans with tiered conditions: a plan without one misses nothing
    applicable = [n for n in FIGURES if n != "tiers.png" or (model.get("analysis") or {}).get("tiers")]
    return {n: reasons[n] for n in applicable if n not in drawn}


def write_plots(plot_dir: str, model: dict) -> dict[str, str]:
    """path -> caption for each figure written (MissingDependency without matplotlib)."""
    out = {}
    drawn = figures(model)
    for name in set(FIGURES) - {name for name, _, _ in drawn}:   # left from an earlier report of these runs
        try:
            os.unlink(os.path.join(plot_dir, name))
        except FileNotFoundError:
            pass
    for number, (name, caption, fig) in enumerate(drawn, start=1):
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=STYLE["savefig.dpi"], metadata={"Software": None})
        path = os.path.join(plot_dir, name)
        atomic.write_bytes(path, png.getvalue())
        out[path] = f"Figure {number}. {caption}"   # numbered as drawn: a figure not drawn leaves no gap
    return out
