"""Per-condition aggregates and the paired comparison of methods.md s2, from finished runs' results.

The repeat unit is a run: each run contributes one value per figure (its measurement window), means and
standard errors are over runs. For an ON condition against its baseline (OFF) condition:

    dE%   = (J/tok_OFF - J/tok_ON) / J/tok_OFF * 100
    dTPS% = (TPS_ON - TPS_OFF) / TPS_OFF * 100
    SE    = 100 * (x_ON/x_OFF) * sqrt((SE_ON/x_ON)^2 + (SE_OFF/x_OFF)^2)    delta method, independent means

computed by exporter.derive.economics (saving, gain, mean_and_stderr), the daemon's own implementation.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from exporter.derive.economics import gain, mean_and_stderr, saving
from exporter.derive.recompute import SOURCES

Getter = Callable[[dict], Any]


def _window(run: dict) -> dict:
    return run.get("window") or {}


def joules_per_token(run: dict, scope: str, basis: str) -> float | None:
    figure = _window(run).get("energy", {}).get(scope) or {}
    return figure.get("marginal_joules_per_token" if basis == "marginal" else "joules_per_token")


def share(run: dict, source: str) -> float | None:
    shares = _window(run).get("prompt_token_shares")
    return None if not shares else shares.get(source)


METRICS: dict[str, Getter] = {
    "kv_usage_p95_ratio": lambda r: _window(r).get("kv_usage_p95_ratio"),
    "preemptions": lambda r: _window(r).get("preemptions"),
    "preemptions_per_minute": lambda r: _window(r).get("preemptions_per_minute"),
    "tokens_per_second": lambda r: _window(r).get("tokens_per_second"),
    **{f"share_{s}": (lambda r, s=s: share(r, s)) for s in SOURCES},
    # vLLM's FLOPs estimate per generated token: counts the re-prefill of a preempted request, which the
    # token-source shares (first prefills only, vLLM 0.32) do not
    "flops_per_generated_token": lambda r: _window(r).get("flops_per_generated_token"),
    "offload_write_bytes_per_second": lambda r: _window(r).get("offload_write_bytes_per_second"),
    "offload_read_bytes_per_second": lambda r: _window(r).get("offload_read_bytes_per_second"),
    "offload_store_failures": lambda r: _window(r).get("offload_store_failures"),
    # the engine's own report of its offload buffer (vllm:cache_config_info), per run
    "offload_buffer_bytes": lambda r: (r.get("server") or {}).get("offload_buffer_bytes"),
}


def mean_se(runs: Iterable[dict], get: Getter) -> dict:
    values = [v for v in (get(r) for r in runs) if v is not None]
    mean, se = mean_and_stderr(values)
    return {"mean": mean, "se": se, "n": len(values)}


def choose_scope(runs: Sequence[dict], preferred: str, basis: str) -> str | None:
    """The energy scope used for J/token and dE: the configured one, or with "auto" GPU when every run
    has a GPU figure, else host when every run has a host figure, else whichever has more."""
    if preferred != "auto":
        return preferred
    counts = {s: sum(joules_per_token(r, s, basis) is not None for r in runs) for s in ("gpu", "host")}
    for scope in ("gpu", "host"):
        if runs and counts[scope] == len(runs):
            return scope
    best = max(counts, key=lambda s: counts[s])
    return best if counts[best] else None


def runs_of(finished: dict[str, dict], condition: str) -> list[dict]:
    return sorted((r for r in finished.values() if r["condition"] == condition), key=lambda r: r["repeat"])


def condition_summary(name: str, baseline: str | None, runs: list[dict], scope_pref: str, basis: str) -> dict:
    summary: dict[str, Any] = {"condition": name, "baseline": baseline, "n": len(runs)}
    for metric, get in METRICS.items():
        summary[metric] = mean_se(runs, get)
    scope = choose_scope(runs, scope_pref, basis)
    summary["energy_scope"], summary["energy_basis"] = scope, basis
    summary["joules_per_token"] = mean_se(runs, lambda r: joules_per_token(r, scope, basis)) if scope else None
    summary["joules_per_token_total"] = mean_se(runs, lambda r: joules_per_token(r, scope, "total")) if scope else None
    summary["joules_per_token_marginal"] = (mean_se(runs, lambda r: joules_per_token(r, scope, "marginal"))
                                            if scope else None)
    return summary


def compare(on_runs: list[dict], off_runs: list[dict], scope_pref: str, basis: str) -> dict:
    """dE% and dTPS% (with SE) of ON runs against OFF runs; None values where a side lacks data."""
    scope = choose_scope(on_runs + off_runs, scope_pref, basis)
    out: dict[str, Any] = {"energy_scope": scope, "energy_basis": basis}
    energy = [[joules_per_token(r, scope, basis) for r in runs] if scope else [] for runs in (on_runs, off_runs)]
    out["dE_percent"], out["dE_se_percent"], out["n_on"], out["n_off"] = _percent(*energy, saving)
    out["dE_runs_percent"] = _each(*energy, lambda on, off: (off - on) / off * 100)
    tps = [[_window(r).get("tokens_per_second") for r in runs] for runs in (on_runs, off_runs)]
    out["dTPS_percent"], out["dTPS_se_percent"], out["n_on_tps"], out["n_off_tps"] = _percent(*tps, gain)
    out["dTPS_runs_percent"] = _each(*tps, lambda on, off: (on - off) / off * 100)
    flops = [[_window(r).get("flops_per_generated_token") for r in runs] for runs in (on_runs, off_runs)]
    out["dFLOPs_percent"], out["dFLOPs_se_percent"], _, _ = _percent(*flops, gain)
    return out


def _each(on: list, off: list, fn) -> list[float]:
    """Each ON run against the OFF mean: the individual points drawn beside the mean and its SE."""
    m_off = mean_and_stderr([v for v in off if v is not None])[0]
    return [fn(v, m_off) for v in on if v is not None] if m_off else []


def _percent(on: list, off: list, fn) -> tuple[float | None, float | None, int, int]:
    on = [v for v in on if v is not None]
    off = [v for v in off if v is not None]
    m_on, se_on = mean_and_stderr(on)
    m_off, se_off = mean_and_stderr(off)
    if m_on is None or not m_off:
        return None, None, len(on), len(off)
    value, se = fn(m_on, se_on, m_off, se_off)
    return value * 100, (None if se is None else se * 100), len(on), len(off)


def summarize(plan: dict, finished: dict[str, dict]) -> list[dict]:
    """One summary per condition in plan order; ON conditions carry ``comparison`` against their baseline."""
    scope_pref, basis = plan["energy"]["scope"], plan["energy"]["basis"]
    out = []
    for c in plan["conditions"]:
        runs = runs_of(finished, c["name"])
        summary = condition_summary(c["name"], c["baseline"], runs, scope_pref, basis)
        if c["baseline"]:
            summary["comparison"] = compare(runs, runs_of(finished, c["baseline"]), scope_pref, basis)
        out.append(summary)
    return out
