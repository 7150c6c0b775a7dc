""""What do I do?": the advice of one server at tick time, from its figures (computed once per tick by
exporter.model.server, serialised by /api/status as ``advice`` and, in words only, ``recommendations``).

Every check kvwatt makes is either known and clear, failing (severity ``bad``: what to do, with the numbers),
or not known yet (``unknown``: what is missing and about how long until it is known, or what would make it
known now). "Nothing to do" only when every check is known and clear: the server is read, the regime and the
recompute tax are known, the collapse signature is known false, and the offload buffer is known not to be
undersized where offloading is on (methods.md s3, s5, s6, s10).
"""

from __future__ import annotations

from exporter import rules
from exporter.config import DEFAULT_SERVER_URL, Config
from exporter.derive.threshold import noise_bar, plural
from exporter.figures import KV_CACHE_METRICS_HINT, Advice, BufferFigures, ServerFigures, WindowFigures
from exporter.model import offload as offload_figures
from exporter.model.pressure import QUIET_KNOWN_WINDOWS, REFERENCE_KNOWN_WINDOWS

NO_SERVER_CONFIGURED = ("No server is configured, and nothing answers at the default URL: start vLLM there "
                        "(vllm serve MODEL --port 8000), point kvwatt at your engine with --server NAME=URL (or the "
                        "configuration's servers), or run `kvwatt demo` to see what kvwatt shows on a real "
                        "engine's capture.")
NOTHING_TO_DO = "Nothing to do: every check kvwatt makes is known and clear."


def advise(v: ServerFigures, cfg: Config) -> tuple[Advice, ...]:
    """The server's advice, most urgent first; never empty."""
    if not v.status.up:
        return (_down(v),)  # nothing else is known about a server kvwatt cannot read
    out = [a for a in (_degraded(v), _collapse(v), _pressure(v), _buffer(v.buffer, cfg), _tier_backpressure(v))
           if a is not None]
    out += _evidence(v, cfg)
    unknown = _unknown_checks(v)
    if unknown:
        out.append(Advice("checks_unknown", "unknown", "Some checks are unknown (" + "; ".join(unknown) +
                          "): nothing can be ruled out yet.", {"unknown_checks": unknown}))
    return tuple(out) or (Advice("nothing_to_do", "info", NOTHING_TO_DO, {}),)


def attach(v: ServerFigures, cfg: Config) -> ServerFigures:
    """``v`` with its advice and recommendations set, the figures not copied: advice reads the finished figures,
    so it is the one pair of fields set after construction (the figures are frozen to every later reader)."""
    advice = advise(v, cfg)
    object.__setattr__(v, "advice", advice)
    object.__setattr__(v, "recommendations", recommendations(advice))
    return v


def recommendations(advice: tuple[Advice, ...]) -> tuple[str, ...]:
    """The words of every advice item that asks something of the operator (empty: nothing to do)."""
    return tuple(a.text for a in advice if a.kind != "nothing_to_do")


# --- the checks -------------------------------------------------------------------------------------------------
def _down(v: ServerFigures) -> Advice:
    return Advice("server_down", "bad",
                  f"kvwatt cannot read {v.url}/metrics ({v.status.state}: {v.status.reason or 'no reason given'}). "
                  + (NO_SERVER_CONFIGURED if v.name == "default" and v.url == DEFAULT_SERVER_URL else
                     "Check the URL (--server NAME=URL or the configuration's servers), that the engine process is "
                     "running and listening there, and that this host can reach it; until then no figure of this "
                     "server is known."),
                  {"url": v.url, "state": v.status.state, "reason_code": v.status.code, "reason": v.status.reason})


def _degraded(v: ServerFigures) -> Advice | None:
    if v.status.state == "ok":
        return None
    return Advice("source_degraded", "unknown",
                  f"kvwatt reads {v.url}/metrics only in part ({v.status.reason}): the figures resting on what is "
                  "missing are unknown.",
                  {"url": v.url, "state": v.status.state, "reason_code": v.status.code, "reason": v.status.reason})


def _collapse(v: ServerFigures) -> Advice | None:
    c = v.collapse
    if c is None or not c.signature:
        return None
    numbers = {"condition_set": c.condition_set, "recent_tokens_per_second": c.recent_tokens_per_second,
               "reference_tokens_per_second": c.reference_tokens_per_second,
               "gpu_power_watts": c.gpu_power_watts, "gpu_idle_power_watts": c.gpu_idle_power_watts}
    if c.condition_set == "stalled_engine":
        return Advice("stalled_engine", "bad",
                      "Stalled engine: the engine ran no step while requests were pending (methods.md s5). Restart "
                      "the server to clear the stall; a smaller offload buffer keeps preemption alive meanwhile.",
                      numbers)
    return Advice("collapse", "bad", offload_figures.COLLAPSE_ADVICE, numbers)


def tax_above_noise(tax: float | None, spread: float | None) -> bool:
    """The tax exceeds TAX_Z times the reference's spread and MIN_TAX (methods.md s10, as derive.threshold.taxed)."""
    return tax is not None and tax > noise_bar(spread)


def _onset_window(v: ServerFigures) -> WindowFigures | None:
    """The shortest window with sustained preemptions (methods.md s3)."""
    return next((w for w in sorted(v.windows, key=lambda w: w.seconds) if w.preemption_onset), None)


def _tax_window(v: ServerFigures) -> WindowFigures | None:
    """The longest window with a tax (as the page's tax sentence)."""
    return next((w for w in sorted(v.windows, key=lambda w: -w.seconds) if w.recompute_tax is not None), None)


def _waiting_window(v: ServerFigures) -> WindowFigures | None:
    """The shortest window where requests waited for KV capacity through most of it (methods.md s10)."""
    return next((w for w in sorted(v.windows, key=lambda w: w.seconds)
                 if (w.requests_waiting_for_kv_capacity_share or 0.0) >= rules.CAPACITY_SUSTAINED.default), None)


def _ended(v: ServerFigures, seen: tuple[WindowFigures | None, ...]) -> bool:
    """The regime's window reads below while every sign of pressure is a longer window's."""
    at = next((w.seconds for w in v.windows if w.window == v.regime_window), None)
    return v.regime == "below" and at is not None and all(w.seconds > at for w in seen if w is not None)


def _pressure(v: ServerFigures) -> Advice | None:
    """Preemption onset, requests waiting for KV capacity through a window, or a known tax above noise: the KV
    cache is too small for the load (methods.md s3, s10)."""
    onset, taxed, waited = _onset_window(v), _tax_window(v), _waiting_window(v)
    if taxed is not None and not (v.tax_state == "known" and tax_above_noise(taxed.recompute_tax,
                                                                               v.reference_spread)):
        taxed = None  # a provisional tax is not evidence of pressure (the evidence advice says why)
    if onset is None and taxed is None and waited is None:
        return None
    w = onset or waited or taxed
    seen = []
    if waited is not None:
        seen.append(f"requests waiting for KV capacity in {waited.requests_waiting_for_kv_capacity_share * 100:.0f} % "
                    f"of samples over the last {waited.window} (mean {waited.requests_waiting_for_kv_capacity:.1f})")
    if onset is not None:
        seen.append(f"{onset.preemptions_per_minute:.1f} preemptions/min over the last {onset.window}")
    if taxed is not None:
        seen.append(f"a recompute tax of {taxed.recompute_tax * 100:+.1f} points over the last {taxed.window}")
    ended = _ended(v, (onset, waited, taxed))
    if w.kv_usage_p95 is not None:
        # the p95 is the sign's window's: named where the sentence's header names another window (the demo read
        # "KV pressure over the last 30s: a recompute tax of +16.9 points over the last 2m, KV-cache usage p95
        # 47 %", the 2m's p95, while the 30s's read 61 %)
        header = w.window if ended else (v.regime_window if v.regime == "above" else None)
        where = "" if header == w.window else f" over the last {w.window}"
        seen.append(f"KV-cache usage p95 {w.kv_usage_p95 * 100:.0f} %{where}")
    numbers = {"window": w.window,
               "preemptions_per_minute": onset.preemptions_per_minute if onset else w.preemptions_per_minute,
               "recompute_tax": taxed.recompute_tax if taxed else None, "kv_usage_p95": w.kv_usage_p95,
               "requests_waiting_for_kv_capacity_share":
                   waited.requests_waiting_for_kv_capacity_share if waited else None,
               "recommended_buffer_gib": v.buffer.recommended_gib if v.buffer else None,
               "regime": v.regime, "regime_window": v.regime_window}
    if ended:
        # the regime's window (the shortest with one) shows low pressure and every sign is a longer window's: the
        # pressure has ended (its signs in the regime's window would have made it above, methods.md s10), and
        # growing the cache is no longer what the server needs now
        return Advice("kv_pressure_ended", "info",
                      f"KV pressure over the last {w.window} ({', '.join(seen)}) has ended: the last "
                      f"{v.regime_window} is below ({v.regime_state}). If it comes back, grow the KV cache "
                      "(--gpu-memory-utilization, a shorter --max-model-len, more GPUs) or lower concurrency "
                      "(--max-num-seqs).", numbers | {"window": v.regime_window, "pressure_window": w.window})
    if v.regime == "above":
        numbers["window"] = v.regime_window  # the advice's window is the regime's (each sign names its own)
    if v.info is not None and v.info.offload_enabled:
        gib = offload_figures.recommended_words(v.buffer)  # "0.018 (18 MiB)": the flag's GiB, its bytes
        offload = ("; offloading is already on" + (f" (--kv-offloading-size {gib} is the size kvwatt "
                                                      "recommends)" if gib is not None else ""))
    else:
        offload = (", or enable KV offloading (--kv-offloading-size; kvwatt recommends a size from the write rate "
                   "once it is on)")
    over = f" over the last {v.regime_window}" if v.regime == "above" else ""
    return Advice("kv_pressure", "bad",
                  f"KV pressure{over}: {', '.join(seen)}. Grow the KV cache (--gpu-memory-utilization, a shorter "
                  f"--max-model-len, more GPUs) or lower concurrency (--max-num-seqs){offload}.",
                  numbers | {"pressure_window": w.window})


def _buffer(b: BufferFigures | None, cfg: Config) -> Advice | None:
    if b is None or not b.undersized:
        return None
    return Advice("undersized_buffer", "bad", offload_figures.undersized_words(b, cfg),
                  {"recommended_gib": b.recommended_gib, "residency_seconds": b.residency_seconds,
                   "residency_target_seconds": b.residency_target_seconds,
                   "residency_target_source": b.residency_target_source, "store_failures": b.store_failures})


def _tier_backpressure(v: ServerFigures) -> Advice | None:
    """A secondary offload tier whose back-pressure detector dropped stores in the shortest window that shows
    any (vLLM tiering: the tier took longer per MiB than its high-water mark, so vLLM skips cascades to it)."""
    for w in v.windows:
        dropping = [t for t in w.offload_tiers if (t.dropped_blocks_per_second or 0) > 0]
        if not dropping:
            continue
        t = max(dropping, key=lambda t: t.dropped_blocks_per_second)
        written = "" if t.write_bytes_per_second is None else f" while {t.write_bytes_per_second:,.0f} B/s reached it"
        return Advice("tier_dropping_stores", "bad",
                      f"The {t.tier} tier is dropping stores: too slow for the write rate. vLLM's back-pressure "
                      f"dropped {t.dropped_blocks_per_second:,.1f} blocks/s bound for it over {w.window}{written}: "
                      "those blocks will never be served from it, so their prompts are recomputed. Give the tier a "
                      "faster device or more write threads (n_write_threads), or store less to it "
                      "(offload_prompt_only).",
                      {"tier": t.tier, "window": w.window, "dropped_blocks_per_second": t.dropped_blocks_per_second,
                       "dropped_stores_per_second": t.dropped_stores_per_second,
                       "write_bytes_per_second": t.write_bytes_per_second})
    return None


# --- evidence not yet known -------------------------------------------------------------------------------------
def _has_residency(v: ServerFigures) -> bool:
    return any(w.kv_evictions_per_prompt_block is not None for w in v.windows)


def _eta(needed: int, have: int, span_seconds: float, width_seconds: float) -> tuple[float, str]:
    """(seconds, words) until ``needed`` more windows arrive at the rate seen (``have`` over ``span_seconds``);
    with fewer than two windows seen, the fastest possible: one per evidence window."""
    rate = (have - 1) / span_seconds if have >= 2 and span_seconds > 0 else 1.0 / width_seconds
    seconds = needed / rate if rate > 0 else float("inf")
    at = "at the current rate of evidence windows" if have >= 2 and span_seconds > 0 else "at best"
    return seconds, f"about {seconds / 60.0:.0f} min {at}" if seconds >= 60 else f"under a minute {at}"


def _evidence(v: ServerFigures, cfg: Config) -> list[Advice]:
    out = []
    ev, width = v.evidence, cfg.threshold_window_seconds
    hint = "" if _has_residency(v) or v.engine != "vllm" else " " + KV_CACHE_METRICS_HINT
    if v.regime_state != "known":
        # a "below" becomes known after QUIET_KNOWN_WINDOWS clean windows in a row; any other regime with a sign
        # the engine shows (methods.md s10), which no count of windows can promise
        needed = max(QUIET_KNOWN_WINDOWS - ev.quiet_streak, 0) if v.regime == "below" else 0
        if needed:
            seconds, words = _eta(needed, 1, 0.0, width)
            when = (f" It needs {plural(needed, 'more low-pressure window')} of {width:.0f} s in a row ({words}, while "
                    "the load stays this light).")
        else:
            seconds, when = None, ""
        out.append(Advice("evidence", "unknown",
                          f"KV-pressure regime {v.regime_state}: {v.regime_reason}.{when}{hint}",
                          {"figure": "regime", "state": v.regime_state, "reason": v.regime_reason,
                           "evidence_windows": ev.windows, "windows_needed": needed, "eta_seconds": seconds,
                           "kv_cache_metrics": _has_residency(v)}))
    if v.tax_state != "known":
        needed = max(REFERENCE_KNOWN_WINDOWS - v.reference_windows, 0)
        if ev.low_pressure and needed:
            seconds, words = _eta(needed, ev.low_pressure, ev.span_seconds, width)
            when = (f" It needs {plural(needed, 'more low-pressure window')} of {width:.0f} s ({words}, while the "
                    "load stays this light)")
        elif needed:
            seconds = None
            when = (f" It needs {plural(needed, 'low-pressure window')} of {width:.0f} s (KV p95 under the "
                    f"threshold, no preemption): none so far in {plural(ev.windows, 'evidence window')}")
        else:
            seconds, when = None, ""
        out.append(Advice("evidence", "unknown",
                          f"Recompute tax {v.tax_state}: {v.tax_reason}.{when}; configuring this server's "
                          "low-pressure recomputed share (docs/pressure.md) makes it known now.",
                          {"figure": "tax", "state": v.tax_state, "reason": v.tax_reason,
                           "reference_windows": v.reference_windows, "windows_needed": needed,
                           "eta_seconds": seconds}))
    return out


def _unknown_checks(v: ServerFigures) -> list[str]:
    out = []
    if v.collapse is None or v.collapse.signature is None:
        out.append("collapse signature")
    if v.info is None or v.info.offload_enabled is None:
        out.append("whether the server offloads")
    elif v.info.offload_enabled and (v.buffer is None or v.buffer.undersized is None):
        out.append("offload buffer sizing")
    return out
