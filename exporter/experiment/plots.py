"""The report's figures as PNG (matplotlib, Agg backend: no display needed).

- savings_vs_kv_p95.png: dE% (± SE) of each ON condition against the KV p95 of its OFF baseline, with the
  pressure threshold marked (methods.md s3: offloading pays above ~0.90). Without pairs it shows where each
  condition's p95 falls against the threshold.
- energy_per_token.png: total and marginal J/token per condition (± SE), in the scope the report uses.
- throughput.png: generated tokens/s per condition (± SE).
"""

from __future__ import annotations

import io
import os

from exporter import atomic


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(plot_dir: str, summaries: list[dict], threshold: float) -> dict[str, str]:
    """path -> caption for each figure written; {} when matplotlib is not installed (the tables still are)."""
    try:
        plt = _pyplot()
    except ImportError:
        return {}
    figures = {
        "savings_vs_kv_p95.png": ("Energy saving of offloading (dE %) against the OFF condition's KV p95",
                                  _savings),
        "energy_per_token.png": ("Energy per generated token by condition (total and marginal)", _energy),
        "throughput.png": ("Generated tokens per second by condition", _throughput),
    }
    out = {}
    for name, (caption, draw) in figures.items():
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        draw(ax, summaries, threshold)
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png")
        plt.close(fig)
        path = os.path.join(plot_dir, name)
        atomic.write_bytes(path, png.getvalue())
        out[path] = caption
    return out


def _mean(summary: dict, key: str) -> tuple[float | None, float | None]:
    s = summary.get(key) or {}
    return s.get("mean"), s.get("se")


def _savings(ax, summaries: list[dict], threshold: float) -> None:
    by_name = {s["condition"]: s for s in summaries}
    ax.axvline(threshold * 100, color="tab:red", linestyle="--", label=f"threshold {threshold * 100:.0f} %")
    ax.axhline(0, color="grey", linewidth=0.8)
    points = 0
    for s in summaries:
        c = s.get("comparison")
        kv = _mean(by_name[s["baseline"]], "kv_usage_p95_ratio")[0] if c else None
        if not c or c["dE_percent"] is None or kv is None:
            continue
        ax.errorbar(kv * 100, c["dE_percent"], yerr=c["dE_se_percent"] or 0, fmt="o", capsize=4)
        ax.annotate(s["condition"], (kv * 100, c["dE_percent"]), textcoords="offset points", xytext=(5, 5))
        points += 1
    if not points:
        for s in summaries:
            kv = _mean(s, "kv_usage_p95_ratio")[0]
            if kv is not None:
                ax.plot(kv * 100, 0, "s", color="tab:blue")
                ax.annotate(s["condition"], (kv * 100, 0), textcoords="offset points", xytext=(5, 8), rotation=30)
        ax.set_ylim(-10, 10)
        ax.text(0.02, 0.95, "no ON/OFF pair: dE % needs a condition with a baseline;\n"
                "squares: each condition's KV p95", transform=ax.transAxes, va="top", fontsize=8)
    ax.set_xlim(0, 105)
    ax.set_xlabel("KV cache usage p95 of the OFF condition (%)")
    ax.set_ylabel("dE % (positive = offloading saves)")
    ax.legend(loc="lower right", fontsize=8)


def _bars(ax, summaries: list[dict], series: list[tuple[str, str]]) -> None:
    names = [s["condition"] for s in summaries]
    width = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        xs, ys, errs = [], [], []
        for j, s in enumerate(summaries):
            mean, se = _mean(s, key)
            if mean is not None:
                xs.append(j + (i - (len(series) - 1) / 2) * width)
                ys.append(mean)
                errs.append(se or 0)
        ax.bar(xs, ys, width=width, yerr=errs, capsize=3, label=label)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, ha="right")


def _energy(ax, summaries: list[dict], threshold: float) -> None:
    _bars(ax, summaries, [("joules_per_token_total", "total"), ("joules_per_token_marginal", "marginal")])
    scopes = sorted({s["energy_scope"] for s in summaries if s.get("energy_scope")})
    ax.set_ylabel(f"J per generated token ({', '.join(scopes) or 'no energy data'})")
    ax.legend(fontsize=8)


def _throughput(ax, summaries: list[dict], threshold: float) -> None:
    _bars(ax, summaries, [("tokens_per_second", "tokens/s")])
    ax.set_ylabel("generated tokens per second")
