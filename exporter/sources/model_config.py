"""A served model's parameters for kappa_crit and the Tetris break-even (methods.md s7): read from a HF
config.json at start-up and/or configured (servers[].model.*). The configuration side of derive/kappa.py,
which receives the numbers (ModelParams) and reads no file. A problem is a ConfigError naming the file.
"""

from __future__ import annotations

from typing import Any, Mapping

from exporter.config import ConfigError, read_json
from exporter.config.schema import MODEL_SHAPE_MAXIMA, positive_int
from exporter.samples import ModelParams, kv_bytes_per_token  # noqa: F401 (re-exported)

DTYPE_BYTES = {"float32": 4.0, "float": 4.0, "bfloat16": 2.0, "float16": 2.0, "half": 2.0,
               "float8_e4m3fn": 1.0, "float8_e5m2": 1.0, "fp8": 1.0}


def _get(cfg: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


def estimate_parameters(cfg: Mapping[str, Any]) -> float:
    """Parameters a token passes through, from a HF config.json of a decoder (Llama/Qwen/Mistral family):
    embeddings + lm_head (unless tied) + per layer [q, k, v, o projections (+ biases if attention_bias),
    gated MLP 3*hidden*intermediate, or for MoE experts_per_tok routed + shared experts + router, two norms]
    + final norm. This reproduces the model-card sizes (8.03B, 32.8B, 70.6B) that methods.md's kappa_crit
    examples use; counting the input embedding (a lookup, no FLOPs) overstates compute by 3-7 %."""
    h = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv = int(_get(cfg, "num_key_value_heads") or heads)
    hd = int(_get(cfg, "head_dim") or h // heads)
    vocab = int(cfg.get("vocab_size", 0))
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if cfg.get("attention_bias") or cfg.get("model_type") == "qwen2":
        attn += heads * hd + 2 * kv * hd
    experts = _get(cfg, "num_experts", "num_local_experts", "n_routed_experts")
    if experts:
        per_tok = int(_get(cfg, "num_experts_per_tok", "moe_topk") or 1)
        moe_inter = int(_get(cfg, "moe_intermediate_size", "intermediate_size"))
        shared_inter = int(_get(cfg, "shared_expert_intermediate_size") or 0)
        shared_inter += int(_get(cfg, "n_shared_experts") or 0) * moe_inter
        mlp = 3 * h * moe_inter * per_tok + 3 * h * shared_inter + h * int(experts)
    else:
        mlp = 3 * h * int(cfg["intermediate_size"])
    per_layer = attn + mlp + 2 * h
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return float(layers * per_layer + embed + h)


def engine_write_bytes(cfg: Mapping[str, Any], dtype_bytes: float) -> tuple[float, float] | tuple[None, None]:
    """(bytes per scheduled token, bytes per logits token) of vLLM's write-traffic estimate
    (vllm:estimated_write_bytes_per_gpu_total, --enable-mfu-metrics; vllm/v1/metrics/perf.py, 0.17+) for a dense
    decoder on one GPU, the KV cache in the model's dtype. Per layer, attention writes q, k, v
    ((heads + 2 kv_heads) x head_dim), the KV cache (2 kv_heads x head_dim) and its output (hidden); the gated MLP
    writes up+gate (2 x intermediate), the activation (intermediate) and down (hidden). The LM head writes a
    vocabulary row per token that gets logits. Its input is the token count of every step, so it includes
    re-prefills after preemption (methods.md s4). (None, None) for MoE models, which kvwatt does not model."""
    if _get(cfg, "num_experts", "num_local_experts", "n_routed_experts"):
        return None, None
    h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv = int(_get(cfg, "num_key_value_heads") or heads)
    hd = int(_get(cfg, "head_dim") or h // heads)
    inter, layers, vocab = int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    attention = (heads + 2 * kv) * hd * dtype_bytes + 2 * kv * hd * dtype_bytes + h * dtype_bytes
    mlp = 3 * inter * dtype_bytes + h * dtype_bytes
    return float(layers * (attention + mlp)), float(vocab * dtype_bytes)


def from_hf_config(cfg: Mapping[str, Any], source: str = "config.json") -> ModelParams:
    """ModelParams from a HF config.json mapping (text_config is used for multimodal wrappers)."""
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = cfg["text_config"]
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{source}: not a usable decoder config.json (text_config is not an object)")
    if "kv_lora_rank" in cfg:
        raise ConfigError(f"{source}: MLA models (kv_lora_rank) are not supported; configure model.* instead")
    _check_shape(cfg, source)
    try:
        h = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = int(_get(cfg, "head_dim") or h // heads)
        dtype = str(_get(cfg, "torch_dtype", "dtype") or "bfloat16").replace("torch.", "")
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"{source}: unknown torch_dtype {dtype!r}; set model.dtype_bytes")
        writes = engine_write_bytes(cfg, DTYPE_BYTES[dtype])
        return ModelParams(layers=int(cfg["num_hidden_layers"]),
                           kv_heads=int(_get(cfg, "num_key_value_heads") or heads), head_dim=head_dim,
                           dtype_bytes=DTYPE_BYTES[dtype], active_parameters=estimate_parameters(cfg),
                           hidden_size=h, attention_width=heads * head_dim, source=source,
                           engine_write_bytes_per_token=writes[0], engine_write_bytes_per_logits_token=writes[1])
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:  # ArithmeticError: a size of 0 or 1e400
        raise ConfigError(f"{source}: not a usable decoder config.json ({type(e).__name__}: {e})") from None


# config.json's shape keys, held to the configured model.* keys' bounds (0 layers gave a ZeroDivisionError
# traceback at start-up, in check-config and run alike)
SHAPE_KEYS = {"num_hidden_layers": "layers", "num_attention_heads": "kv_heads", "num_key_value_heads": "kv_heads",
              "head_dim": "head_dim", "hidden_size": "hidden_size"}


def _check_shape(cfg: Mapping[str, Any], source: str) -> None:
    """Each shape count config.json gives is a positive integer within MODEL_SHAPE_MAXIMA (ConfigError)."""
    for key, bound in SHAPE_KEYS.items():
        if cfg.get(key) is not None:
            positive_int(cfg[key], f"{source}: {key}", MODEL_SHAPE_MAXIMA[bound])


def load_hf_config(path: str) -> ModelParams:
    data = read_json(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return from_hf_config(data, path)


def model_params(model_config_path: str | None, model: Mapping[str, float]) -> ModelParams | None:
    """The server's model: config.json if given, then each configured model.* key overrides it.
    None when layers, kv_heads, head_dim or dtype_bytes stay unknown (kappa_crit then absent)."""
    base = load_hf_config(model_config_path) if model_config_path else None
    def pick(key: str, attr: str):
        if key in model:
            return model[key]
        return getattr(base, attr) if base else None
    vals = {k: pick(k, k) for k in ("layers", "kv_heads", "head_dim", "dtype_bytes", "active_parameters",
                                    "hidden_size")}
    if any(vals[k] is None for k in ("layers", "kv_heads", "head_dim", "dtype_bytes")):
        return None
    width = base.attention_width if base and "hidden_size" not in model else vals["hidden_size"]
    # the write-traffic model rests on config.json's shapes: a configured shape leaves it unknown
    reshaped = any(k in model for k in ("layers", "kv_heads", "head_dim", "dtype_bytes", "hidden_size"))
    writes = (None, None) if base is None or reshaped else (base.engine_write_bytes_per_token,
                                                            base.engine_write_bytes_per_logits_token)
    return ModelParams(layers=int(vals["layers"]), kv_heads=int(vals["kv_heads"]), head_dim=int(vals["head_dim"]),
                       dtype_bytes=float(vals["dtype_bytes"]), active_parameters=vals["active_parameters"],
                       hidden_size=int(vals["hidden_size"]) if vals["hidden_size"] else None,
                       attention_width=int(width) if width else None,
                       source=" + ".join(x for x in (model_config_path, "configured" if model else None) if x),
                       engine_write_bytes_per_token=writes[0], engine_write_bytes_per_logits_token=writes[1])
