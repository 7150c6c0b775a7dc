"""The experiment's report from its state file: Table 1 (KV p95, preemptions, tokens/s, J/token, dE% and
dTPS%, each ± SE, n), Table 2 (token-source decomposition OFF vs ON, and the recomputation tax between OFF
conditions), the threshold located from the sweep with its evidence, the buffer-size comparison, figures
(plots.py) and per-run rows (docs/experiment.md "Report"). Written as report.md,
report.html (images referenced relatively), runs.csv, conditions.csv and report.json in the output directory.

Runnable alone:  python -m kvwatt_lab.experiment.report OUT_DIR   (or: kvwatt experiment PLAN --report-only)
"""

from __future__ import annotations

import csv
import html
import io
import json
import os
import sys
import time
from typing import Any, Callable

from exporter.config import ConfigError
from exporter.derive.recompute import SOURCES
from exporter.runtime import atomic
from kvwatt_lab.experiment import analysis, plots, stats, tables, tiers
from kvwatt_lab.experiment.power_double import PowerModel
from kvwatt_lab.experiment.tables import NA, num, pct_unit


# ------------------------------------------------------------------------------------------------------
def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    esc: Callable[[str], str] = lambda c: c.replace("|", "\\|")
    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines)


def html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def status_lines(data: dict) -> list[str]:
    done, planned = len(data["finished"]), len(data["order"])
    lines = [f"Runs finished: {done} of {planned}."]
    if data.get("failed"):
        error = data["failed"]["error"].splitlines()[0]
        lines.append(f"INCOMPLETE: run {data['failed']['run']} failed: {error}")
    elif data.get("in_progress"):
        lines.append(f"INCOMPLETE: run {data['in_progress']['run']} was interrupted (redone by --resume).")
    elif done < planned:
        lines.append("INCOMPLETE: runs are still pending (kvwatt experiment PLAN --resume).")
    return lines


def method_lines(plan: dict) -> list[str]:
    e, p = plan["energy"], plan["phases"]
    return [
        f"Protocol per run: server started, /health, {p['settle_seconds']:g} s settle, {p['idle_seconds']:g} s "
        f"idle baseline, {p['warmup_seconds']:g} s warm-up, {p['measure_seconds']:g} s measurement, "
        f"{p['cooldown_seconds']:g} s cool-down, server stopped; {plan['repeats']} repeats, order shuffled "
        f"in blocks with seed {plan['seed']}; samples every {plan['sample_interval_seconds']:g} s.",
        f"J/token: {e['basis']} "
        f"({'(E - P_idle*dt) / generated tokens' if e['basis'] == 'marginal' else 'E / generated tokens'}), "
        f"scope {e['scope']} (auto: gpu when every run has it, else host). dE% = (J/tok_OFF - J/tok_ON) / "
        "J/tok_OFF * 100; dTPS% = (TPS_ON - TPS_OFF) / TPS_OFF * 100; ± is the delta-method SE "
        "100 * (x_ON/x_OFF) * sqrt((SE_ON/x_ON)^2 + (SE_OFF/x_OFF)^2) over runs (methods.md s2); n = runs ON / OFF.",
        "KV p95: 95th percentile of vllm:kv_cache_usage_perc over the window's dense samples, ± its SE over "
        "runs; regime: 'above' or 'below' the threshold (the located one when the sweep locates it, else the "
        f"configured {plan['kv_pressure_threshold']:.2f}). Preemptions: vllm:num_preemptions_total increase over the "
        "window divided by its covered minutes (preemptions per minute, the daemon's unit, in every table and "
        "figure). Shares: vllm:prompt_tokens_by_source_total over the window (first prefills only: re-prefill after "
        "preemption is not counted by vLLM). Recomputation tax: an OFF condition's local_compute share minus that "
        "of the same workload's lowest-pressure OFF condition without sustained preemptions (methods.md s4), in "
        "percentage points, SE combined in quadrature.",
        f"Threshold: with ON/OFF pairs, the KV-p95 cut that best separates pairs whose saving is significant "
        f"(dE > {analysis.Z:g} SE) from those within noise, interval from the highest within-noise pair below to "
        "the lowest significant pair above; otherwise the onset of preemptions (>= 0.5/min) or a tax above noise "
        "among the OFF conditions (exporter.derive.threshold, the daemon's rule). Buffer rule (methods.md s6): "
        "residency = buffer / offload write rate >= the trace's p99 tool latency; the plateau is the dE of the "
        f"largest buffer, reached at >= {analysis.PLATEAU_FRACTION * 100:.0f} % of it.",
    ]


def threshold_line(model: dict) -> str:
    th = model["analysis"]["threshold"]
    t = th["located"]
    if not t:
        return f"Threshold {th['reason']}; the regime uses the configured {model['kv_pressure_threshold']:.2f}."
    return (f"Threshold located from the sweep at KV p95 {t['ratio'] * 100:.1f} % (interval {t['low'] * 100:.1f}–"
            f"{t['high'] * 100:.1f} %), by {t['method']} over {t['points']} points.")


def analyse(plan: dict, summaries: list[dict]) -> dict:
    conditions = plan["conditions"]
    tax = analysis.off_tax(conditions, summaries)
    return {"z": analysis.Z, "parameters": analysis.parameters(conditions), "tax": tax,
            "threshold": analysis.threshold(conditions, summaries, tax),
            "buffers": analysis.buffer_comparison(conditions, summaries)}


def build(data: dict) -> dict:
    """The report model: everything the writers render."""
    plan = data["plan"]
    summaries = stats.summarize(plan, data["finished"])
    found = analyse(plan, summaries)
    found["tiers"] = tiers.tier_analysis(plan, data["finished"], summaries)
    scope, basis = plan["energy"]["scope"], plan["energy"]["basis"]
    model = {"experiment": plan["name"], "plan_path": plan["path"],
             "protocol_fingerprint": data["fingerprints"]["protocol"],
             "generated_unix": time.time(), "status": status_lines(data), "method": method_lines(plan),
             "complete": not data.get("failed") and len(data["finished"]) == len(data["order"]),
             "kv_pressure_threshold": plan["kv_pressure_threshold"], "energy_basis": basis, "repeats": plan["repeats"],
             "conditions": summaries, "analysis": found,
             "tables": [*tables.table1(summaries, plan, found), *tables.table2(summaries, found),
                        *tables.threshold_tables(found), *tables.buffer_tables(found),
                        *tables.tier_tables(found["tiers"], summaries),
                        tables.runs_table(data, scope, basis)],
             "runs": [flatten_run(r) for r in tables.ordered_runs(data)],
             "failed": data.get("failed"), "in_progress": data.get("in_progress")}
    model["synthetic_runs"] = synthetic_runs(data)
    model["power_double"] = power_double_line(plan)
    table_2c = any(t[0].startswith("Table 2c") for t in model["tables"])
    model["summary"] = ([threshold_line(model)] + ([model["power_double"]] if model["power_double"] else [])
                        + first_prefill_lines(data, table_2c)
                        + synthetic_lines(model["synthetic_runs"], len(data["finished"])))
    return model


def power_double_line(plan: dict) -> str:
    """The report's words when a power double stood in for the energy sources (energy.power_double): every
    J/token, dE and energy figure is the double's, and says so."""
    double = (plan.get("energy") or {}).get("power_double")
    if not double:
        return ""
    return (f"ENERGY FROM A POWER DOUBLE, not measured: {PowerModel(**double).costs()}; every J/token and dE here is "
            "the double's (marked 'power double').")


def first_prefill_lines(data: dict, table_2c: bool) -> list[str]:
    """What vLLM 0.32's first-prefill counting means for Table 2: when some run preempted, what its shares miss;
    when none did and the runs carry what would show it (Table 2c), that they miss nothing."""
    preempted = sum((r.get("window") or {}).get("preemptions") or 0 for r in data["finished"].values())
    if not preempted:
        return ["No run preempted in its measurement window: Table 2's shares (vLLM 0.32 counts a request's first "
                "prefill only) miss no re-prefill here."] if table_2c and data["finished"] else []
    return [f"{preempted:.0f} preemptions in the measurement windows: vLLM 0.32 counts a request's first prefill "
            "only, so the re-prefill of a preempted request (recomputed OFF, reloaded from the offload tier ON) is in "
            "no share of Table 2, which therefore understates the recomputation OFF and the reloads ON"
            + ("; Table 2c shows that work in vLLM's FLOPs estimate per generated token and in the offload tier's "
               "traffic." if table_2c else " (run the engine with --enable-mfu-metrics to see it in FLOPs).")]


def synthetic_runs(data: dict) -> int:
    """Runs whose result carries ``"synthetic": true`` (made up by a test or a demo, not measured): the figures
    say so in their titles, the report in its summary."""
    return sum(1 for r in data["finished"].values() if r.get("synthetic"))


def synthetic_lines(synthetic: int, finished: int) -> list[str]:
    if not synthetic:
        return []
    return [f"SYNTHETIC DATA: {synthetic} of {finished} runs are synthetic (not measured on an engine)."]


def _split_tables(tables: list) -> tuple[list, list]:
    """The result tables, then the long per-run listing (after the figures)."""
    runs = [t for t in tables if t[0].startswith("Runs")]
    return [t for t in tables if t not in runs], runs


def render_markdown(model: dict, images: dict[str, str]) -> str:
    out = [f"# Experiment report: {model['experiment']}", "",
           f"Plan `{model['plan_path']}` (protocol {model['protocol_fingerprint'][:12]}).", ""]
    out += [f"**{line}**" if line.startswith("INCOMPLETE") else line for line in model["status"]] + [""]
    out += model["summary"] + [""]
    main, runs = _split_tables(model["tables"])
    for title, header, rows in main:
        out += [f"## {title}", "", markdown_table(header, rows), ""]
    if images:
        out += ["## Figures", ""]
        for path, caption in images.items():
            out += [f"![{caption}]({path})", "", f"*{caption}*", ""]
    out += [f"Not drawn: {name}: {why}." for name, why in model.get("skipped_figures", {}).items()]
    for title, header, rows in runs:
        out += ["", f"## {title}", "", markdown_table(header, rows)]
    out += ["", "## Method", ""] + [f"- {line}" for line in model["method"]] + [""]
    out += ["Machine-readable: `runs.csv`, `conditions.csv`, `report.json`; per run: `runs/<run>/` (result.json, "
            "intervals.jsonl, turns.jsonl, server.log).", ""]
    return "\n".join(out)


def render_html(model: dict, images: dict[str, str]) -> str:
    parts = [f"<h1>Experiment report: {html.escape(model['experiment'])}</h1>",
             f"<p>Plan <code>{html.escape(model['plan_path'])}</code>"
             f" (protocol {model['protocol_fingerprint'][:12]}).</p>"]
    warn = ' class="warn"'
    parts += [f"<p{warn if line.startswith('INCOMPLETE') else ''}>{html.escape(line)}</p>" for line in model["status"]]
    parts += [f"<p><strong>{html.escape(line)}</strong></p>" for line in model["summary"]]
    main, runs = _split_tables(model["tables"])
    for title, header, rows in main:
        parts += [f"<h2>{html.escape(title)}</h2>", html_table(header, rows)]
    if images:
        parts += ["<h2>Figures</h2>"] + [f'<figure><img src="{html.escape(p)}" alt="{html.escape(a)}">'
                                         f"<figcaption>{html.escape(a)}</figcaption></figure>"
                                         for p, a in images.items()]
    parts += [f"<p>Not drawn: {html.escape(n)}: {html.escape(w)}.</p>"
              for n, w in model.get("skipped_figures", {}).items()]
    for title, header, rows in runs:
        parts += [f"<h2>{html.escape(title)}</h2>", html_table(header, rows)]
    parts += ["<h2>Method</h2><ul>" + "".join(f"<li>{html.escape(l)}</li>" for l in model["method"]) + "</ul>"]
    style = ("body{font-family:sans-serif;max-width:90em;margin:2em auto;padding:0 1em}"
             "table{border-collapse:collapse;margin-bottom:1em}th{vertical-align:bottom}"
             "td,th{border:1px solid #bbb;padding:.2em .5em;text-align:right}td{white-space:nowrap}"
             "td:first-child,th:first-child{text-align:left}"
             ".warn{color:#a00;font-weight:bold}img{max-width:100%}figcaption{font-size:.9em;color:#333}")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(model['experiment'])}</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")


# ------------------------------------------------------------------------------------------------------
# machine-readable
# ------------------------------------------------------------------------------------------------------
def flatten_run(run: dict) -> dict[str, Any]:
    w = run.get("window", {})
    row: dict[str, Any] = {"run": run["run"], "condition": run["condition"], "repeat": run["repeat"],
                           "startup_seconds": run.get("startup_seconds")}
    for key in ("covered_seconds", "kv_usage_p95_ratio", "kv_usage_max_ratio", "preemptions",
                "preemptions_per_minute", "generation_tokens", "prompt_tokens", "tokens_per_second",
                "flops_per_generated_token", "offload_write_bytes_per_second", "offload_read_bytes_per_second"):
        row[key] = w.get(key)
    for src in SOURCES:
        row[f"prompt_{src}_tokens"] = (w.get("prompt_tokens_by_source") or {}).get(src)
        row[f"share_{src}"] = stats.share(run, src)
    for scope in ("gpu", "host"):
        e = (w.get("energy") or {}).get(scope) or {}
        for key in ("energy_joules", "idle_joules", "joules_per_token", "marginal_joules_per_token"):
            row[f"{scope}_{key}"] = e.get(key)
    replay = run.get("replay") or {}
    for key in ("requests", "ok", "failed", "cancelled", "output_tokens_per_second"):
        row[f"replay_{key}"] = replay.get(key)
    server = run.get("server") or {}
    row["num_gpu_blocks"], row["offload_enabled"] = server.get("num_gpu_blocks"), server.get("offload_enabled")
    return row


def flatten_condition(s: dict) -> dict[str, Any]:
    row: dict[str, Any] = {"condition": s["condition"], "baseline": s["baseline"], "n": s["n"]}
    for key in list(stats.METRICS) + ["joules_per_token", "joules_per_token_total", "joules_per_token_marginal"]:
        st = s.get(key) or {}
        row[f"{key}_mean"], row[f"{key}_se"] = st.get("mean"), st.get("se")
    row["energy_scope"], row["energy_basis"] = s["energy_scope"], s["energy_basis"]
    c = s.get("comparison") or {}
    for key in ("dE_percent", "dE_se_percent", "dTPS_percent", "dTPS_se_percent", "n_on", "n_off"):
        row[key] = c.get(key)
    return row


def to_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------------------
def write_report(out_dir: str, data: dict) -> list[str]:
    """Write every report file atomically; the paths written."""
    model = build(data)
    images = plots.write_plots(os.path.join(out_dir, "plots"), model)
    images = {os.path.relpath(p, out_dir): alt for p, alt in images.items()}
    model["skipped_figures"] = plots.skipped(model, [os.path.basename(p) for p in images])
    files = {"report.md": render_markdown(model, images), "report.html": render_html(model, images),
             "runs.csv": to_csv(model["runs"]),
             "conditions.csv": to_csv([flatten_condition(s) for s in model["conditions"]]),
             "report.json": json.dumps({k: v for k, v in model.items() if k != "tables"}, indent=2, default=str) + "\n"}
    paths = []
    for name, text in files.items():
        path = os.path.join(out_dir, name)
        atomic.write_text(path, text)
        paths.append(path)
    return paths + [os.path.join(out_dir, p) for p in images]


def write_safely(out_dir: str, data: dict, say: Callable[[str], None]) -> None:
    """During an experiment a report failure must not lose the runs: say it and go on."""
    try:
        write_report(out_dir, data)
    except plots.MissingDependency:
        raise  # loud: the experiment cannot deliver its report (exit 2 with the command that installs it)
    except Exception as e:  # noqa: BLE001 - the runs matter more than the report
        say(f"warning: the report could not be written ({type(e).__name__}: {e}); "
            "kvwatt experiment PLAN --report-only retries")


def run_line(result: dict, scope: str, basis: str) -> str:
    """One line about a finished run, for the progress output."""
    w = result.get("window", {})
    chosen = stats.choose_scope([result], scope, basis)
    jpt = stats.joules_per_token(result, chosen, basis) if chosen else None
    return (f"KV p95 {pct_unit(w.get('kv_usage_p95_ratio'))}, {num(w.get('preemptions_per_minute'))} preemptions "
            "per minute, "
            f"{num(w.get('tokens_per_second'), 4)} tokens/s, "
            f"local_compute {pct_unit(stats.share(result, 'local_compute'))}, "
            f"J/token ({basis}) " + (NA if jpt is None else f"{jpt:.4g} {chosen}"))


def main(argv: list[str] | None = None) -> int:
    from kvwatt_lab.experiment.state import ExperimentState

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvwatt_lab.experiment.report OUT_DIR", file=sys.stderr)
        return 2
    try:
        state = ExperimentState.load(args[0])
        if state is None:
            raise ConfigError(f"{args[0]}: no experiment state (state.json) here")
        paths = write_report(args[0], state.data)
    except ConfigError as e:
        print("kvwatt: error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
