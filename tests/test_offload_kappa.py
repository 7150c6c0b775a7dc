"""kappa, kappa_crit and the Tetris break-even (methods.md s7) against hand calculations.

Inputs for the three models are their published HF config.json values (hidden, layers, heads, KV heads,
head_dim, intermediate, vocab, bf16, untied embeddings). Hardware: H100 SXM, 989.5 TFLOPS dense BF16 x 50 %
MFU = 494.75 TFLOP/s; 50 GB/s host-device (methods.md s7). methods.md gives kappa_crit ~12, ~25, ~44.
"""

from __future__ import annotations

import json
import math

import pytest

from exporter.config import ConfigError
from exporter.derive import kappa as K
from exporter.samples import Interval
from exporter.sources import model_config as MC
from tests.support.aggregates import aggregate_of

LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16",
            "tie_word_embeddings": False, "model_type": "llama"}
QWEN3_32B = {"hidden_size": 5120, "intermediate_size": 25600, "num_attention_heads": 64, "num_hidden_layers": 64,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "torch_dtype": "bfloat16",
             "tie_word_embeddings": False, "model_type": "qwen3"}
LLAMA_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80,
             "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16",
             "tie_word_embeddings": False, "model_type": "llama"}
F = 0.5 * 989.5e12
B = 50e9
H100 = K.HardwareParams("H100-SXM", F, B)


def hand_params(h, L, heads, kv, hd, inter, vocab):
    """Parameter count by hand: per layer q,k,v,o + gated MLP + 2 norms; embeddings and lm_head; final norm."""
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * inter + 2 * h
    return L * per_layer + 2 * vocab * h + h


# (config, hand N_act, b_kv bytes, kappa_crit rounded as in methods.md)
CASES = {
    "Llama-3.1-8B": (LLAMA_8B, hand_params(4096, 32, 32, 8, 128, 14336, 128256), 2 * 32 * 8 * 128 * 2, 12),
    "Qwen3-32B": (QWEN3_32B, hand_params(5120, 64, 64, 8, 128, 25600, 151936), 2 * 64 * 8 * 128 * 2, 25),
    "Llama-3.1-70B": (LLAMA_70B, hand_params(8192, 80, 64, 8, 128, 28672, 128256), 2 * 80 * 8 * 128 * 2, 44),
}


@pytest.mark.parametrize("name", CASES)
def test_kappa_crit_reproduces_methods_examples(name):
    cfg, n_act, b_kv, rounded = CASES[name]
    m = MC.from_hf_config(cfg)
    assert m.active_parameters == n_act
    assert m.kv_bytes_per_token == b_kv
    expected = 2 * n_act * B / (F * b_kv)
    assert K.critical(m, H100) == pytest.approx(expected)
    assert round(K.critical(m, H100)) == rounded


def test_parameter_counts_match_model_cards():
    assert MC.estimate_parameters(LLAMA_8B) / 1e9 == pytest.approx(8.03, abs=0.01)
    assert MC.estimate_parameters(QWEN3_32B) / 1e9 == pytest.approx(32.8, abs=0.05)
    assert MC.estimate_parameters(LLAMA_70B) / 1e9 == pytest.approx(70.6, abs=0.06)


def test_kappa_crit_exact_values():
    # 8B:  2 x  8,030,261,248 x 50e9 / (494.75e12 x 131,072) = 12.383
    # 32B: 2 x 32,762,106,880 x 50e9 / (494.75e12 x 262,144) = 25.261
    # 70B: 2 x 70,553,706,496 x 50e9 / (494.75e12 x 327,680) = 43.520
    assert K.critical(MC.from_hf_config(LLAMA_8B), H100) == pytest.approx(12.383, abs=0.001)
    assert K.critical(MC.from_hf_config(QWEN3_32B), H100) == pytest.approx(25.261, abs=0.001)
    assert K.critical(MC.from_hf_config(LLAMA_70B), H100) == pytest.approx(43.520, abs=0.001)


def test_attention_width_is_heads_times_head_dim():
    # Qwen3-32B's attention width is heads x head_dim = 8192, not hidden 5120
    assert MC.from_hf_config(QWEN3_32B).attention_width == 8192


def test_breakeven_mha_is_tetris_and_gqa_falls():
    m = MC.from_hf_config(LLAMA_8B)
    be = K.breakeven(m, H100)
    # Tetris MHA fp16: K = 2 x 494.75e12 / 50e9 - 6 x 4096 = 19,790 - 24,576 = -4,786
    assert be.mha_tokens == pytest.approx(-4786.0)
    # GQA: d_kv = 8 x 128 = 1024 -> 2 x 2 x 1024 x 494.75e12 / (2 x 4096 x 50e9) - 24,576 = 4,947.5 - 24,576
    assert be.gqa_tokens == pytest.approx(-19628.5)
    assert be.exported_tokens == 0.0  # reloading wins at every length on H100 at 50 GB/s
    # the general form reduces to Tetris for MHA, fp16, two transfers
    assert K.breakeven_tokens(4096, 4096, 2, F, B) == pytest.approx(K.tetris_mha_breakeven_tokens(4096, F, B))


@pytest.mark.parametrize("name,mha,gqa", [("Qwen3-32B", 19790 - 30720, 19790 * 1024 / 5120 - 30720),
                                          ("Llama-3.1-70B", 19790 - 49152, 19790 * 1024 / 8192 - 49152)])
def test_breakeven_other_models(name, mha, gqa):
    be = K.breakeven(MC.from_hf_config(CASES[name][0]), H100)
    assert be.mha_tokens == pytest.approx(mha) and be.gqa_tokens == pytest.approx(gqa)


def test_breakeven_positive_on_a_slow_tier():
    # 5 GB/s (an NVMe-class tier): B_comp/B_mem = 98,950 FLOP/byte
    slow = K.HardwareParams("slow", F, 5e9)
    be = K.breakeven(MC.from_hf_config(LLAMA_8B), slow)
    assert be.mha_tokens == pytest.approx(2 * 98950 - 24576)          # 173,324
    assert be.gqa_tokens == pytest.approx(0.25 * 2 * 98950 - 24576)   # 24,899
    assert be.exported_tokens == be.gqa_tokens
    # load-only accounting (transfers=1) halves the first term
    assert K.breakeven_tokens(4096, 1024, 2, F, 5e9, transfers=1) == pytest.approx(0.25 * 98950 - 24576)


def test_observed_kappa():
    ivs = [Interval(t0=0, t1=1, deltas={"prompt_external_kv_transfer": 165.0, "prompt_local_compute": 33.0}, gauges={}),
           Interval(t0=1, t1=2, deltas={"prompt_external_kv_transfer": 35.0, "prompt_local_compute": 17.0}, gauges={})]
    assert K.observed(aggregate_of(ivs)) == pytest.approx(200 / 50)
    none = {"prompt_local_compute": 0.0, "prompt_external_kv_transfer": 0.0}
    assert K.observed(aggregate_of([Interval(t0=0, t1=1, deltas=none, gauges={})])) is None
    only_loaded = {"prompt_local_compute": 0.0, "prompt_external_kv_transfer": 5.0}
    assert K.observed(aggregate_of([Interval(t0=0, t1=1, deltas=only_loaded, gauges={})])) == math.inf
    # vLLM < 0.16
    assert K.observed(aggregate_of([Interval(t0=0, t1=1, deltas={"prompt_tokens": 5.0}, gauges={})])) is None


def test_config_file_and_overrides(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_8B))
    m = MC.model_params(str(path), {})
    assert m.layers == 32 and m.kv_heads == 8 and m.head_dim == 128 and m.dtype_bytes == 2
    m = MC.model_params(str(path), {"dtype_bytes": 1.0})  # fp8 KV cache: configured key wins
    assert m.kv_bytes_per_token == 65536
    only = MC.model_params(None, {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2,
                                 "active_parameters": 8.03e9, "hidden_size": 4096})
    assert K.critical(only, H100) == pytest.approx(2 * 8.03e9 * B / (F * 131072))
    assert MC.model_params(None, {"layers": 32}) is None
    assert K.critical(MC.model_params(None, {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}),
                      H100) is None  # no active parameters: unknown, not 0


def test_bad_config_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        MC.load_hf_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        MC.load_hf_config(str(bad))
    bad.write_text(json.dumps({"hidden_size": 4096}))
    with pytest.raises(ConfigError, match="not a usable decoder"):
        MC.load_hf_config(str(bad))
    bad.write_text(json.dumps({**LLAMA_8B, "torch_dtype": "int3"}))
    with pytest.raises(ConfigError, match="dtype"):
        MC.load_hf_config(str(bad))


def test_hardware_defaults_and_overrides():
    assert K.gpu_defaults("NVIDIA H100 80GB HBM3").name == "H100-SXM"
    assert K.gpu_defaults("NVIDIA H100 PCIe").name == "H100-PCIe"
    assert K.gpu_defaults("NVIDIA H200").flops_per_second == pytest.approx(494.75e12)
    assert K.gpu_defaults("NVIDIA A100-SXM4-80GB").host_device_bytes_per_second == 25e9
    assert K.gpu_defaults("NVIDIA L40S").flops_per_second == pytest.approx(181.025e12)
    assert K.gpu_defaults("Tesla T4") is None
    hw = K.hardware_params({"gpu_model": "H100-SXM", "host_device_bytes_per_second": 40e9})
    assert hw.flops_per_second == pytest.approx(494.75e12) and hw.host_device_bytes_per_second == 40e9
    assert "configured" in hw.source and "datasheet" in hw.source
    assert K.hardware_params({}, nvml_name="NVIDIA H200").name == "H200"
    assert K.hardware_params({}) is None
    with pytest.raises(ConfigError, match="unknown GPU"):
        K.hardware_params({"gpu_model": "Z9000"})


def test_moe_active_parameters():
    moe = {"hidden_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 4,
           "head_dim": 128, "vocab_size": 1000, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 768, "torch_dtype": "bfloat16", "tie_word_embeddings": True}
    attn = 2048 * 16 * 128 + 2 * 2048 * 4 * 128 + 16 * 128 * 2048
    mlp = 3 * 2048 * 768 * 2 + 2048 * 8
    assert MC.estimate_parameters(moe) == 2 * (attn + mlp + 2 * 2048) + 1000 * 2048 + 2048
