"""Expositions of engines as they run in production: parallel ranks, a router, the shapes no adapter
can use. Each is one frame at ``T0`` seconds of steady load: every counter is its rate times ``T0``, so
``at(text, t)`` gives the frame at ``t`` seconds (counters scaled, gauges kept) and a series of frames served
over loopback has known rates. tests/data/engines/shapes.py writes them under tests/data/<engine>/ (flat files:
the per-kind frame directories are engine_expositions.py's); the READMEs there say what each is shaped after.
"""

from __future__ import annotations

import json
import re

T0 = 100.0  # seconds of load the frames show
MODEL = "deepseek-ai/DeepSeek-V3"

# per DP rank: generated tokens/s, prompt tokens/s, retractions/s, KV pool usage (two pools above 0.90)
DP_RANKS = 8
DP_GEN = tuple(100.0 * (r + 1) for r in range(DP_RANKS))
DP_PROMPT = tuple(400.0 + 50.0 * r for r in range(DP_RANKS))
DP_RETRACT = tuple(0.01 * r for r in range(DP_RANKS))
DP_USAGE = (0.30, 0.40, 0.50, 0.60, 0.70, 0.80, 0.93, 0.97)
DP_POOLS_ABOVE_090 = 2

PP_GEN, PP_PROMPT, PP_USAGE = 250.0, 900.0, (0.55, 0.62)  # one engine, two pipeline stages
ROUTER_WORKERS = ("http://10.0.0.11:30000", "http://10.0.0.12:30000", "http://10.0.0.13:30000")
ROUTER_GEN, ROUTER_USAGE = (300.0, 500.0, 700.0), (0.45, 0.91, 0.60)


def _labels(d: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in d.items()) + "}"


def _family(prefix: str, name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> str:
    lines = [f"# HELP {prefix}{name} {help_}", f"# TYPE {prefix}{name} {kind}"]
    suffix = "_total" if kind == "counter" else ""
    lines += [f"{prefix}{name}{suffix}{_labels(lab)} {v!r}" for lab, v in samples]
    return "\n".join(lines) + "\n"


def _sglang(prefix: str, ranks: list[dict], gen, prompt, retract, usage, pid: bool) -> str:
    """SGLang's scheduler and tokenizer series, one sample per rank (labels as SGLang's collectors write them:
    model_name, engine_type, tp_rank, pp_rank, moe_ep_rank, dp_rank with DP attention; prometheus_client's
    multiprocess mode adds ``pid`` to the gauges)."""
    def gauge_labels(i: int, lab: dict) -> dict:
        return {**lab, "pid": str(4100 + i)} if pid else lab
    out = [
        _family(prefix, "num_running_reqs", "gauge", "The number of running requests.",
                [(gauge_labels(i, lab), 16.0) for i, lab in enumerate(ranks)]),
        _family(prefix, "token_usage", "gauge", "The token usage.",
                [(gauge_labels(i, lab), usage[i]) for i, lab in enumerate(ranks)]),
        _family(prefix, "num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
                [(gauge_labels(i, lab), 2.0) for i, lab in enumerate(ranks)]),
        _family(prefix, "num_retracted_requests", "counter", "Total number of retracted requests.",
                [(lab, round(retract[i] * T0, 6)) for i, lab in enumerate(ranks)]),
        _family(prefix, "prompt_tokens", "counter", "Number of prefill tokens processed.",
                [(lab, prompt[i] * T0) for i, lab in enumerate(ranks)]),
        _family(prefix, "generation_tokens", "counter", "Number of generation tokens processed.",
                [(lab, gen[i] * T0) for i, lab in enumerate(ranks)]),
    ]
    return "".join(out)


def sglang_dp_attention() -> str:
    """``--tp 8 --dp 8 --enable-dp-attention``: each DP rank its own scheduler, ``tp_rank`` = ``dp_rank``."""
    ranks = [{"model_name": MODEL, "engine_type": "unified", "tp_rank": str(r), "pp_rank": "0",
              "moe_ep_rank": str(r), "dp_rank": str(r)} for r in range(DP_RANKS)]
    return _sglang("sglang:", ranks, DP_GEN, DP_PROMPT, DP_RETRACT, DP_USAGE, pid=True)


def sglang_pipeline(stages: tuple[int, ...] = (0, 1)) -> str:
    """``--pp 2``: both stages report the engine's figures (stage 1 alone on another node's endpoint)."""
    ranks = [{"model_name": MODEL, "engine_type": "unified", "tp_rank": "0", "pp_rank": str(s),
              "moe_ep_rank": "0"} for s in stages]
    n = len(stages)
    return _sglang("sglang:", ranks, (PP_GEN,) * n, (PP_PROMPT,) * n, (0.0,) * n,
                   tuple(PP_USAGE[s] for s in stages), pid=False)


def sglang_router() -> str:
    """A router / gateway re-exporting its workers' series with the ``sglang_`` prefix and ``worker_addr``;
    each worker has TP 2 (rank 1 repeats rank 0)."""
    ranks, gen, prompt, retract, usage = [], [], [], [], []
    for w, addr in enumerate(ROUTER_WORKERS):
        for tp in (0, 1):
            ranks.append({"worker_addr": addr, "model_name": MODEL, "tp_rank": str(tp), "pp_rank": "0"})
            gen.append(ROUTER_GEN[w])
            prompt.append(4 * ROUTER_GEN[w])
            retract.append(0.0)
            usage.append(ROUTER_USAGE[w])
    return _sglang("sglang_", ranks, gen, prompt, retract, usage, pid=False)


def trtllm_latency_only() -> str:
    """trtllm-serve's first /prometheus/metrics (TensorRT-LLM PR #5785): request latencies, no prefix,
    ``model_name="undefined"``, no KV-cache series."""
    lab = {"engine_type": "undefined", "model_name": "undefined"}
    out = []
    for name, help_ in (("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds."),
                        ("time_to_first_token_seconds", "Histogram of time to first token in seconds."),
                        ("time_per_output_token_seconds", "Histogram of time per output token in seconds."),
                        ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.")):
        out.append(f"# HELP {name} {help_}\n# TYPE {name} histogram\n")
        out += [f'{name}_bucket{_labels({**lab, "le": le})} 2.0\n' for le in ("0.3", "1.0", "+Inf")]
        out.append(f"{name}_count{_labels(lab)} 2.0\n{name}_sum{_labels(lab)} 0.42\n")
    out.append("# HELP request_success_total Count of successfully processed requests.\n"
               "# TYPE request_success_total counter\n"
               f'request_success_total{_labels({**lab, "finish_reason": "stop"})} 2.0\n')
    return "".join(out)


def trtllm_iteration_json() -> str:
    """What trtllm-serve's /metrics answers: a JSON list of iteration statistics, not an exposition."""
    return json.dumps([{"gpuMemUsage": 7.1e10, "iter": 41, "iterLatencyMS": 12.5, "numActiveRequests": 3,
                        "kvCacheStats": {"maxNumBlocks": 4096, "usedNumBlocks": 1830, "tokensPerBlock": 32}}],
                      indent=1) + "\n"


def dynamo_frontend() -> str:
    """A Dynamo HTTP frontend's /metrics: ``dynamo_frontend_*`` requests and latencies (label ``model``)."""
    lab = {"model": MODEL}
    return "".join([
        _family("dynamo_frontend_", "requests", "counter", "Total number of LLM requests processed",
                [({**lab, "endpoint": "chat_completions", "request_type": "stream", "status": "success"}, 812.0)]),
        _family("dynamo_frontend_", "inflight_requests", "gauge", "Number of inflight requests", [(lab, 12.0)]),
        _family("dynamo_frontend_", "queued_requests", "gauge", "Number of requests in HTTP processing queue",
                [(lab, 0.0)]),
        "# HELP dynamo_frontend_time_to_first_token_seconds Time to first token in seconds\n"
        "# TYPE dynamo_frontend_time_to_first_token_seconds histogram\n"
        f'dynamo_frontend_time_to_first_token_seconds_bucket{_labels({**lab, "le": "+Inf"})} 812\n'
        f"dynamo_frontend_time_to_first_token_seconds_sum{_labels(lab)} 97.4\n"
        f"dynamo_frontend_time_to_first_token_seconds_count{_labels(lab)} 812\n",
    ])


_COUNTER = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*_total(?:\{[^}]*\})?) (\S+)$", re.M)


def at(text: str, t: float) -> str:
    """The frame at ``t`` seconds of the same load: each ``*_total`` sample scaled by t / T0."""
    return _COUNTER.sub(lambda m: f"{m.group(1)} {float(m.group(2)) * t / T0!r}", text)


# tests/data/<engine>/<file> -> builder
FRAMES = {
    ("sglang", "dp-attention-8.prom"): sglang_dp_attention,
    ("sglang", "pipeline-2.prom"): sglang_pipeline,
    ("sglang", "router-3-workers.prom"): sglang_router,
    ("trtllm", "latency-only.prom"): trtllm_latency_only,
    ("trtllm", "metrics.json"): trtllm_iteration_json,
    ("dynamo", "frontend.prom"): dynamo_frontend,
}
