"""The landing page (`/`): one panel per server answering "is offloading paying, is anything wrong, what do I
do", in words.

It renders the dict /api/status serves (``exporter.serve.web.status_json``) and nothing else: every figure on the
page is a value of that dict, formatted, never recomputed, so the page and the JSON always agree. Unknown
(null) reads "unknown", with the reason where the dict has one. The page refreshes itself by fetching itself
again (exporter.serve.page_assets); it links no external asset, so it works air-gapped. The table of figures
per window takes its rows from the catalog's declarations (exporter.catalog, each figure's ``words``): a figure
declared with words is a row, read from the dict at its /api/status key.
"""

from __future__ import annotations

from html import escape
from typing import Callable

from exporter import catalog, rules
from exporter.figures import KV_CACHE_METRICS_HINT
from exporter.serve.page_assets import CSS, JS, REFRESH_SECONDS

UNKNOWN = '<span class="unknown">unknown</span>'

KIND_WORDS = {
    "paired": "measured against the paired OFF server on the same node",
    "recorded": "measured against a recorded OFF profile",
    "estimated": "a model estimate, not a measurement (no OFF reference)",
    "potential": "an estimate of what offloading would save here: the recomputation tax priced as reloads",
}

CONDITION_WORDS = {
    "offload_enabled": "offloading is on",
    "zero_preemptions": "no preemption in the window",
    "throughput_collapsed": "generated tokens/s collapsed against its recent level",
    "power_near_idle": "GPU power near its idle level",
    "requests_pending": "requests running or waiting at every sample",
    "engine_steps_stopped": "the engine ran no step (with requests pending: a stalled engine)",
}
# a condition that is false, in words (why the collapse is ruled out)
CONDITION_FALSE_WORDS = {
    "offload_enabled": "offloading is off",
    "zero_preemptions": "the engine preempted",
    "throughput_collapsed": "generated tokens/s held their recent level",
    "power_near_idle": "GPU power is above its idle level",
    "requests_pending": "some samples had no request running or waiting",
    "engine_steps_stopped": "the engine ran steps",
}
# the two shapes of a collapse (derive/collapse.py CONDITION_SETS), in words
COLLAPSE_SHAPE_WORDS = {
    "stalled_engine": "a stalled engine: it ran no step while requests were pending",
    "classic": ("the offload-buffer collapse: offloading on, no preemption, tokens/s collapsed, GPU power near "
                "idle, requests pending"),
}


# --- formatting -----------------------------------------------------------------------------------------------
def _num(x, digits: int = 3) -> str:
    return UNKNOWN if x is None else f"{x:,.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"


def _pct(x, signed: bool = False) -> str:
    return UNKNOWN if x is None else f"{x * 100:{'+' if signed else ''}.1f} %"


def _pct_se(x) -> str:
    """A standard error: two significant digits below 0.1 %, so a small SE never reads "± 0.0 %"."""
    return UNKNOWN if x is None else f"{x * 100:.2g} %" if abs(x) < 0.001 else _pct(x)


def _joules(x) -> str:
    return UNKNOWN if x is None else f"{x:.3g} J"


def _gib(n_bytes) -> str:
    return UNKNOWN if n_bytes is None else f"{n_bytes / 2 ** 30:.3g} GiB"


def _secs(x) -> str:
    return UNKNOWN if x is None else f"{x:.0f} s" if abs(x) >= 10 else f"{x:.1f} s"


def _state(v, meaning: str) -> str:
    """A three-valued condition: true / false / unknown, never a blank or "none"; coloured by ``meaning``."""
    word = "unknown" if v is None else "true" if v else "false"
    return f'<span class="chip {meaning} state-{word}" data-meaning="{meaning}">{word}</span>'


# a chip's colour says what it means, never more: good, bad, unknown, or neutral (a plain fact)
MEANINGS = ("good", "bad", "unknown", "neutral")
SOURCE_MEANING = {"ok": "good", "down": "bad", "degraded": "unknown"}  # degraded: some figures unknown


def _chip(meaning: str, text: str, attrs: str = "") -> str:
    return f'<span class="chip {meaning}" data-meaning="{meaning}"{attrs}>{escape(text)}</span>'


def source_meaning(state: str) -> str:
    return SOURCE_MEANING.get(state, "unknown")


def condition_meaning(name: str, v, c: dict) -> str:
    """What a collapse condition's value means (methods.md s5). While the signature holds, each true condition
    is part of the failure; otherwise a fact is neutral and only what is good or bad on its own is coloured."""
    if v is None:
        return "unknown"
    if name == "offload_enabled":
        return "neutral"  # whether offloading is on is a fact, not a verdict
    if v and c.get("signature"):
        return "bad"
    pending = c.get("conditions", {}).get("requests_pending")
    return {"zero_preemptions": "good" if v else "bad",  # preempting: the leading sign of KV pressure
            "throughput_collapsed": "bad" if v else "good",
            "engine_steps_stopped": ("bad" if pending else "neutral") if v else "good",  # idle: not stalled
            }.get(name, "neutral")  # power near idle, requests pending: facts on their own


def _e(x) -> str:
    return escape(str(x))


# --- page -----------------------------------------------------------------------------------------------------
def render(status: dict, telemetry_path: str = "/metrics") -> str:
    """The whole page from /api/status's dict; the Metrics link follows --web.telemetry-path."""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>kvwatt</title><noscript><meta http-equiv="refresh" content="{REFRESH_SECONDS * 2}"></noscript>
<style>{CSS}</style></head><body>
<header class="top"><h1>kvwatt</h1><span class="version">{_e(status.get("version", ""))}</span>
<nav><a href="{_e(telemetry_path)}">Metrics</a><a href="/api/status">Status (JSON)</a>\
<a href="/healthz">Health</a></nav>
</header>
{content(status)}
<footer>The page refreshes itself every {REFRESH_SECONDS} s from the same figures as
<a href="/api/status">/api/status</a>. <span id="refresh-state"></span></footer>
<script>{JS}</script></body></html>"""


def content(status: dict) -> str:
    if status.get("as_of") is None:
        return ('<main id="content"><p class="asof" id="as-of">No figures yet: kvwatt has not completed its first '
                'sampling tick.</p></main>')
    sources = status.get("sources", [])
    servers = "".join(server_panel(s) for s in status.get("servers", [])) or "<p>No server configured.</p>"
    notice = (f'<p class="banner notice" id="notice" data-field="notice">{_e(status["notice"])}</p>'
              if status.get("notice") else "")
    return f"""<main id="content">{notice}{implausible_list(status.get("implausible") or [])}
<p class="asof" id="as-of">Figures as of <b>{_e(status["as_of"])}</b> (the daemon's last tick).</p>
<div class="chips" id="host-sources">{"".join(_source_chip(st) for st in sources) or _chip("unknown",
    "no energy source read")}</div>
{servers}</main>"""


def implausible_list(rejected: list[dict]) -> str:
    """The figures shown as unknown this tick because they broke their declared bounds, with why."""
    if not rejected:
        return ""
    items = "".join(f'<li data-figure="{_e(r["figure"])}">{_e(r["reason"])} '
                    f'({_e(", ".join(f"{k}={v}" for k, v in r["labels"].items()))})</li>' for r in rejected)
    inconsistent = sum(r.get("bound") == "relation" for r in rejected)  # broke a relation (exporter/catalog/bounds.py)
    why = ", ".join(w for n, w in ((len(rejected) - inconsistent, "outside what physics allows"),
                                   (inconsistent, "inconsistent with another figure")) if n)
    return (f'<details class="banner" id="implausible"><summary>{len(rejected)} figure(s) shown as unknown: '
            f'{why}</summary><ul>{items}</ul></details>')


_SOURCE_NAMES = {"nvml": "GPU energy (NVML)", "rapl": "host energy (RAPL)", "state_dir": "state directory",
                 "electricity_price": "electricity price (URL)", "carbon_intensity": "carbon intensity (URL)"}


def _source_chip(st: dict) -> str:
    name = _SOURCE_NAMES.get(st["source"], st["source"])
    text = f"{name}: {st['state']}" + (f" ({st['reason']})" if st.get("reason") else "")
    return _chip(source_meaning(st["state"]), text,
                 f' data-source="{escape(st["source"])}" title="{escape(st.get("reason") or "")}"')


def server_panel(s: dict) -> str:
    name = _e(s["server"])
    return f"""<article class="server" id="server-{name}" data-server="{name}">
<h2>{name} {_chip(source_meaning(s["state"]), "up" if s["up"] else "DOWN")}</h2>
<p class="meta">{_meta(s)}</p>
<div class="cols"><div>
<section class="q" data-question="paying"><h3>Is offloading paying?</h3>{paying(s)}</section>
<section class="q" data-question="wrong"><h3>Is anything wrong?</h3>{wrong(s)}</section>
<section class="q" data-question="todo"><h3>What do I do?</h3>{todo(s)}</section>
</div><aside><details id="windows-{name}" open><summary>Figures per window</summary>{windows_table(s)}</details>
</aside></div></article>"""


def _meta(s: dict) -> str:
    bits = [_e(s.get("model_name") or "model unknown"), _e(s.get("engine") or ""), _e(s.get("url") or "")]
    off = s.get("offload_enabled")
    bits.append('<span data-field="offload">' + ("offloading: unknown" if off is None else
                "offloading ON, buffer " + _gib(s.get("offload_buffer_bytes")) if off else "offloading OFF")
                + "</span>")
    if not s["up"] or s["state"] != "ok":
        bits.append(f'<span data-field="source-reason">vLLM /metrics {_e(s["state"])}: {_e(s["reason"])}</span>')
    return " · ".join(b for b in bits if b)


def _longest(s: dict) -> tuple[str, dict] | None:
    wins = s.get("windows") or {}
    return max(wins.items(), key=lambda kv: kv[1]["seconds"]) if wins else None


def _window_words(label: str, w: dict) -> str:
    return (f'over the last {_e(label)} (<span data-field="coverage">{w["covered_seconds"]:.0f} of '
            f'{w["seconds"]:.0f} s covered</span>)')


# --- is offloading paying? ------------------------------------------------------------------------------------
def paying(s: dict) -> str:
    lead, basis = _saving_sentences(s)
    return (f'<p class="verdict {_verdict_class(s)}" data-field="dE">{lead}</p>'
            + (f'<p class="small" data-field="dE-basis">{basis}</p>' if basis else "")
            + _cost_sentence(s) + _other_savings(s) + _energy_sentence(s) + _tax_sentence(s))


def _cost_sentence(s: dict) -> str:
    """The marginal energy in money and CO2 per day at the longest window's load, when a price or a carbon
    intensity is configured (docs/energy.md, "Money and carbon"); nothing when neither is."""
    lw = _longest(s)
    if lw is None or not lw[1].get("cost"):
        return ""
    label, w = lw
    parts = [f"{_SCOPES[scope]} {_cost_words(c)}" for scope, c in w["cost"].items() if scope in _SCOPES]
    return (f'<p data-field="cost">In money and carbon {_window_words(label, w)}, the energy above idle at this '
            f'load: {"; ".join(parts)}.</p>')


def _money(x, currency) -> str:
    return UNKNOWN if x is None else f"{x:,.3g} {_e(currency or '')}".rstrip()


def _cost_words(c: dict) -> str:
    if c["marginal_watts"] is None:
        return f"{UNKNOWN} (no marginal energy figure yet)"
    cur = c.get("currency")
    kg = None if c["co2e_grams_per_day"] is None else c["co2e_grams_per_day"] / 1000
    per_day = (f'<b>{_money(c["money_per_day"], cur)}/day</b>, '
               f'<b>{UNKNOWN if kg is None else f"{kg:,.3g} kg"} CO2e/day</b>')
    co2e = c["co2e_grams_per_thousand_tokens"]
    per_token = (f'{_money(c["money_per_million_tokens"], cur)} per million generated tokens, '
                 f'{UNKNOWN if co2e is None else _num(co2e)}'
                 f' g CO2e per 1,000 tokens')
    return f"{per_day} ({_num(c['marginal_watts'])} W; {per_token}){_tax_cost_words(c)}"


def _tax_cost_words(c: dict) -> str:
    """The recomputation tax and the offload saving per day, when priced (methods.md s12)."""
    cur, out = c.get("currency"), ""
    for what, key in (("recomputing evicted prompts", "recompute_tax"), ("offloading saved", "offload_saved")):
        money, grams = c.get(f"{key}_money_per_day"), c.get(f"{key}_co2e_grams_per_day")
        if money is None and grams is None:
            continue
        kg = UNKNOWN if grams is None else f"{grams / 1000:,.3g} kg"
        out += f"; {what}: <b>{_money(money, cur)}/day</b>, {kg} CO2e/day"
    return out


def _first_saving(s: dict):
    lw = _longest(s)
    if lw is None or not lw[1].get("energy_saving"):
        return lw, None, None
    kind, sv = next(iter(lw[1]["energy_saving"].items()))  # the strongest kind first: paired, recorded, ...
    return lw, kind, sv


# the style of each answer /api/status gives (figures.py SavingFigure.answer): a collapse reads as a cost
_ANSWER_CLASS = {"collapse": "costs"}


def _verdict_class(s: dict) -> str:
    _, kind, sv = _first_saving(s)
    if sv is None:
        return "unknown"
    return escape(_ANSWER_CLASS.get(sv["answer"], sv["answer"]))


def _saving_sentences(s: dict) -> tuple[str, str]:
    """The answer in one sentence, and what it rests on (kind, windows, coverage, dTPS, note)."""
    lw, kind, sv = _first_saving(s)
    if s.get("offload_enabled") is None:
        why = "the server has not answered yet" if not s["up"] else "its /metrics has no cache_config_info"
        return f"Unknown: kvwatt cannot tell whether this server offloads ({_e(why)}).", ""
    if sv is None:
        return "Unknown: no energy-saving figure yet (no window has been sampled).", ""
    if sv["dE"] is None:
        return f"Unknown ({_e(kind)} dE): {_e(sv['note'] or 'no repeat window with load yet')}.", ""
    basis = (f"{_e(kind)}: {_e(KIND_WORDS.get(kind, kind))}; {sv['windows']} repeat windows "
             + _window_words(*lw) + ".")
    if sv.get("dTPS") is not None:
        basis += f" Throughput {_pct(sv['dTPS'], True)}" + (
            f" ± {_pct_se(sv['dTPS_stderr'])}." if sv.get("dTPS_stderr") is not None else ".")
    if sv.get("note"):
        basis += f" {_e(sv['note'])}."
    return _lead(kind, sv), basis


def _lead(kind: str, sv: dict) -> str:
    """The words of the model's answer (sv["answer"]: the page decides nothing, figures.py SavingFigure.answer)."""
    figure = f'<b class="figure">{_pct(sv["dE"], True)}</b>'
    se = (f"± {_pct_se(sv['dE_stderr'])} (standard error)" if sv["dE_stderr"] is not None
          else "(standard error unknown: fewer than two windows)")
    if sv["answer"] == "collapse":
        return (f"No, whatever dE says: dE {figure} {se} reads as a saving, but the collapse signature holds, and "
                "a stalled GPU near idle makes marginal J/token look cheap.")
    if kind == "potential":
        return {"saves": f"Offloading is off here; turning it on would save about {figure} {se} of the GPU "
                         "energy above idle per generated token.",
                "costs": f"Offloading is off here, and turning it on would not save energy: dE {figure} {se}.",
                "within_noise": f"Offloading is off here; turning it on would save nothing measurable: dE {figure} "
                                f"{se} is within two standard errors of zero."}[sv["answer"]]
    return {"saves": f"Yes: offloading saves {figure} {se} of the GPU energy above idle per generated token.",
            "costs": f"No: offloading costs energy: dE {figure} {se} (more GPU energy above idle per generated token).",
            "within_noise": f"Not measurably: dE {figure} {se} is within two standard errors of zero."}[sv["answer"]]


def _other_savings(s: dict) -> str:
    lw, kind, _ = _first_saving(s)
    if kind is None:
        return ""
    rest = [(k, v) for k, v in lw[1]["energy_saving"].items() if k != kind]
    items = "; ".join(f"{_e(k)}: {_pct(v['dE'], True)}" + (f" ± {_pct_se(v['dE_stderr'])}" if v["dE_stderr"]
                      is not None else "") + f" ({v['windows']} windows)" for k, v in rest)
    return f'<p class="small" data-field="other-dE">Also {items}.</p>' if items else ""


def _energy_sentence(s: dict) -> str:
    lw = _longest(s)
    if lw is None:
        return ""
    label, w = lw
    parts = [f"{_SCOPES[scope]} {_scope_words(w['energy'].get(scope), _SCOPES[scope])}" for scope in _SCOPES]
    return (f'<p data-field="joules-per-token">Energy per generated token {_window_words(label, w)}: '
            f'{"; ".join(parts)}.</p>')


_SCOPES = {"gpu": "GPU", "host": "host"}


def _scope_words(e: dict | None, scope: str) -> str:
    if e is None:
        return f"{UNKNOWN} (no {scope} energy samples for this server)"
    if e["joules_per_token"] is None:
        return (f"{UNKNOWN} (too little load yet: {_secs(e['loaded_seconds'])} loaded, "
                f"{_num(e['generated_tokens'])} tokens generated)")
    marginal = e["marginal_joules_per_token"]
    m = f"<b>{_joules(marginal)}</b> marginal (above idle)" if marginal is not None else \
        f"marginal {UNKNOWN} (no idle baseline)"
    return f"{m}, {_joules(e['joules_per_token'])} in total"


def _tax_sentence(s: dict) -> str:
    lw = _longest(s)
    if lw is None:
        return ""
    label, w = lw
    shares, ref = w.get("prompt_token_shares"), s.get("reference_local_compute_share")
    state, reason = s.get("tax_state", "known"), s.get("tax_reason") or ""
    if shares is None:
        body = f"{UNKNOWN} (no prompt tokens by source in the window)"
    elif w.get("recompute_tax") is None or state != "known":
        # a tax on a reference not yet known is no figure: its state and why, never a number as if known
        ref_words = (f", against {_pct(ref)} at low pressure so far ({_e(s.get('reference_kind'))} reference)"
                     if ref is not None else "")
        body = (f"{_state_words(state, reason or 'its low-pressure share is not known yet', 'tax-state')}: the "
                f"server recomputed {_pct(shares['local_compute'])} of its prompt tokens{ref_words} (the "
                "low-pressure share is learned from windows of low pressure, or can be configured for this server)")
    else:
        body = (f"<b>{w['recompute_tax'] * 100:+.1f} points</b>: the server recomputed "
                f"{_pct(shares['local_compute'])} of its prompt tokens, against {_pct(ref)} at low pressure "
                f"({_e(s.get('reference_kind'))} reference)")
    return (f'<p data-field="recompute-tax">Recompute tax {_window_words(label, w)}: {body}. '
            '<span class="note">The tax is the rise of the recomputed share above the same server\'s '
            'low-pressure level: prompt tokens evicted from the KV cache and computed again, which an offload '
            'tier can reload instead.</span></p>')


def _state_words(state: str, reason: str, field: str) -> str:
    """A learned figure's state when not known (methods.md s10): "provisional: <reason>" / "unknown: <reason>"."""
    return (f'<span class="state-word {_e(state)}" data-field="{field}" data-state="{_e(state)}">{_e(state)}: '
            f'{_e(reason)}</span>')


# --- is anything wrong? ---------------------------------------------------------------------------------------
def wrong(s: dict) -> str:
    return _collapse(s) + _buffer(s) + _pressure(s) + _health(s)


def _collapse(s: dict) -> str:
    c = s.get("collapse")
    if c is None:
        why = "not evaluated yet" if s.get("up", True) else "kvwatt cannot read the server"
        return (f'<p class="banner unknown" data-field="collapse">Throughput collapse: {UNKNOWN} '
                f'({why}).</p>')
    sig = c["signature"]
    cls, word = ("alarm", "YES") if sig else ("calm", "no") if sig is False else ("unknown", "unknown")
    head = (f'<p class="banner {cls}" data-field="collapse">Throughput collapse: <span data-field="signature">'
            f'{word}</span> <span class="small">({_e(collapse_words(c))})</span></p>')
    rows = "".join(_condition_row(name, v, c) for name, v in c["conditions"].items())
    return (head + f'<table class="conditions"><tr><th>condition (over the last {_e(c.get("window") or "?")})'
            f'</th><th>state</th><th>what kvwatt sees</th></tr>{rows}</table>')


def collapse_words(c: dict) -> str:
    """Why the collapse holds, is ruled out or is unknown, in words (the reason in /api/status names conditions)."""
    conds, sets = c.get("conditions", {}), c.get("condition_sets", {})
    held = [COLLAPSE_SHAPE_WORDS.get(n, n) for n, v in sets.items() if v]
    if held:
        return "; ".join(held)
    unknown = [n for n, v in conds.items() if v is None]
    if c.get("signature") is None and unknown:
        return "not known yet: " + "; ".join(f"{CONDITION_WORDS.get(n, n)}: {c.get('details', {}).get(n, 'unknown')}"
                                              for n in unknown)
    return "ruled out: " + "; ".join(CONDITION_FALSE_WORDS.get(n, n) for n, v in conds.items() if v is False)


def _condition_row(name: str, v, c: dict) -> str:
    seen = _e(c.get("details", {}).get(name, "")) if v is None else ""
    if name == "throughput_collapsed" and not seen:
        seen = (f"{_num(c['recent_tokens_per_second'])} tokens/s now, reference "
                f"{_num(c['reference_tokens_per_second'])} tokens/s")
    elif name == "power_near_idle" and not seen:
        seen = f"GPU {_num(c['gpu_power_watts'])} W, idle {_num(c['gpu_idle_power_watts'])} W"
    elif name == "engine_steps_stopped" and not seen:
        seen = _e(c.get("stale_witnesses", {}).get("engine_steps", ""))  # a flat step counter beside moving tokens
    return (f'<tr data-condition="{_e(name)}"><td>{_e(CONDITION_WORDS.get(name, name))}</td>'
            f'<td class="state">{_state(v, condition_meaning(name, v, c))}</td><td class="small">{seen}</td></tr>')


def _buffer(s: dict) -> str:
    b, off = s.get("offload_buffer"), s.get("offload_enabled")
    if not off:
        return ('<p data-field="buffer">Offload buffer: none (offloading is off).</p>' if off is False else
                f'<p data-field="buffer">Offload buffer: {UNKNOWN}.</p>')
    if b is None:
        return f'<p data-field="buffer">Offload buffer: {UNKNOWN} (no window yet).</p>'
    cls, verdict = {True: ("alarm", "undersized"), False: ("calm", "not undersized"),
                    None: ("unknown", "unknown")}[b["undersized"]]
    size, rate, p99 = _gib(s.get("offload_buffer_bytes")), b["write_bytes_per_second"], b["p99_tool_latency_seconds"]
    if rate == 0:
        holds = f"{size}, no offload writes in the shortest window"
    elif rate is None:
        holds = f"{size}, write rate {UNKNOWN}"
    elif s.get("offload_buffer_bytes") is None:
        holds = f"size {UNKNOWN} (not in the server's cache_config_info), writes at {_gib(rate)}/s"
    else:
        holds = (f'{size} holds <span data-field="residency">{_secs(b["residency_seconds"])}</span> of writes at '
                 f'{_gib(rate)}/s')
    text = (f"{holds}; the p99 tool-call latency it must outlast is {_secs(p99)} (a KV block evicted before the "
            "tool call returns is recomputed, not reloaded).")
    if b.get("residency_target_source") == "reuse_gap_p99":  # measured by vLLM --kv-cache-metrics (methods.md s11)
        text = (f"{holds}; the KV-block reuse-gap p99 it must outlast is {_secs(b['residency_target_seconds'])}, "
                "measured by the engine (--kv-cache-metrics) in place of the configured p99 tool-call latency "
                f"{_secs(p99)} (a KV block evicted before its reuse is recomputed, not reloaded).")
    basis = ("KV-block reuse-gap p99" if b.get("residency_target_source") == "reuse_gap_p99"
             else "p99 tool-call latency")
    if b["store_failures"]:
        text += f" {_num(b['store_failures'])} stores failed or were skipped in the shortest window."
    rec = ("unknown (no write rate yet)" if b["recommended_gib"] is None else
           f'<b data-field="recommended-buffer">{b["recommended_gib"]:.12g} GiB</b> '
           f'(--kv-offloading-size {escape(b.get("recommended_words") or "")}: busiest write rate × {basis} × '
           f'{_num(b["headroom"])} headroom)')
    note = f' <span data-field="recommended-note">({escape(b["recommended_note"])})</span>' \
        if b.get("recommended_note") else ""
    return (f'<p class="banner {cls}" data-field="buffer-verdict">Offload buffer: {verdict}</p>'
            f'<p data-field="buffer">{text} Recommended size: {rec}{note}.</p>')


def _threshold_words(s: dict) -> tuple[float | None, str]:
    """The threshold the regime flag uses, and where it comes from (methods.md s10)."""
    loc, th = s.get("threshold_located"), s.get("threshold_in_use", s["threshold"])
    if s.get("threshold_source") == "located" and loc:
        why = "preemptions began" if loc["method"] == "preemption_onset" else "a recompute tax appeared"
        return th, (f" The threshold is this server's own, located at {_pct(loc['ratio'])} "
                    f"({_pct(loc['low'])}–{_pct(loc['high'])}) from {loc['windows']} windows of its history: "
                    f"the KV-usage p95 above which {why}.")
    if loc:
        return th, (f" The threshold is the configured one; this server's own history puts "
                    f"it at {_pct(loc['ratio'])} ({_pct(loc['low'])}–{_pct(loc['high'])}, {loc['windows']} windows).")
    return th, (f" The threshold is the configured one ({rules.KV_PRESSURE_THRESHOLD.default:.2f} by default, where "
                "a published study found offloading "
                "starts to pay); it only predicts: the regime rests on what the engine shows (requests waiting for "
                "KV capacity, preemptions, the recompute tax), and kvwatt locates this server's own threshold once "
                "its history holds windows below and above the onset.")


def _provisional_threshold(s: dict) -> str:
    """" (located, provisional: 0.0 %–78.0 %)" beside a threshold in use that is a located one not known yet: a
    located 34.5 % whose interval runs from 0 to 78 % is not to be read as a threshold like the configured one."""
    loc, state = s.get("threshold_located"), s.get("threshold_state", "known")
    if s.get("threshold_source") != "located" or not loc or state == "known":
        return ""
    return f" (located, {_e(state)}: {_pct(loc['low'])}–{_pct(loc['high'])})"


def _pressure(s: dict) -> str:
    """The regime as the engine's signs decided it (methods.md s10), then the p95 and the threshold as facts beside
    it: the words never claim a side of the threshold the regime does not rest on; its reason says why."""
    regime, label = s["regime"], s.get("regime_window")
    th, where = _threshold_words(s)
    w = (s.get("windows") or {}).get(label) if label else None
    state, reason = s.get("regime_state", "known"), s.get("regime_reason") or ""
    shown = _regime_reason_words(regime, reason)
    if regime == "unknown" or w is None:
        text = f"KV pressure: {UNKNOWN}" + (f" ({_e(reason)})" if reason else "") + "."
        label, w = _first_window(s)
    else:
        why = f": {_e(shown)}" if state == "known" else f" ({_state_words(state, shown, 'regime-state')})"
        text = f"KV pressure over the last {_e(label)}: <b>{_e(regime)}</b>{why}."
        if state == "known":
            text += (" Offloading starts to pay in this regime." if regime == "above" else
                     " Offloading saves nothing beyond noise in this regime.")
    if w is not None and w.get("kv_usage_p95") is not None:
        lo, hi = w.get("kv_usage_p95_interval") or (None, None)
        interval = f" ({_pct(lo)}–{_pct(hi)})" if lo is not None else ""
        text += (f" KV-cache usage p95 <b>{_pct(w['kv_usage_p95'])}</b>{interval} over the last {_e(label)}; "
                 f"threshold in use {_pct(th)}{_provisional_threshold(s)}.")
    text += where
    loc_state = s.get("threshold_state", "known")
    if s.get("threshold_located") and loc_state != "known":
        located = _state_words(loc_state, s.get('threshold_reason') or '', 'threshold-state')
        text += f" The located threshold is {located}."
    if w is not None and w.get("preemptions_per_minute") is not None:
        onset = " (preemption onset: the leading sign of pressure)" if w.get("preemption_onset") else ""
        text += f" Preemptions: {_num(w['preemptions_per_minute'])} per minute{onset}."
    if w is not None and w.get("requests_waiting_for_kv_capacity_share") is not None:
        text += (f' <span data-field="waiting-for-capacity">Requests waiting for KV capacity: '
                 f"{_num(w['requests_waiting_for_kv_capacity'])} on average, in "
                 f"{_pct(w['requests_waiting_for_kv_capacity_share'])} of samples.</span>")
    if _asks_for_kv_cache_metrics(s):
        text += f' <span class="note" data-field="kv-cache-metrics">{_e(KV_CACHE_METRICS_HINT)}</span>'
    return f'<p data-field="pressure" data-regime="{_e(regime)}" data-state="{_e(state)}">{text}</p>'


def _regime_reason_words(regime: str, reason: str) -> str:
    """The regime's reason without its leading "above: " / "below: " (the page says the side itself)."""
    for head in (f"{regime}: ", f"{regime} "):
        if reason.startswith(head):
            return reason[len(head):]
    return reason


def _first_window(s: dict) -> tuple[str | None, dict | None]:
    wins = s.get("windows") or {}
    return next(iter(wins.items()), (None, None))


def _asks_for_kv_cache_metrics(s: dict) -> bool:
    """Whether the model's advice asks for vLLM's --kv-cache-metrics (exporter.model.advice decides when: the
    regime's evidence advice carries the words); the page repeats them beside the regime, it does not decide."""
    return any(a.get("kind") == "evidence" and (a.get("evidence") or {}).get("figure") == "regime"
               and KV_CACHE_METRICS_HINT in (a.get("text") or "") for a in s.get("advice") or ())


def _health(s: dict) -> str:
    state = _chip(source_meaning(s["state"]), f"vLLM /metrics: {s['state']}" +
                  (f" ({s['reason']})" if s["reason"] else ""))
    return f'<p data-field="health">Sources: {state} <span class="small">(host-wide sources at the top)</span></p>'


# --- what do I do? --------------------------------------------------------------------------------------------
def todo(s: dict) -> str:
    """The advice the model computed (exporter.model.advice), most urgent first; "Nothing to do" only where the
    model said so (every check known and clear)."""
    advice = s.get("advice") or []
    if not advice:
        return f'<p data-field="recommendations">{UNKNOWN}: no advice computed for this server.</p>'
    if [a["kind"] for a in advice] == ["nothing_to_do"]:
        return f'<p data-field="recommendations" data-kind="nothing_to_do">{_e(advice[0]["text"])}</p>'
    return ('<ul class="todo" data-field="recommendations">' + "".join(
        f'<li class="{_e(a["severity"])}" data-kind="{_e(a["kind"])}" data-severity="{_e(a["severity"])}">'
        f'{_e(a["text"])}</li>' for a in advice) + "</ul>")


# --- figures per window ---------------------------------------------------------------------------------------
def _points(x) -> str:
    return UNKNOWN if x is None else f"{x * 100:+.1f}"


# a row's unit (catalog.Words.unit) -> its formatting of the value, given the window's dict
FORMATS: dict[str, Callable[[object, dict], str]] = {
    "coverage": lambda x, w: f"{x:.0f} of {w['seconds']:.0f} s",
    "percent": lambda x, _w: _pct(x),
    "number": lambda x, _w: _num(x),
    "joules": lambda x, _w: _joules(x),
    "points": lambda x, _w: _points(x),
    "bytes_per_second": lambda x, _w: UNKNOWN if x is None else _gib(x) + "/s",
    "seconds": lambda x, _w: _secs(x),
    "gigaflops": lambda x, _w: UNKNOWN if x is None else f"{x / 1e9:,.3g} GFLOP",
    "kwh_per_day": lambda x, _w: UNKNOWN if x is None else f"{x * 24 / 1000:,.3g} kWh/day ({x:,.3g} W)",
    "write_model": lambda x, _w: _write_model_words(x),
}


def _write_model_words(m: dict | None) -> str:
    """Where the post-preemption figure's write model came from (fitted, config.json, both agree), and its state
    when not known (methods.md s4)."""
    if not m or not m.get("source"):
        return UNKNOWN
    state = "" if m.get("state") == "known" else f' <span class="state-word {_e(m["state"])}">{_e(m["state"])}</span>'
    return f'<span data-field="write-model">{_e(m["source"])}</span>{state}'


def _at(w: dict, path: tuple[str, ...]):
    """The value at ``path`` in a window's dict; None where a level is missing or null (unknown)."""
    x = w
    for key in path:
        x = x.get(key) if isinstance(x, dict) else None
    return x


def window_rows(s: dict | None = None) -> list[tuple[str, Callable[[dict], str]]]:
    """The table's rows, from the catalog's declarations (their ``words``), in catalog order. A tax (points)
    whose state in the server's dict ``s`` is not known reads its state, not a number (methods.md s10)."""
    rows = []
    tax_state = (s or {}).get("tax_state", "known")
    wins = list(((s or {}).get("windows") or {}).values())
    for d in catalog.METRICS:
        for words in d.words:
            path = words.path or (d.status.key,)
            if words.absent_when_none and wins and all(_at(w, path) is None for w in wins):
                continue  # a figure this server cannot have (one KV pool): no row, not "unknown"
            fmt = FORMATS[words.unit]
            if words.unit == "points" and tax_state != "known":
                fmt = (lambda x, _w, st=tax_state: UNKNOWN if x is None else
                       f'<span class="state-word {st}" data-state="{st}">{st}</span>')
            rows.append((words.label, lambda w, path=path, fmt=fmt: fmt(_at(w, path), w)))
    return rows


def windows_table(s: dict) -> str:
    wins = s.get("windows") or {}
    if not wins:
        return f"<p>{UNKNOWN}: no window configured.</p>"
    head = "".join(f'<th class="num">last {_e(k)}</th>' for k in wins)
    rows = "".join(f"<tr><th>{_e(name)}</th>" + "".join(f'<td class="num">{cell(w)}</td>' for w in wins.values())
                   + "</tr>" for name, cell in window_rows(s))
    return f'<table class="windows"><tr><th></th>{head}</tr>{rows}</table>'
