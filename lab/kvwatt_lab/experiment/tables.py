"""The report's tables: (title, header, rows) with units in the headers and "mean ± SE" numbers in the cells
(docs/experiment.md "Tables"). ``found`` is the report's analysis (report.analyse: parameters, tax, threshold,
buffers)."""

from __future__ import annotations

from kvwatt_lab.experiment import stats

NA = "n/a"


# ------------------------------------------------------------------------------------------------------
# formatting: units live in the headers, cells hold numbers ("94.0 ± 0.6")
# ------------------------------------------------------------------------------------------------------
def num(value: float | None, digits: int = 3) -> str:
    return NA if value is None else f"{value:.{digits}g}"


def pct(ratio: float | None) -> str:
    return NA if ratio is None else f"{ratio * 100:.1f}"


def pct_unit(ratio: float | None) -> str:
    """A percentage in running text (tables keep the unit in the header)."""
    return NA if ratio is None else f"{pct(ratio)} %"


def _fmt(fmt: str, value: float) -> str:
    """Formatted, without a "-0.0" for a value that rounds to zero."""
    text = fmt.format(value)
    return fmt.format(0.0) if text.startswith("-") and not text.strip("-+0.") else text


def _pm(mean: float | None, se: float | None, fmt: str = "{:+.1f}", se_fmt: str = "{:.1f}") -> str:
    if mean is None:
        return NA
    return f"{_fmt(fmt, mean)} ± {NA if se is None else se_fmt.format(se)}"


def _stat(summary: dict, key: str) -> tuple[float | None, float | None]:
    s = summary.get(key) or {}
    return s.get("mean"), s.get("se")


def _pm_pct(summary: dict, key: str) -> str:
    mean, se = _stat(summary, key)
    return _pm(None if mean is None else mean * 100, None if se is None else se * 100, "{:.1f}", "{:.1f}")


def _pm_g(summary: dict, key: str) -> str:
    return _pm(*_stat(summary, key), "{:.3g}", "{:.2g}")


def _regime(kv: float | None, threshold: float) -> str:
    """The landing page's words: above / below the threshold."""
    return NA if kv is None else ("above" if kv > threshold else "below")


def _mflops(summary: dict) -> str:
    """FLOPs per generated token in MFLOP (the tiny CPU model's ~2 MFLOP per token reads as 2.0)."""
    mean, se = _stat(summary, "flops_per_generated_token")
    return _pm(None if mean is None else mean / 1e6, None if se is None else se / 1e6, "{:.3g}", "{:.2g}")


def _mib(summary: dict, key: str) -> str:
    mean, se = _stat(summary, key)
    return _pm(None if mean is None else mean / 2 ** 20, None if se is None else se / 2 ** 20, "{:.3g}", "{:.2g}")


def _has(summaries: list[dict], key: str) -> bool:
    return any(_stat(s, key)[0] is not None for s in summaries)


def energy_words(plan: dict) -> str:
    """", power double" in the energy columns' headers when a power double stood in for the energy sources."""
    return ", power double" if (plan.get("energy") or {}).get("power_double") else ""


def _params(model_params: dict[str, dict[str, str]], name: str) -> str:
    return ", ".join(f"{k}={v}" for k, v in model_params.get(name, {}).items()) or "–"


# ------------------------------------------------------------------------------------------------------
# tables: (title, header, rows)
# ------------------------------------------------------------------------------------------------------
def regime_threshold(plan: dict, found: dict) -> tuple[float, str]:
    located = found["threshold"]["located"]
    return (located["ratio"], "located") if located else (plan["kv_pressure_threshold"], "configured")


def table1(summaries: list[dict], plan: dict, found: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """The study's Table 1 (one row per ON/OFF pair, by the OFF condition's KV p95: KV p95, regime and
    preemptions per minute of the OFF condition, dE %, dTPS %, each ± SE; preemptions per minute everywhere,
    the daemon's unit), then every condition's own figures."""
    threshold, kind = regime_threshold(plan, found)
    params = found["parameters"]
    has_params = any(params.values())
    regime = f"regime ({kind} threshold {threshold * 100:.1f} %)"
    by_name = {s["condition"]: s for s in summaries}
    pairs = sorted((s for s in summaries if s.get("comparison") and s["baseline"] in by_name),
                   key=lambda s: _stat(by_name[s["baseline"]], "kv_usage_p95_ratio")[0] or 0.0)
    flops = _has(summaries, "flops_per_generated_token")   # with --enable-mfu-metrics
    out = []
    if pairs:
        header = (["condition (ON vs OFF)"] + (["parameters (ON)"] if has_params else [])
                  + ["OFF KV p95 (%)", regime, "OFF preemptions per minute"]
                  + (["OFF FLOPs per generated token (MFLOP)", "ON FLOPs per generated token (MFLOP)"] if flops else [])
                  + [f"dE (%{energy_words(plan)})", "dTPS (%)", "n (ON / OFF runs)"])
        rows = []
        for s in pairs:
            off, c = by_name[s["baseline"]], s["comparison"]
            rows.append([f"{s['condition']} vs {off['condition']}"]
                        + ([_params(params, s["condition"])] if has_params else [])
                        + [_pm_pct(off, "kv_usage_p95_ratio"), _regime(_stat(off, "kv_usage_p95_ratio")[0], threshold),
                           _pm_g(off, "preemptions_per_minute")]
                        + ([_mflops(off), _mflops(s)] if flops else [])
                        + [_pm(c["dE_percent"], c["dE_se_percent"]),
                           _pm(c["dTPS_percent"], c["dTPS_se_percent"]), f"{s['n']} / {off['n']}"])
        out.append(("Table 1: the saving of offloading by KV pressure (ON/OFF pairs, by the OFF condition's KV p95)",
                    header, rows))
    out.append(conditions_table(summaries, plan, found, threshold, regime,
                                "Table 1b: every condition's own figures" if pairs else
                                "Table 1: KV pressure, throughput and energy per token by condition"))
    return out


def conditions_table(summaries: list[dict], plan: dict, found: dict, threshold: float, regime: str,
                     title: str) -> tuple[str, list[str], list[list[str]]]:
    basis = plan["energy"]["basis"]
    scopes = {s["energy_scope"] for s in summaries if s.get("energy_scope")}
    mixed = len(scopes) > 1
    params = found["parameters"]
    has_params = any(params.values())
    flops = _has(summaries, "flops_per_generated_token")
    double = energy_words(plan)
    header = (["condition", "baseline"] + (["parameters"] if has_params else [])
              + ["KV p95 (%)", regime, "preemptions per minute", "tokens/s"]
              + (["FLOPs per generated token (MFLOP)"] if flops else [])
              + [f"J/token ({basis}, "
                 f"{'scope per row' if mixed else (next(iter(scopes)) if scopes else 'n/a')}{double})"]
              + (["energy scope"] if mixed else []) + [f"dE (%{double})", "dTPS (%)", "n (ON / OFF runs)"])
    rows, by_name = [], {s["condition"]: s for s in summaries}
    for s in summaries:
        jpt = s["joules_per_token"] or {}
        c = s.get("comparison")
        row = [s["condition"], s["baseline"] or "–"] + ([_params(params, s["condition"])] if has_params else [])
        row += [_pm_pct(s, "kv_usage_p95_ratio"), _regime(_stat(s, "kv_usage_p95_ratio")[0], threshold),
                _pm_g(s, "preemptions_per_minute"), _pm(*_stat(s, "tokens_per_second"), "{:.1f}")]
        row += [_mflops(s)] if flops else []
        row += [_pm(jpt.get("mean"), jpt.get("se"), "{:#.3g}", "{:.2g}")]
        row += [s["energy_scope"] or NA] if mixed else []
        row += [_pm(c["dE_percent"], c["dE_se_percent"]) if c else NA,
                _pm(c["dTPS_percent"], c["dTPS_se_percent"]) if c else NA,
                f"{s['n']} / {by_name[s['baseline']]['n']}" if c and s["baseline"] in by_name else str(s["n"])]
        rows.append(row)
    return title, header, rows


def table2(summaries: list[dict], found: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """The study's Table 2 (token-source shares OFF vs ON per pair), then every OFF condition's shares and
    its recomputation tax against the same workload's low-pressure reference (methods.md s4)."""
    by_name = {s["condition"]: s for s in summaries}
    paired = [s for s in summaries if s.get("baseline") and s["baseline"] in by_name]
    tables = []
    if paired:
        header = ["condition", "OFF compute (%)", "OFF cache (%)", "ON compute (%)", "ON cache (%)",
                  "ON external (%)", "n (ON / OFF runs)"]
        rows = []
        for s in paired:
            off = by_name[s["baseline"]]
            rows.append([f"{s['condition']} vs {s['baseline']}", _pm_pct(off, "share_local_compute"),
                         _pm_pct(off, "share_local_cache_hit"), _pm_pct(s, "share_local_compute"),
                         _pm_pct(s, "share_local_cache_hit"), _pm_pct(s, "share_external_kv_transfer"),
                         f"{s['n']} / {off['n']}"])
        tables.append(("Table 2: token-source decomposition, OFF vs ON (shares of prompt tokens)", header, rows))
        beyond = beyond_first_prefill(paired, by_name)
        if beyond:
            tables.append(beyond)
    off_conditions = [s for s in summaries if not s.get("baseline")]
    if off_conditions:
        tax = found["tax"]
        header = ["condition", "KV p95 (%)", "preemptions per minute", "compute (%)", "cache (%)", "external (%)",
                  "recomputation tax (pp)", "tax reference", "n (runs)"]
        rows = []
        for s in off_conditions:
            t = tax.get(s["condition"]) or {}
            if t.get("reference") == s["condition"]:
                tax_cell = "0 (reference)"
            else:
                tax_cell = NA if t.get("tax") is None else _pm(t["tax"] * 100, None if t.get("tax_se") is None
                                                               else t["tax_se"] * 100)
            rows.append([s["condition"], _pm_pct(s, "kv_usage_p95_ratio"), _pm_g(s, "preemptions_per_minute"),
                         _pm_pct(s, "share_local_compute"), _pm_pct(s, "share_local_cache_hit"),
                         _pm_pct(s, "share_external_kv_transfer"), tax_cell, t.get("reference") or NA, str(s["n"])])
        title = ("Table 2b: OFF conditions, token sources and the recomputation tax between them" if paired else
                 "Table 2: token-source decomposition and recomputation tax by condition (shares of prompt tokens)")
        tables.append((title, header, rows))
    return tables


def beyond_first_prefill(paired: list[dict], by_name: dict) -> tuple[str, list[str], list[list[str]]] | None:
    """Table 2c: what Table 2 cannot count. vLLM 0.32 counts a request's FIRST prefill only, so a preempted
    request's re-prefill (recomputed OFF, reloaded from the offload tier ON) is in no share of Table 2; it shows in
    vLLM's FLOPs estimate per generated token and in the tier's loads (vllm:kv_offload_load_bytes). None when
    the runs have neither (no --enable-mfu-metrics, no offload tier)."""
    flops = _has(paired + [by_name[s["baseline"]] for s in paired], "flops_per_generated_token")
    loads = _has(paired, "offload_read_bytes_per_second") or _has(paired, "offload_write_bytes_per_second")
    if not flops and not loads:
        return None
    header = (["condition", "OFF preemptions per minute", "ON preemptions per minute"]
              + (["OFF FLOPs per generated token (MFLOP)", "ON FLOPs per generated token (MFLOP)", "dFLOPs (%)"]
                 if flops else [])
              + (["ON offload loads (MiB/s)", "ON offload stores (MiB/s)"] if loads else []) + ["n (ON / OFF runs)"])
    rows = []
    for s in paired:
        off, c = by_name[s["baseline"]], s.get("comparison") or {}
        rows.append([f"{s['condition']} vs {s['baseline']}", _pm_g(off, "preemptions_per_minute"),
                     _pm_g(s, "preemptions_per_minute")]
                    + ([_mflops(off), _mflops(s), _pm(c.get("dFLOPs_percent"), c.get("dFLOPs_se_percent"))]
                       if flops else [])
                    + ([_mib(s, "offload_read_bytes_per_second"), _mib(s, "offload_write_bytes_per_second")]
                       if loads else []) + [f"{s['n']} / {off['n']}"])
    return ("Table 2c: beyond the first prefill (the re-prefill after preemption that Table 2 does not count: "
            "vLLM's FLOPs estimate and the offload tier's traffic)", header, rows)


def threshold_tables(found: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    th = found["threshold"]
    rows = []
    for key, what in (("dE_significance", "boundary between within-noise and significant dE (ON/OFF pairs)"),
                      ("onset", "onset of preemptions and recomputation tax (OFF conditions)")):
        t = th[key]
        rows.append([what, NA if not t else pct(t["ratio"]),
                     NA if not t else f"{pct(t['low'])} – {pct(t['high'])}",
                     NA if not t else t["method"], NA if not t else str(t["points"]),
                     "used" if t and t is th["located"] else ("–" if t else "not located")])
    out = [("Threshold located from the sweep", ["evidence", "KV p95 threshold (%)", "interval (%)", "method",
                                                  "points", "in the report"], rows)]
    if th["pairs"]:
        z = found["z"]
        out.append(("Threshold evidence: ON/OFF pairs by OFF KV p95",
                    ["pair", "OFF KV p95 (%)", "dE (%)", f"significant saving (dE > {z:g} SE)"],
                    [[f"{p['condition']} vs {p['baseline']}", pct(p["kv_p95"]),
                      _pm(p["dE_percent"], p["dE_se_percent"]), "yes" if p["pays"] else "no"] for p in th["pairs"]]))
    return out


def buffer_tables(found: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    out = []
    for g in found["buffers"]:
        header = ["condition", "buffer (GiB)", "write rate (GiB/s)", "residency (s)", "p99 tool latency (s)",
                  "rule: residency >= p99", "dE (%)", "of plateau (%)", "plateau reached (>= 90 %)",
                  "rule agrees", "n (runs)"]
        yes_no = lambda v: NA if v is None else ("yes" if v else "no")  # noqa: E731
        rows = [[r["condition"], num(r["buffer_bytes"] / 2 ** 30),
                 NA if r["write_bytes_per_second"] is None else f"{r['write_bytes_per_second'] / 2 ** 30:.3g}",
                 num(r["residency_seconds"]), f"{r['p99_tool_latency_seconds']:.3g}"
                 + ("" if r["p99_from"] == "trace" else " (default)"),
                 {True: "sufficient", False: "undersized", None: NA}[r["rule_sufficient"]],
                 _pm(r["dE_percent"], r["dE_se_percent"]), pct(r["captured"]), yes_no(r["reaches_plateau"]),
                 yes_no(r["rule_agrees"]), str(r["n"])] for r in g["rows"]]
        out.append((f"Buffer size against {g['baseline']} (plateau: dE of the largest buffer, "
                    f"{g['plateau_dE_percent']:+.1f} %)", header, rows))
    return out


def runs_table(data: dict, scope: str, basis: str) -> tuple[str, list[str], list[list[str]]]:
    header = ["run", "condition", "KV p95 (%)", "preemptions per minute", "tokens/s", f"J/token ({basis})",
              "energy scope", "local_compute (%)", "startup (s)"]
    rows = []
    for run in ordered_runs(data):
        w = run.get("window", {})
        chosen = stats.choose_scope([run], scope, basis)
        jpt = stats.joules_per_token(run, chosen, basis) if chosen else None
        rows.append([run["run"], run["condition"], pct(w.get("kv_usage_p95_ratio")),
                     num(w.get("preemptions_per_minute")), num(w.get("tokens_per_second"), 4),
                     NA if jpt is None else f"{jpt:.4g}", chosen or NA,
                     pct(stats.share(run, "local_compute")), num(run.get("startup_seconds"))])
    return "Runs (in the order they ran)", header, rows


def ordered_runs(data: dict) -> list[dict]:
    return [data["finished"][r["run_id"]] for r in data["order"] if r["run_id"] in data["finished"]]


# ------------------------------------------------------------------------------------------------------
# rendering


# ------------------------------------------------------------------------------------------------------
# tiered conditions (kvwatt_lab/experiment/tiers.py): computed from the analysis' per-condition totals
# ------------------------------------------------------------------------------------------------------
def _kib(n_bytes: float | None) -> str:
    return NA if n_bytes is None else f"{n_bytes / 1024:,.0f}"


def _per_s(value: float | None, seconds: float | None) -> str:
    return NA if value is None or not seconds else f"{value / seconds:.3g}"


def tier_tables(tier: dict | None, summaries: list[dict]) -> list[tuple[str, list[str], list[list[str]]]]:
    """Table T1 (traffic per tier), T2 (tokens by source, stalls and energy per condition, dE of each tier added)
    and T3 (the break-even per tier); none without a tiered condition."""
    if not tier:
        return []
    return [_tier_traffic(tier), _tier_energy(tier, summaries), _tier_break_even(tier)]


def _tier_traffic(tier: dict) -> tuple[str, list[str], list[list[str]]]:
    rows = []
    for name, entry in tier["conditions"].items():
        t = entry["totals"]
        if not entry.get("tiered"):
            continue
        secs = t.get("seconds")
        link = t["link"]
        rows.append([name, "GPU <-> CPU tier (link)", _kib(link.get("store_bytes")), _kib(link.get("load_bytes")),
                     _per_s(link.get("load_bytes"), secs), NA, NA, NA, NA])
        for label, x in t["tiers"].items():
            rows.append([name, label, _kib(x.get("write_bytes")), _kib(x.get("read_bytes")),
                         _per_s(x.get("read_bytes"), secs), pct(x.get("hit_ratio")),
                         num(x.get("dropped_stores"), 4), num(x.get("dropped_blocks"), 6),
                         pct(x.get("dropped_block_share"))])
    return ("Table T1. Traffic per tier over the measurement windows (writes: stores into the tier, GPU -> CPU or "
            "CPU -> disk cascades; reads: reloads out of it, CPU -> GPU or disk -> CPU promotions; dropped: vLLM's "
            "back-pressure detector's stores and blocks kept from the tier)",
            ["condition", "tier", "written KiB", "read (reload) KiB", "read B/s", "chunk hit ratio %",
             "dropped stores", "dropped blocks", "dropped % of blocks bound for it"], rows)


def _tier_energy(tier: dict, summaries: list[dict]) -> tuple[str, list[str], list[list[str]]]:
    by = {s["condition"]: s for s in summaries}
    rows = []
    for name, entry in tier["conditions"].items():
        t, s = entry["totals"], by.get(name) or {}
        cached = t.get("cached_tokens") or {}
        c = s.get("comparison") or {}
        v = entry.get("versus_comparison") or {}
        rows.append([name, num(t.get("local_compute"), 6), num(cached.get("device"), 6), num(cached.get("host"), 6),
                     num(cached.get("disk"), 6), _pm(*_stat(entry, "ttft_p50_seconds"), "{:.3f}", "{:.2g}"),
                     _pm(*_stat(entry, "ttft_p95_seconds"), "{:.3f}", "{:.2g}"), _pm_g(s, "joules_per_token"),
                     NA if not s.get("baseline") else f"{_pm(c.get('dE_percent'), c.get('dE_se_percent'))} "
                                                       f"vs {s['baseline']}",
                     NA if not entry.get("versus") else f"{_pm(v.get('dE_percent'), v.get('dE_se_percent'))} "
                                                        f"vs {entry['versus']}"])
    return ("Table T2. Prompt tokens by source (computed; cached on the device, in the CPU tier, on disk), the "
            "time to first token (each new prompt waits on the tiers' lookups) and the energy per generated token "
            "with dE of each tier added",
            ["condition", "computed tokens", "device tokens", "host tokens", "disk tokens", "TTFT p50 s",
             "TTFT p95 s", "J/token", "dE %", "dE % (tier added)"], rows)


def _tier_break_even(tier: dict) -> tuple[str, list[str], list[list[str]]]:
    costs = tier["costs"]
    rows = []
    for name, entry in tier["conditions"].items():
        for r in entry["break_even"]:
            b = r["bytes_per_token"]
            rows.append([name, r["tier"], num(r["tokens"], 6), num(r["kappa"]),
                         " + ".join(f"{hop} {num(v)}" for hop, v in b.items()),
                         num(r["price_j"]), num(r["all_in_price_j"]), num(r["prompt_computed_j"]), num(r["ratio"]),
                         num(r["all_in_ratio"]), NA if r["pays"] is None else ("reload" if r["pays"] else "recompute")])
    fit = (f"c_p {costs['source']} ({costs['state']}, {costs['windows']} windows"
           + (f"; {costs['reason']}" if costs.get("reason") else "") + ")")
    return (f"Table T3. Break-even per tier: the price of a token reloaded from the tier (bytes per token on each "
            f"hop x the hop's J per byte, the power double's configured costs) against the J per computed prompt "
            f"token c_p ({fit}); a reload pays when price / c_p < 1 (methods.md s7)",
            ["condition", "tier", "tokens served", "kappa (per computed token)", "bytes per token (per hop)",
             "price J/token", "all-in J/token (with its stores)", "c_p J/token", "price / c_p", "all-in / c_p",
             "cheaper"], rows)
