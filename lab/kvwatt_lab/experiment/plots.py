"""The report's figures (matplotlib, Agg, no pyplot state: the same data give the same PNG).

- savings_vs_kv_p95.png: dE% of each ON condition (mean ± SE over runs, n stated) at its OFF baseline's KV p95
  (± SE), the individual runs as points, the located threshold as a band (the study's Figure 2).
- energy_throughput_bars.png: J/token and tokens/s per condition, each ON bar next to its OFF bar.
- frontier.png: J/token against tokens/s per condition, ON and OFF of a pair connected (the study's Figure 3).
- mechanism.png: preemptions per window and the local_compute share against the OFF KV p95 (methods.md s4,
  the study's Table 2 as a plot).
- buffer_size.png: dE% of ON at several buffer sizes against one OFF, with the residency rule's verdict and
  the measured plateau (methods.md s6, the study's s4.2).

A figure with nothing to show (no ON/OFF pair for the savings, no buffer sweep) is not drawn; the report says
why. Artists carry a ``gid`` (``means``, ``runs``, ``bars-on`` ...) so tests can count what was plotted.
"""

from __future__ import annotations

import io
import os
import sys
from typing import Callable

from exporter import atomic
from exporter.config import ConfigError

REQUIREMENT = "matplotlib>=3.8,<4"
OFF_COLOR, ON_COLOR, PAY_COLOR, NOISE_COLOR, BAND_COLOR = "#6b6b6b", "#1f6fb4", "#1f6fb4", "#9a9a9a", "#d62728"
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
    return f"J per generated token ({model['energy_basis']}, {'/'.join(scopes) or 'no energy data'})"


def _threshold_band(ax, located: dict | None, configured: float, label: bool = True) -> None:
    if located:
        ax.axvspan(located["low"] * 100, located["high"] * 100, color=BAND_COLOR, alpha=0.12, lw=0,
                   gid="threshold-band", label=(f"located threshold {located['ratio'] * 100:.1f} % "
                                                f"[{located['low'] * 100:.1f}–{located['high'] * 100:.1f}]"
                                                if label else None))
        ax.axvline(located["ratio"] * 100, color=BAND_COLOR, lw=1.2, gid="threshold")
    else:
        ax.axvline(configured * 100, color=BAND_COLOR, lw=1, ls="--", gid="threshold",
                   label=f"configured threshold {configured * 100:.0f} % (none located)" if label else None)


def _xlim(ax, xs: list[float], located: dict | None, configured: float, right: float = 0.08) -> None:
    """The axis range where the data (``xs``: points and their error bars' ends) and the threshold (band)
    are, with a margin (``right``: room for labels), at least 10 points of KV p95 wide."""
    pts = list(xs) + ([located["low"] * 100, located["high"] * 100] if located else [configured * 100])
    if not pts:
        return
    lo, hi = min(pts), max(pts)
    if hi - lo < 10.0:
        lo, hi = (lo + hi) / 2 - 5.0, (lo + hi) / 2 + 5.0
    span = hi - lo
    ax.set_xlim(max(lo - span * 0.06, 0.0), min(hi + span * right, 110.0))


def _label_points(ax, labels: list[tuple[float, float, str]]) -> None:
    """Condition labels beside their points; points sharing an x alternate right and left, so they do not
    print over each other."""
    seen: dict[float, int] = {}
    for x, y, text in sorted(labels, key=lambda t: (t[0], -t[1])):
        i = seen[x] = seen.get(x, -1) + 1
        right = i % 2 == 0
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(7 if right else -7, 2), fontsize=7,
                    color="#333333", ha="left" if right else "right", va="center")


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
        labels.append((x, c["dE_percent"], f"{s['condition']}\nn={c['n_on']}/{c['n_off']}"))
    if not xs:
        return False
    _label_points(ax, labels)
    _threshold_band(ax, located, model["kv_pressure_threshold"])
    ax.axhline(0, color="black", lw=0.8, gid="zero")
    ax.scatter(run_x, run_y, s=12, marker="x", color="#555555", lw=0.8, zorder=3, gid="runs",
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
    _xlim(ax, extent, located, model["kv_pressure_threshold"], right=0.16)
    ax.set_xlabel("KV-cache usage p95 of the OFF condition (%)")
    ax.set_ylabel("dE (%)  (positive = offloading saves energy)")
    ax.set_title(f"Energy saving of offloading against KV pressure ({means} ON/OFF pair{'s' if means != 1 else ''})")
    fig.legend(loc="outside lower center", ncols=2, frameon=False)
    return True


# ------------------------------------------------------------------------------------------------------
# (b) J/token and tokens/s, ON next to its OFF
# ------------------------------------------------------------------------------------------------------
def _bars(fig, model: dict) -> bool:
    groups = _groups(model)
    if not groups:
        return False
    ax_e, ax_t = fig.subplots(1, 2)
    order: list[tuple[float, dict]] = []
    pos = 0.0
    for off, ons in groups:
        for s in [off] + ons:
            order.append((pos, s))
            pos += 1.0
        pos += 0.6   # a gap between pairs
    drawn = 0
    for ax, key, label in ((ax_e, "joules_per_token", _energy_label(model)),
                           (ax_t, "tokens_per_second", "generated tokens per second (tokens/s)")):
        run_key = None if key == "joules_per_token" else "tokens_per_second"
        for x, s in order:
            mean, se = _ms(s, key)
            on = bool(s.get("baseline"))
            if mean is None:
                continue
            drawn += 1
            ax.bar([x], [mean], yerr=[se], width=0.8, capsize=3, color=ON_COLOR if on else OFF_COLOR,
                   alpha=0.9, gid="bars-on" if on else "bars-off", error_kw={"elinewidth": 1})
            values = _runs(model, s["condition"], run_key) if run_key else _run_energy(model, s)
            ax.scatter([x] * len(values), values, s=9, color="black", zorder=3, gid="runs")
        ax.set_xticks([x for x, _ in order])
        ax.set_xticklabels([s["condition"] for _, s in order], rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.grid(axis="x", visible=False)
    if not drawn:
        return False
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color=OFF_COLOR, label="OFF (no offloading)"),
                        Patch(color=ON_COLOR, label="ON (offloading), right of its OFF")],
               loc="outside lower center", ncols=2, frameon=False)
    ax_e.set_title("Energy per generated token (mean ± SE, dots: runs)")
    ax_t.set_title("Throughput (mean ± SE, dots: runs)")
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
    ax.scatter(*drawn["OFF"], s=40, facecolor="white", edgecolor=OFF_COLOR, lw=1.4, zorder=3, gid="off",
               label="OFF (mean ± SE)")
    ax.scatter(*drawn["ON"], s=40, color=ON_COLOR, zorder=3, gid="on", label="ON (mean ± SE); arrow from its OFF")
    ax.set_xlabel("generated tokens per second (tokens/s)")
    ax.set_ylabel(_energy_label(model))
    ax.set_title("Energy–throughput frontier (lower right is better)")
    fig.legend(loc="outside lower center", ncols=2, frameon=False)
    return True


# ------------------------------------------------------------------------------------------------------
# (d) mechanism: preemptions and local_compute share against the OFF KV p95
# ------------------------------------------------------------------------------------------------------
def _mechanism(fig, model: dict) -> bool:
    by_name, located = _by_name(model), model["analysis"]["threshold"]["located"]
    ax_p, ax_s = fig.subplots(2, 1, sharex=True)
    xs, labels, extent = [], [], []
    for panel, key, scale, run_key in ((ax_p, "preemptions", 1.0, "preemptions"),
                                       (ax_s, "share_local_compute", 100.0, "share_local_compute")):
        for side in ("OFF", "ON"):
            mx, my, rx, ry = [], [], [], []
            for s in model["conditions"]:
                on = bool(s.get("baseline"))
                if on != (side == "ON"):
                    continue
                x, xerr = _ms(by_name.get(s["baseline"]) if on else s, "kv_usage_p95_ratio", 100)
                y, yerr = _ms(s, key, scale)
                if x is None or y is None:
                    continue
                panel.errorbar([x], [y], yerr=[yerr], xerr=[xerr], fmt="none", ecolor="#666666", elinewidth=0.8,
                               capsize=2, zorder=2)
                mx.append(x)
                my.append(y)
                extent += [x - xerr, x + xerr]
                if side == "OFF" and panel is ax_s:
                    labels.append((x, y, s["condition"]))
                runs = _runs(model, s["condition"], run_key, scale)
                rx += [x] * len(runs)
                ry += runs
            xs += mx
            if mx:
                panel.scatter(mx, my, s=40 if side == "OFF" else 26, zorder=5 if side == "OFF" else 4,
                              gid=f"means-{side.lower()}", facecolor="none" if side == "OFF" else ON_COLOR,
                              edgecolor=OFF_COLOR if side == "OFF" else ON_COLOR, lw=1.4,
                              label=f"{side} mean ± SE")
                panel.scatter(rx, ry, s=10, marker="x", lw=0.7, zorder=3, gid=f"runs-{side.lower()}",
                              color=OFF_COLOR if side == "OFF" else ON_COLOR, alpha=0.7)
        _threshold_band(panel, located, model["kv_pressure_threshold"], label=panel is ax_p)
    if not xs:
        return False
    _label_points(ax_s, labels)
    _xlim(ax_s, extent, located, model["kv_pressure_threshold"], right=0.12)
    for panel in (ax_p, ax_s):
        panel.set_ylim(bottom=0)
    ax_p.set_ylabel("preemptions per window")
    ax_s.set_ylabel("local_compute share of\nprompt tokens (%)")
    any_on = any(s.get("baseline") for s in model["conditions"])
    ax_s.set_xlabel("KV-cache usage p95 of the OFF condition (%)" + ("  (ON conditions at their OFF's p95)"
                                                                     if any_on else ""))
    ax_p.set_title("Mechanism: preemptions and recomputation against KV pressure (x: runs)")
    fig.legend(*ax_p.get_legend_handles_labels(), loc="outside lower center", ncols=3, frameon=False)
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
                       label=f"rule's minimum: write rate x p99 tool latency = {g['rule_buffer_bytes'] / 2 ** 30:.3g} GiB")
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
            ax.scatter([x] * len(r["dE_runs_percent"]), r["dE_runs_percent"], s=10, marker="x", color="#555555",
                       lw=0.7, zorder=3, gid="runs")
            res = "n/a" if r["residency_seconds"] is None else f"{r['residency_seconds']:.0f} s"
            ax.annotate(f"residency {res}\nn={r['n']}", (x, r["dE_percent"]), textcoords="offset points",
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


FIGURES: dict[str, tuple[Callable, tuple[float, float], str]] = {
    "savings_vs_kv_p95.png": (_savings, (7.2, 5.0),
                              "Energy saving of offloading, dE % (positive = saves), of each ON condition "
                              "against its OFF baseline, at the OFF condition's KV p95. Points: mean over runs with "
                              "± SE bars (dE: delta method; KV p95: over the OFF runs), n = runs ON/OFF beside each; "
                              "crosses: each ON run against the OFF mean. Band: the threshold located from the sweep "
                              "with its uncertainty interval (dashed line: the configured threshold, when none is "
                              "located)."),
    "energy_throughput_bars.png": (_bars, (10.0, 4.2),
                                   "J/token and tokens/s per condition, each ON bar (blue) right of its "
                                   "OFF bar (grey); bars: mean over runs, error bars ± SE, dots: individual runs."),
    "frontier.png": (_frontier, (7.2, 5.0),
                     "Energy–throughput frontier: J/token against tokens/s per condition (mean ± SE on "
                     "both axes); hollow: OFF, filled: ON, an arrow from each OFF to its ON condition."),
    "mechanism.png": (_mechanism, (7.2, 6.4),
                      "Mechanism (the study's Table 2 as a plot): preemptions per measurement window and "
                      "the local_compute share of prompt tokens, against the OFF condition's KV p95 (ON conditions "
                      "at their OFF's p95); mean ± SE, crosses: runs; band: the located threshold (dashed line: "
                      "the configured one, when none is located)."),
    "buffer_size.png": (_buffer, (7.2, 5.2),
                        "Buffer-size comparison: dE % of ON conditions at several offload buffer sizes "
                        "against one OFF condition (mean ± SE, crosses: runs), filled where the residency rule "
                        "(buffer / write rate >= p99 tool latency) calls the buffer sufficient; lines: the plateau "
                        "(largest buffer) and 90 % of it."),
}


def figures(model: dict) -> list[tuple[str, str, object]]:
    """(file name, caption, matplotlib Figure) for each figure with something to show, in report order."""
    Figure = _figure_class()
    import matplotlib

    out = []
    with matplotlib.rc_context(STYLE):
        for name, (draw, size, caption) in FIGURES.items():
            fig = Figure(figsize=size, layout="constrained")
            if draw(fig, model):
                out.append((name, caption, fig))
    return out


def skipped(model: dict, drawn: list[str]) -> dict[str, str]:
    reasons = {"savings_vs_kv_p95.png": "no ON condition with a dE (an ON/OFF pair with energy data)",
               "buffer_size.png": "no OFF condition with ON conditions at two or more buffer sizes (reported by "
                                  "the engine in vllm:cache_config_info, or the conditions' params.buffer_gib)",
               "frontier.png": "no condition with both tokens/s and J/token",
               "mechanism.png": "no condition with a KV p95", "energy_throughput_bars.png": "no condition with J/token or tokens/s yet"}
    return {n: reasons[n] for n in FIGURES if n not in drawn}


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
