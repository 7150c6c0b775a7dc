"""What an exposition no adapter can use looks like, in words a reason can carry (docs/engines.md "Metrics
paths"): an operator pointed at the wrong port or path reads what to change, not "no usable vllm: series".

Only called when no registered adapter recognised the text, so it costs nothing on a good read. Each shape is
a cheap test on the text; the first that matches names it.
"""

from __future__ import annotations

import re

# The known engines' and add-ons' own prefixes, for the reason given when no shape matches.
KNOWN_PREFIXES = "vllm:, sglang:/sglang_, trtllm_, lmcache:, dynamo_component_kvstats_, kvbm_"

# trtllm-serve's first Prometheus series (tensorrt_llm/metrics/collector.py before the trtllm_ prefix and the
# KV-cache series; NVIDIA/TensorRT-LLM PR #5785): request latencies only, model_name="undefined" when unset.
TRTLLM_LATENCY = ("e2e_request_latency_seconds", "time_to_first_token_seconds", "time_per_output_token_seconds",
                  "request_queue_time_seconds")
_FAMILY = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", re.M)


def _families(text: str, limit: int = 5) -> list[str]:
    """The first ``limit`` distinct family names of the text (comments skipped), for a reason."""
    seen: list[str] = []
    for m in _FAMILY.finditer(text):
        name = re.sub(r"_(bucket|sum|count|total|created)$", "", m.group(1))
        if name not in seen:
            seen.append(name)
            if len(seen) == limit:
                break
    return seen


def _has_family(text: str, name: str) -> bool:
    return text.startswith(name) or f"\n{name}" in text


def known_shape(text: str) -> str | None:
    """One line saying what the text is and what to do, for a ``parse_error`` reason; None when the text has
    none of the shapes below (a vLLM read then says what it found)."""
    head = text.lstrip()[:1]
    if head in ("{", "["):
        return ("a JSON body, not a Prometheus exposition (trtllm-serve answers JSON iteration statistics on "
                "/metrics: put its Prometheus path in the server URL, http://HOST:PORT/prometheus/metrics)")
    if _has_family(text, "dynamo_frontend_"):
        return ("Dynamo frontend series only (dynamo_frontend_*: requests and latencies, no KV-cache series): "
                "point kvwatt at each worker's system port (DYN_SYSTEM_PORT, e.g. http://WORKER:8081) instead")
    if any(_has_family(text, name) for name in TRTLLM_LATENCY):
        return ("TensorRT-LLM latency series only (e2e_request_latency_seconds, time_to_first_token_seconds, "
                "no prefix): no KV-cache series; start trtllm-serve from a release that exports "
                "trtllm_kv_cache_utilization on /prometheus/metrics, with enable_iter_perf_stats: true in "
                "--extra_llm_api_options")
    return None


def unknown_shape(text: str) -> str:
    """What a text with no known engine's series starts with."""
    if not text.strip():
        return "an empty body"
    families = _families(text)
    if not families:
        return "no Prometheus series in the body"
    return f"no series of a known engine ({KNOWN_PREFIXES}); the exposition starts with {', '.join(families)}"
