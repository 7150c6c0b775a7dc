"""When is loading cheaper than recomputing (methods.md s7). Derivations in docs/offload.md.

Observed cached-to-prefill ratio, per window:
    kappa = external_kv_transfer / local_compute   (prompt tokens loaded from the offload tier per computed one)
Critical ratio, roofline (load C tokens: C*b_kv/B; compute P tokens: P*2*N_act/F):
    kappa_crit = 2*N_act*B / (F*b_kv),   b_kv = 2 * layers * kv_heads * head_dim * dtype_bytes
With attention FLOPs (P fresh tokens attend to themselves and to the C loaded ones, d = heads*head_dim):
    kappa_crit(P) = (2*N_act + 2*L*d*P)*B / (b_kv*F - 4*L*d*P*B)      (+inf when the denominator <= 0)
Tetris break-even length (recompute 4L(6*S*D^2 + S^2*D)/B_comp vs moving the KV of S tokens
``transfers`` times through the host link, S*2*d_kv*L*dtype_bytes per pass):
    K = transfers * dtype_bytes * d_kv * B_comp / (2 * D * B_mem) - 6*D
    MHA, fp16, transfers=2 (Tetris' accounting: store + load):  K = 2*B_comp/B_mem - 6*D
Negative K: reloading beats recomputing at every length; the exported gauge is clamped at 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from exporter.config import ConfigError, read_json
from exporter.derive.window import WindowAggregate, sum_delta
from exporter.samples import Interval

DTYPE_BYTES = {"float32": 4.0, "float": 4.0, "bfloat16": 2.0, "float16": 2.0, "half": 2.0,
               "float8_e4m3fn": 1.0, "float8_e5m2": 1.0, "fp8": 1.0}


# --------------------------------------------------------------------------------------------------------
# model parameters
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelParams:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: float
    active_parameters: float | None = None  # N_act: parameters touched per token (incl. embeddings)
    hidden_size: int | None = None          # D_m (Tetris)
    attention_width: int | None = None      # heads * head_dim (attention FLOPs); hidden_size if unknown
    source: str = ""

    @property
    def kv_bytes_per_token(self) -> float:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.dtype_bytes)

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: float) -> float:
    """K and V, every layer: 2 * layers * kv_heads * head_dim * dtype_bytes."""
    return 2.0 * layers * kv_heads * head_dim * dtype_bytes


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


def from_hf_config(cfg: Mapping[str, Any], source: str = "config.json") -> ModelParams:
    """ModelParams from a HF config.json mapping (text_config is used for multimodal wrappers)."""
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = cfg["text_config"]
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{source}: not a usable decoder config.json (text_config is not an object)")
    if "kv_lora_rank" in cfg:
        raise ConfigError(f"{source}: MLA models (kv_lora_rank) are not supported; configure model.* instead")
    try:
        h = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = int(_get(cfg, "head_dim") or h // heads)
        dtype = str(_get(cfg, "torch_dtype", "dtype") or "bfloat16").replace("torch.", "")
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"{source}: unknown torch_dtype {dtype!r}; set model.dtype_bytes")
        return ModelParams(layers=int(cfg["num_hidden_layers"]),
                           kv_heads=int(_get(cfg, "num_key_value_heads") or heads), head_dim=head_dim,
                           dtype_bytes=DTYPE_BYTES[dtype], active_parameters=estimate_parameters(cfg),
                           hidden_size=h, attention_width=heads * head_dim, source=source)
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:  # ArithmeticError: a size of 0 or 1e400
        raise ConfigError(f"{source}: not a usable decoder config.json ({type(e).__name__}: {e})") from None


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
    return ModelParams(int(vals["layers"]), int(vals["kv_heads"]), int(vals["head_dim"]),
                       float(vals["dtype_bytes"]), vals["active_parameters"],
                       int(vals["hidden_size"]) if vals["hidden_size"] else None,
                       int(width) if width else None,
                       source=" + ".join(x for x in (model_config_path, "configured" if model else None) if x))


# --------------------------------------------------------------------------------------------------------
# hardware parameters (docs/offload.md "Hardware defaults")
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HardwareParams:
    name: str
    flops_per_second: float              # F, achieved (peak dense BF16 x MFU)
    host_device_bytes_per_second: float  # B, one direction, effective
    source: str = ""


DEFAULT_MFU = 0.5
GEN5_X16_BYTES_PER_SECOND = 50e9  # measured one way on H100 PCIe 5 (methods.md s7)
GEN4_X16_BYTES_PER_SECOND = 25e9  # 31.5 GB/s theoretical x the 0.79 measured/theoretical ratio of Gen5

# name -> (peak dense BF16 FLOP/s, host link B, datasheet, NVML name fragments, most specific first)
GPU_TABLE: dict[str, tuple[float, float, str, tuple[str, ...]]] = {
    "H100-SXM": (989.5e12, GEN5_X16_BYTES_PER_SECOND, "NVIDIA H100 datasheet: BF16 1,979 TFLOPS with sparsity",
                 ("H100 80GB HBM3", "H100 SXM")),
    "H100-NVL": (835.5e12, GEN5_X16_BYTES_PER_SECOND, "NVIDIA H100 datasheet: BF16 1,671 TFLOPS with sparsity",
                 ("H100 NVL",)),
    "H100-PCIe": (756.5e12, GEN5_X16_BYTES_PER_SECOND, "NVIDIA H100 datasheet: BF16 1,513 TFLOPS with sparsity",
                  ("H100 PCIe",)),
    "H200": (989.5e12, GEN5_X16_BYTES_PER_SECOND, "NVIDIA H200 datasheet: BF16 1,979 TFLOPS with sparsity",
             ("H200",)),
    "A100-SXM": (312e12, GEN4_X16_BYTES_PER_SECOND, "NVIDIA A100 datasheet: BF16 312 TFLOPS dense",
                 ("A100-SXM", "A100 SXM")),
    "A100-PCIe": (312e12, GEN4_X16_BYTES_PER_SECOND, "NVIDIA A100 datasheet: BF16 312 TFLOPS dense",
                  ("A100-PCIE", "A100 PCIe", "A100 80GB PCIe")),
    "L40S": (362.05e12, GEN4_X16_BYTES_PER_SECOND, "NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense",
             ("L40S",)),
}


def gpu_defaults(name: str, mfu: float = DEFAULT_MFU) -> HardwareParams | None:
    """Defaults for a table key ("H100-SXM") or an NVML device name ("NVIDIA H100 80GB HBM3")."""
    key = name if name in GPU_TABLE else None
    if key is None:
        low = name.lower()
        for k, (_, _, _, frags) in GPU_TABLE.items():
            if any(f.lower() in low for f in frags):
                key = k
                break
    if key is None:
        return None
    peak, link, sheet, _ = GPU_TABLE[key]
    return HardwareParams(key, peak * mfu, link, f"{sheet}; x {mfu:g} MFU (assumed); link per docs/offload.md")


def hardware_params(hardware: Mapping[str, Any], nvml_name: str | None = None) -> HardwareParams | None:
    """hardware.gpu_model (or the NVML name) picks a default row; flops_per_second and
    host_device_bytes_per_second override it. None when F or B stays unknown."""
    base = gpu_defaults(str(hardware.get("gpu_model") or nvml_name or ""))
    if hardware.get("gpu_model") and base is None:
        raise ConfigError(f"hardware.gpu_model: unknown GPU {hardware['gpu_model']!r} "
                          f"(known: {', '.join(GPU_TABLE)}); set flops_per_second and host_device_bytes_per_second")
    f = hardware.get("flops_per_second") or (base.flops_per_second if base else None)
    b = hardware.get("host_device_bytes_per_second") or (base.host_device_bytes_per_second if base else None)
    if f is None or b is None:
        return None
    configured = [k for k in ("flops_per_second", "host_device_bytes_per_second") if k in hardware]
    src = (base.source if base else "") + (f"; configured: {', '.join(configured)}" if configured else "")
    return HardwareParams(base.name if base else "configured", float(f), float(b), src.strip("; "))


# --------------------------------------------------------------------------------------------------------
# the ratios
# --------------------------------------------------------------------------------------------------------
def observed(x: WindowAggregate | Sequence[Interval]) -> float | None:
    """kappa over the window (an aggregate or a list of intervals): external_kv_transfer / local_compute
    prompt tokens. None without the token-source counters (vLLM < 0.16) or without prompt tokens; +inf when
    only loaded tokens arrived."""
    ext = sum_delta(x, "prompt_external_kv_transfer")
    local = sum_delta(x, "prompt_local_compute")
    if ext is None or local is None or (ext == 0 and local == 0):
        return None
    return math.inf if local == 0 else ext / local


def critical(m: ModelParams, hw: HardwareParams) -> float | None:
    """Roofline kappa_crit = 2*N_act*B / (F*b_kv): per-token recompute time over per-token load time."""
    if m.active_parameters is None:
        return None
    return 2.0 * m.active_parameters * hw.host_device_bytes_per_second / (hw.flops_per_second * m.kv_bytes_per_token)


def critical_with_attention(m: ModelParams, hw: HardwareParams, fresh_tokens: float) -> float | None:
    """kappa_crit(P) = (2*N_act + 2*L*d*P)*B / (b_kv*F - 4*L*d*P*B); +inf when attention over the loaded
    context alone outruns the link (never transfer-bound)."""
    if m.active_parameters is None:
        return None
    d = m.attention_width or m.hidden_size
    if d is None:
        return None
    B, F, L, P = hw.host_device_bytes_per_second, hw.flops_per_second, m.layers, fresh_tokens
    den = m.kv_bytes_per_token * F - 4.0 * L * d * P * B
    if den <= 0:
        return math.inf
    return (2.0 * m.active_parameters + 2.0 * L * d * P) * B / den


def breakeven_tokens(hidden_size: float, kv_width: float, dtype_bytes: float, flops_per_second: float,
                     bytes_per_second: float, transfers: int = 2) -> float:
    """Tetris break-even K (may be negative: reloading wins at every length).
    K = transfers * dtype_bytes * d_kv * B_comp / (2 * D * B_mem) - 6*D."""
    D = hidden_size
    return transfers * dtype_bytes * kv_width * flops_per_second / (2.0 * D * bytes_per_second) - 6.0 * D


def tetris_mha_breakeven_tokens(hidden_size: float, flops_per_second: float, bytes_per_second: float) -> float:
    """The published MHA/fp16 form: K = 2*B_comp/B_mem - 6*D_m."""
    return 2.0 * flops_per_second / bytes_per_second - 6.0 * hidden_size


@dataclass(frozen=True)
class Breakeven:
    mha_tokens: float        # Tetris as published (d_kv = D, fp16)
    gqa_tokens: float        # with the model's KV width and dtype
    exported_tokens: float   # max(0, gqa_tokens): the gauge


def breakeven(m: ModelParams, hw: HardwareParams, transfers: int = 2) -> Breakeven | None:
    if m.hidden_size is None:
        return None
    F, B, D = hw.flops_per_second, hw.host_device_bytes_per_second, m.hidden_size
    gqa = breakeven_tokens(D, m.kv_width, m.dtype_bytes, F, B, transfers)
    return Breakeven(tetris_mha_breakeven_tokens(D, F, B) if transfers == 2 else
                     breakeven_tokens(D, D, 2.0, F, B, transfers), gqa, max(0.0, gqa))
