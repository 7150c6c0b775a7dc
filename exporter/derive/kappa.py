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

Pure: the model's numbers (ModelParams) come from the configuration side (sources/model_config.py reads a
config.json at start-up); nothing here reads a file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from exporter.config import ConfigError
from exporter.samples import ModelParams
from exporter.store import WindowAggregate

__all__ = ["ModelParams", "HardwareParams", "GPU_TABLE", "gpu_defaults", "hardware_params", "observed",
           "critical", "tier_critical", "breakeven_tokens", "tetris_mha_breakeven_tokens", "Breakeven", "breakeven"]


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
def observed(x: WindowAggregate) -> float | None:
    """kappa over the window: external_kv_transfer / local_compute
    prompt tokens. None without the token-source counters (vLLM < 0.16) or without prompt tokens; +inf when
    only loaded tokens arrived."""
    ext = x.delta("prompt_external_kv_transfer")
    local = x.delta("prompt_local_compute")
    if ext is None or local is None or (ext == 0 and local == 0):
        return None
    return math.inf if local == 0 else ext / local


def critical(m: ModelParams, hw: HardwareParams) -> float | None:
    """Roofline kappa_crit = 2*N_act*B / (F*b_kv): per-token recompute time over per-token load time."""
    if m.active_parameters is None:
        return None
    return 2.0 * m.active_parameters * hw.host_device_bytes_per_second / (hw.flops_per_second * m.kv_bytes_per_token)


def tier_critical(link_critical: float, link_bytes_per_second: float, tier_read_bytes_per_second: float) -> float:
    """kappa_crit of a reload from a secondary tier (methods.md s14): a token's KV crosses the tier's read (into the
    CPU tier, at its measured bandwidth B_t) and then the host link (B), one after the other, so its load time is
    b_kv/B_t + b_kv/B and kappa_crit_t = 2*N_act / (F*b_kv*(1/B_t + 1/B)) = kappa_crit x B_t / (B_t + B)."""
    return link_critical * tier_read_bytes_per_second / (tier_read_bytes_per_second + link_bytes_per_second)


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
