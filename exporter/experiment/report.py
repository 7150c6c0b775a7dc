"""The experiment's report from its state file: Table 1 (KV p95, preemptions, tokens/s, J/token, dE% and
dTPS% with SE, n), Table 2 (token-source decomposition), plots, per-run rows. Written as report.md,
report.html (images referenced relatively), runs.csv, conditions.csv and report.json in the output directory.

Runnable alone:  python -m exporter.experiment.report OUT_DIR   (or: kvwatt experiment PLAN --report-only)
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

from exporter import atomic
from exporter.derive.recompute import SOURCES
from exporter.experiment import plots, stats

NA = "n/a"
SHORT = {"local_compute": "compute", "local_cache_hit": "cache", "external_kv_transfer": "external"}


# ------------------------------------------------------------------------------------------------------
# formatting
# ------------------------------------------------------------------------------------------------------
def _num(value: float | None, digits: int = 3) -> str:
    return NA if value is None else f"{value:.{digits}g}"


def _pct(ratio: float | None) -> str:
    return NA if ratio is None else f"{ratio * 100:.1f} %"


def _pm(mean: float | None, se: float | None, fmt: str = "{:+.1f}", se_fmt: str = "{:.1f}") -> str:
    if mean is None:
        return NA
    return f"{fmt.format(mean)} ± {NA if se is None else se_fmt.format(se)}"


def _stat(summary: dict, key: str) -> tuple[float | None, float | None]:
    s = summary.get(key) or {}
    return s.get("mean"), s.get("se")


# ------------------------------------------------------------------------------------------------------
# tables: (title, header, rows, note)
# ------------------------------------------------------------------------------------------------------
def table1(summaries: list[dict], threshold: float, basis: str) -> tuple[str, list[str], list[list[str]]]:
    header = ["condition", "baseline", "KV p95", "regime", "preemptions/window", "tokens/s",
              f"J/token ({basis})", "dE %", "dTPS %", "n"]
    rows, by_name = [], {s["condition"]: s for s in summaries}
    for s in summaries:
        kv = _stat(s, "kv_usage_p95_ratio")[0]
        regime = NA if kv is None else ("high" if kv > threshold else "low")
        jpt = s["joules_per_token"] or {}
        energy = (NA if jpt.get("mean") is None
                  else f"{_pm(jpt['mean'], jpt['se'], '{:.4g}', '{:.2g}')} {s['energy_scope']}")
        c = s.get("comparison")
        d_e = _pm(c["dE_percent"], c["dE_se_percent"]) if c else NA
        d_tps = _pm(c["dTPS_percent"], c["dTPS_se_percent"]) if c else NA
        n = f"{s['n']} / {by_name[s['baseline']]['n']}" if c else str(s["n"])
        rows.append([s["condition"], s["baseline"] or "–", _pct(kv), regime,
                     _num(_stat(s, "preemptions")[0]), _pm(*_stat(s, "tokens_per_second"), "{:.1f}"),
                     energy, d_e, d_tps, n])
    return "Table 1: KV pressure, throughput, energy per token and the saving of offloading", header, rows


def table2(summaries: list[dict]) -> list[tuple[str, list[str], list[list[str]]]]:
    by_name = {s["condition"]: s for s in summaries}
    paired = [s for s in summaries if s.get("baseline")]
    in_pairs = {s["condition"] for s in paired} | {s["baseline"] for s in paired}
    tables = []
    if paired:
        header = ["condition", "OFF compute", "OFF cache", "ON compute", "ON cache", "ON external", "n"]
        rows = []
        for s in paired:
            off = by_name[s["baseline"]]
            rows.append([f"{s['condition']} vs {s['baseline']}",
                         _pct(_stat(off, "share_local_compute")[0]), _pct(_stat(off, "share_local_cache_hit")[0]),
                         _pct(_stat(s, "share_local_compute")[0]), _pct(_stat(s, "share_local_cache_hit")[0]),
                         _pct(_stat(s, "share_external_kv_transfer")[0]), f"{s['n']} / {off['n']}"])
        tables.append(("Table 2: token-source decomposition, OFF vs ON (shares of prompt tokens)", header, rows))
    rest = [s for s in summaries if s["condition"] not in in_pairs]
    if rest:
        header = ["condition"] + list(SOURCES) + ["n"]
        rows = [[s["condition"]] + [_pct(_stat(s, f"share_{src}")[0]) for src in SOURCES] + [str(s["n"])]
                for s in rest]
        title = ("Table 2: token-source decomposition by condition (shares of prompt tokens)" if not paired
                 else "Table 2 (continued): conditions outside any ON/OFF pair")
        tables.append((title, header, rows))
    return tables


def runs_table(data: dict, scope: str, basis: str) -> tuple[str, list[str], list[list[str]]]:
    header = ["run", "condition", "KV p95", "preemptions", "tokens/s", f"J/token ({basis})", "local_compute",
              "startup s"]
    rows = []
    for run in _ordered_runs(data):
        w = run.get("window", {})
        chosen = stats.choose_scope([run], scope, basis)
        jpt = stats.joules_per_token(run, chosen, basis) if chosen else None
        rows.append([run["run"], run["condition"], _pct(w.get("kv_usage_p95_ratio")), _num(w.get("preemptions")),
                     _num(w.get("tokens_per_second"), 4), NA if jpt is None else f"{jpt:.4g} {chosen}",
                     _pct(stats.share(run, "local_compute")), _num(run.get("startup_seconds"))])
    return "Runs (in the order they ran)", header, rows


def _ordered_runs(data: dict) -> list[dict]:
    return [data["finished"][r["run_id"]] for r in data["order"] if r["run_id"] in data["finished"]]


# ------------------------------------------------------------------------------------------------------
# rendering
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
        f"J/token: {e['basis']} ({'(E - P_idle*dt) / generated tokens' if e['basis'] == 'marginal' else 'E / generated tokens'}), "
        f"scope {e['scope']} (auto: gpu when every run has it, else host). dE% = (J/tok_OFF - J/tok_ON) / "
        "J/tok_OFF * 100; dTPS% = (TPS_ON - TPS_OFF) / TPS_OFF * 100; ± is the delta-method SE "
        "100 * (x_ON/x_OFF) * sqrt((SE_ON/x_ON)^2 + (SE_OFF/x_OFF)^2) over runs (methods.md s2); n = runs ON / OFF.",
        f"KV p95: 95th percentile of vllm:kv_cache_usage_perc over the window's dense samples; regime 'high' "
        f"when above the threshold {plan['kv_pressure_threshold']:.2f}. Preemptions: vllm:num_preemptions_total "
        "increase over the window. Shares: vllm:prompt_tokens_by_source_total over the window (first prefills "
        "only: re-prefill after preemption is not counted by vLLM).",
    ]


def build(data: dict) -> dict:
    """The report model: everything the writers render."""
    plan = data["plan"]
    summaries = stats.summarize(plan, data["finished"])
    return {"experiment": plan["name"], "plan_path": plan["path"],
            "protocol_fingerprint": data["fingerprints"]["protocol"],
            "generated_unix": time.time(), "status": status_lines(data), "method": method_lines(plan),
            "complete": not data.get("failed") and len(data["finished"]) == len(data["order"]),
            "kv_pressure_threshold": plan["kv_pressure_threshold"], "conditions": summaries,
            "tables": [table1(summaries, plan["kv_pressure_threshold"], plan["energy"]["basis"]),
                       *table2(summaries), runs_table(data, plan["energy"]["scope"], plan["energy"]["basis"])],
            "runs": [flatten_run(r) for r in _ordered_runs(data)],
            "failed": data.get("failed"), "in_progress": data.get("in_progress")}


def render_markdown(model: dict, images: dict[str, str]) -> str:
    out = [f"# Experiment report: {model['experiment']}", "",
           f"Plan `{model['plan_path']}` (protocol {model['protocol_fingerprint'][:12]}).", ""]
    out += [f"**{line}**" if line.startswith("INCOMPLETE") else line for line in model["status"]] + [""]
    for title, header, rows in model["tables"]:
        out += [f"## {title}", "", markdown_table(header, rows), ""]
    out += ["## Method", ""] + [f"- {line}" for line in model["method"]] + [""]
    if images:
        out += ["## Plots", ""] + [f"![{alt}]({path})" for path, alt in images.items()] + [""]
    out += ["Machine-readable: `runs.csv`, `conditions.csv`, `report.json`; per run: `runs/<run>/` (result.json, "
            "intervals.jsonl, turns.jsonl, server.log).", ""]
    return "\n".join(out)


def render_html(model: dict, images: dict[str, str]) -> str:
    parts = [f"<h1>Experiment report: {html.escape(model['experiment'])}</h1>",
             f"<p>Plan <code>{html.escape(model['plan_path'])}</code> (protocol {model['protocol_fingerprint'][:12]}).</p>"]
    warn = ' class="warn"'
    parts += [f"<p{warn if line.startswith('INCOMPLETE') else ''}>{html.escape(line)}</p>" for line in model["status"]]
    for title, header, rows in model["tables"]:
        parts += [f"<h2>{html.escape(title)}</h2>", html_table(header, rows)]
    parts += ["<h2>Method</h2><ul>" + "".join(f"<li>{html.escape(l)}</li>" for l in model["method"]) + "</ul>"]
    if images:
        parts += ["<h2>Plots</h2>"] + [f'<figure><img src="{html.escape(p)}" alt="{html.escape(a)}">'
                                       f"<figcaption>{html.escape(a)}</figcaption></figure>" for p, a in images.items()]
    style = ("body{font-family:sans-serif;max-width:72em;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #bbb;padding:.2em .5em;text-align:right}td:first-child{text-align:left}"
             ".warn{color:#a00;font-weight:bold}img{max-width:100%}")
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
                "flops_per_generated_token"):
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
    images = plots.write_plots(os.path.join(out_dir, "plots"), model["conditions"], model["kv_pressure_threshold"])
    images = {os.path.relpath(p, out_dir): alt for p, alt in images.items()}
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
    except Exception as e:  # noqa: BLE001 - the runs matter more than the report
        say(f"warning: the report could not be written ({type(e).__name__}: {e}); "
            "kvwatt experiment PLAN --report-only retries")


def run_line(result: dict, scope: str, basis: str) -> str:
    """One line about a finished run, for the progress output."""
    w = result.get("window", {})
    chosen = stats.choose_scope([result], scope, basis)
    jpt = stats.joules_per_token(result, chosen, basis) if chosen else None
    return (f"KV p95 {_pct(w.get('kv_usage_p95_ratio'))}, {_num(w.get('preemptions'))} preemptions, "
            f"{_num(w.get('tokens_per_second'), 4)} tokens/s, local_compute {_pct(stats.share(result, 'local_compute'))}, "
            f"J/token ({basis}) " + (NA if jpt is None else f"{jpt:.4g} {chosen}"))


def main(argv: list[str] | None = None) -> int:
    from exporter.experiment.state import ExperimentState

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m exporter.experiment.report OUT_DIR", file=sys.stderr)
        return 2
    state = ExperimentState.load(args[0])
    if state is None:
        print(f"kvwatt: error: {args[0]}: no experiment state (state.json) here", file=sys.stderr)
        return 2
    for path in write_report(args[0], state.data):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
