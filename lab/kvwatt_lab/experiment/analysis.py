"""The sweep's analysis behind the report (docs/experiment.md "Report"): what varies between conditions, the
recomputation tax between OFF conditions (methods.md s4), the KV-p95 threshold located from the sweep
(methods.md s3) and the buffer-size comparison with the residency rule (methods.md s6).

Threshold, two ways:
- ``dE_significance`` (ON/OFF pairs): each pair is a point at its OFF condition's KV p95; it *pays* when
  dE% > Z * SE (a saving beyond noise), else it is within noise (or costs). The threshold is the cut between
  distinct p95 values with the fewest pairs on the wrong side (lowest such cut on a tie); its interval runs
  from the highest within-noise pair below the cut to the lowest paying pair above it, widened by those
  pairs' own KV-p95 intervals (mean ± 1.96 SE over the OFF runs), as the daemon's rule does.
- OFF-only runs: the onset of preemptions and tax, by ``exporter.derive.threshold.locate`` (the daemon's
  rule) over one point per OFF condition.
"""

from __future__ import annotations

import math
from typing import Any

from exporter import rules
from exporter.config import ConfigError
from exporter.derive import offload
from exporter.derive.pressure import quantile
from exporter.derive.pressure_evidence import recorded_evidence
from exporter.derive.threshold import PressurePoint, locate
from exporter.rules import PREEMPTION_ONSET_PER_MINUTE as ONSET

Z = 2.0                       # a saving is significant when dE% > Z * SE (one-sided ~97.7 %)
P95_Z = 1.96                  # a condition's KV p95 interval: mean ± 1.96 SE over its runs
PLATEAU_FRACTION = 0.9        # methods.md s6: a sufficient buffer captures > 90 % of the achievable saving
# methods.md s6, the study's traces; used when the trace cannot be read
DEFAULT_P99_TOOL_LATENCY = rules.P99_TOOL_LATENCY.default
# shown in the plan (a tiered one: its params); ON/OFF is the baseline column
SKIP_KEYS = ("name", "baseline", "args", "env", "tiered")


def _mean(summary: dict, key: str) -> float | None:
    return (summary.get(key) or {}).get("mean")


def _se(summary: dict, key: str) -> float | None:
    return (summary.get(key) or {}).get("se")


# ------------------------------------------------------------------------------------------------------
# parameters: what varies between conditions, read generically from the plan's conditions
# ------------------------------------------------------------------------------------------------------
def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)):
        out[prefix] = " ".join(map(str, value))
    else:
        out[prefix] = value


def parameters(conditions: list[dict]) -> dict[str, dict[str, str]]:
    """condition -> {name: value} for every parameter whose value is not the same in every condition. A
    condition's parameters are its ``params`` (a sweep's axes), then its ``vars``, then its ``workload``
    settings (a name already seen is not repeated: a sweep's vars repeat its params), then anything else it
    carries but its name, baseline, args and env; ``offload`` is left to the baseline column."""
    flat = [_condition_values(c) for c in conditions]
    keys = sorted({k for f in flat for k in f})
    varying = [k for k in keys if len({f.get(k) for f in flat}) > 1]
    return {c["name"]: {k: f[k] for k in varying if k in f} for c, f in zip(conditions, flat)}


def _condition_values(condition: dict) -> dict[str, str]:
    out: dict[str, str] = {}
    for source in ("params", "vars", "workload"):
        for k, v in (condition.get(source) or {}).items():
            if v is not None and not isinstance(v, (dict, list, tuple)):
                out.setdefault(str(k), _shown(v))
    rest: dict[str, Any] = {}
    _flatten({k: v for k, v in condition.items() if k not in SKIP_KEYS + ("params", "vars", "workload")}, "", rest)
    for k, v in rest.items():
        if v is not None:
            out.setdefault(k, _shown(v))
    out.pop("offload", None)
    return out


def _shown(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    text = str(v)
    return text.rsplit("/", 1)[-1] if "/" in text else text   # a trace path: its file name


# ------------------------------------------------------------------------------------------------------
# recomputation tax between OFF conditions (methods.md s4)
# ------------------------------------------------------------------------------------------------------
def _workload_key(condition: dict) -> str:
    """The same workload: every workload setting but the concurrency (the sweep's load axis)."""
    w = {k: v for k, v in (condition.get("workload") or {}).items() if k != "concurrency"}
    return repr(sorted(w.items()))


def off_tax(conditions: list[dict], summaries: list[dict]) -> dict[str, dict]:
    """For each OFF condition (no baseline): its local_compute share minus the low-pressure reference of the
    same workload (the OFF condition with the lowest KV p95 among those without sustained preemptions,
    < 0.5/min; else the lowest KV p95), in ratio units, with SE sqrt(SE_c^2 + SE_ref^2)."""
    by_name = {s["condition"]: s for s in summaries}
    groups: dict[str, list[dict]] = {}
    for c in conditions:
        s = by_name.get(c["name"])
        if not c.get("baseline") and s and _mean(s, "share_local_compute") is not None \
                and _mean(s, "kv_usage_p95_ratio") is not None:
            groups.setdefault(_workload_key(c), []).append(s)
    out = {}
    for members in groups.values():
        calm = [s for s in members if (_mean(s, "preemptions_per_minute") or 0.0) < ONSET.default] or members
        ref = min(calm, key=lambda s: _mean(s, "kv_usage_p95_ratio"))
        r_mean, r_se = _mean(ref, "share_local_compute"), _se(ref, "share_local_compute")
        for s in members:
            se = _se(s, "share_local_compute")
            out[s["condition"]] = {
                "reference": ref["condition"], "tax": _mean(s, "share_local_compute") - r_mean,
                "tax_se": None if s is ref or se is None or r_se is None else math.hypot(se, r_se)}
    return out


# ------------------------------------------------------------------------------------------------------
# the threshold
# ------------------------------------------------------------------------------------------------------
def pair_points(summaries: list[dict]) -> list[dict]:
    """One point per ON/OFF pair with a dE and an SE: at the OFF condition's KV p95."""
    by_name = {s["condition"]: s for s in summaries}
    out = []
    for s in summaries:
        c = s.get("comparison") or {}
        off = by_name.get(s.get("baseline") or "")
        x = _mean(off, "kv_usage_p95_ratio") if off else None
        if x is None or c.get("dE_percent") is None or c.get("dE_se_percent") is None:
            continue
        out.append({"condition": s["condition"], "baseline": off["condition"], "kv_p95": x,
                    "kv_p95_se": _se(off, "kv_usage_p95_ratio") or 0.0,
                    "dE_percent": c["dE_percent"], "dE_se_percent": c["dE_se_percent"],
                    "pays": c["dE_percent"] > Z * c["dE_se_percent"]})
    return sorted(out, key=lambda p: p["kv_p95"])


def significance_boundary(points: list[dict]) -> dict | None:
    """The dE-significance boundary (module docstring), or None without a within-noise pair below a paying
    one (then the sweep did not bracket the threshold)."""
    if not any(p["pays"] for p in points) or all(p["pays"] for p in points):
        return None
    best, cuts = math.inf, []
    for i in range(1, len(points)):
        if points[i]["kv_p95"] <= points[i - 1]["kv_p95"]:
            continue
        wrong = sum(p["pays"] for p in points[:i]) + sum(not p["pays"] for p in points[i:])
        if wrong < best:
            best, cuts = wrong, [i]
        elif wrong == best:
            cuts.append(i)
    if not cuts:
        return None
    i, j = cuts[0], cuts[-1]
    below = [p for p in points[:i] if not p["pays"]]
    above = [p for p in points[j:] if p["pays"]]
    if not below or not above:
        return None
    ratio = (points[i - 1]["kv_p95"] + points[i]["kv_p95"]) / 2
    edge_below = max(below, key=lambda p: p["kv_p95"])
    edge_above = min(above, key=lambda p: p["kv_p95"])
    return {"ratio": ratio, "low": min(edge_below["kv_p95"] - P95_Z * edge_below["kv_p95_se"], ratio),
            "high": max(edge_above["kv_p95"] + P95_Z * edge_above["kv_p95_se"], ratio),
            "method": "dE_significance", "points": len(points), "misplaced": best}


def off_points(conditions: list[dict], summaries: list[dict], tax: dict[str, dict]) -> list[PressurePoint]:
    """One point per OFF condition: its evidence recorded as the means over its runs (each run's figures built by
    the daemon's ``window_evidence``, measure.window_figures; no aggregate spans a condition's runs), weighted by
    its runs."""
    by_name = {s["condition"]: s for s in summaries}
    out = []
    for c in conditions:
        s = by_name.get(c["name"])
        x = _mean(s, "kv_usage_p95_ratio") if s else None
        if c.get("baseline") or x is None or not s["n"]:
            continue
        t = tax.get(c["name"]) or {}
        se = _se(s, "kv_usage_p95_ratio") or 0.0
        ev = recorded_evidence(p95=x, preemptions_per_minute=_mean(s, "preemptions_per_minute"), tax=t.get("tax"),
                               tax_se=t.get("tax_se"),
                               # a usage ratio: its interval never leaves [0, 1]
                               p95_low=max(0.0, x - P95_Z * se), p95_high=min(1.0, x + P95_Z * se))
        out.append(PressurePoint(evidence=ev, weight=float(s["n"])))
    return out


def threshold(conditions: list[dict], summaries: list[dict], tax: dict[str, dict]) -> dict:
    """{located: the threshold the report uses (dE significance first, else the OFF onset) or None,
    dE_significance, onset, pairs (the evidence), reason (why none was located)}."""
    pairs = pair_points(summaries)
    by_de = significance_boundary(pairs)
    found = locate(off_points(conditions, summaries, tax))
    onset = None if found is None else {"ratio": found.ratio, "low": found.low, "high": found.high,
                                        "method": found.method, "points": found.points}
    located = by_de or onset
    reason = ""
    if located is None:
        paying = sum(p["pays"] for p in pairs)
        reason = (f"not located: {len(pairs)} ON/OFF pairs with an SE ({paying} with a significant saving) do not "
                  "bracket a boundary, and the OFF conditions show no onset of preemptions or tax with clean "
                  "conditions below it (at least 3 OFF conditions needed)")
    return {"located": located, "dE_significance": by_de, "onset": onset, "pairs": pairs, "reason": reason}


# ------------------------------------------------------------------------------------------------------
# buffer-size comparison (methods.md s6, the study's s4.2)
# ------------------------------------------------------------------------------------------------------
def p99_tool_latency(condition: dict, cache: dict) -> tuple[float, str]:
    """Seconds and where from: the 99th percentile of the condition's trace's tool latencies x latency_scale,
    or the default 20 s when the trace cannot be read here."""
    from kvwatt_lab.replay.traces import load_sessions

    w = condition.get("workload") or {}
    key = (w.get("trace"), w.get("format", "auto"))
    if key not in cache:
        try:
            sessions = load_sessions(key[0], key[1]) if key[0] else []
            cache[key] = [t.tool_latency_seconds for s in sessions for t in s.turns if t.tool_latency_seconds > 0]
        except ConfigError:
            cache[key] = []
    values = [v * float(w.get("latency_scale", 1.0)) for v in cache[key]]
    if not values:
        return DEFAULT_P99_TOOL_LATENCY, "default (trace not readable)"
    return quantile(values, 0.99), "trace"


def _planned_buffer(condition: dict) -> float | None:
    """Bytes from the condition's ``params.buffer_gib`` (a sweep's buffer axis), when the engine did not
    report its buffer (vllm:cache_config_info without kv_offloading_size)."""
    gib = (condition.get("params") or {}).get("buffer_gib")
    return None if isinstance(gib, bool) or not isinstance(gib, (int, float)) else gib * 2 ** 30


def buffer_comparison(conditions: list[dict], summaries: list[dict]) -> list[dict]:
    """One group per OFF condition with ON conditions at two or more distinct buffer sizes (the engine's
    reported size, else the plan's params.buffer_gib): per ON condition its dE, the residency rule's verdict and whether
    the measured dE reaches the plateau (>= 90 % of the largest buffer's dE)."""
    cond = {c["name"]: c for c in conditions}
    cache: dict = {}
    groups = []
    for off in (c for c in conditions if not c.get("baseline")):
        rows = []
        for s in summaries:
            buf = _mean(s, "offload_buffer_bytes") or _planned_buffer(cond.get(s["condition"], {}))
            c = s.get("comparison") or {}
            if s.get("baseline") != off["name"] or buf is None or c.get("dE_percent") is None:
                continue
            write = _mean(s, "offload_write_bytes_per_second")
            p99, p99_from = p99_tool_latency(cond[s["condition"]], cache)
            res = offload.residency(buf, write)
            short = offload.undersized(res, write, _mean(s, "offload_store_failures"), p99)
            rows.append({"condition": s["condition"], "buffer_bytes": buf, "write_bytes_per_second": write,
                         "residency_seconds": res, "p99_tool_latency_seconds": p99, "p99_from": p99_from,
                         "rule_sufficient": None if short is None else not short,
                         "dE_percent": c["dE_percent"], "dE_se_percent": c.get("dE_se_percent"),
                         "dE_runs_percent": c.get("dE_runs_percent") or [], "n": s["n"]})
        if len({r["buffer_bytes"] for r in rows}) < 2:
            continue
        rows.sort(key=lambda r: r["buffer_bytes"])
        plateau = rows[-1]["dE_percent"]
        for r in rows:
            r["captured"] = r["dE_percent"] / plateau if plateau > 0 else None
            r["reaches_plateau"] = None if r["captured"] is None else r["captured"] >= PLATEAU_FRACTION
            r["rule_agrees"] = (None if r["rule_sufficient"] is None or r["reaches_plateau"] is None
                                else r["rule_sufficient"] == r["reaches_plateau"])
        writes = [r["write_bytes_per_second"] for r in rows if r["write_bytes_per_second"]]
        groups.append({"baseline": off["name"], "plateau_dE_percent": plateau, "rows": rows,
                       "rule_buffer_bytes": offload.recommended_buffer(max(writes) if writes else None,
                                                                       rows[0]["p99_tool_latency_seconds"], 1.0)})
    return groups
