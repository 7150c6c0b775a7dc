"""The real-engine harness (tests/support/engine.py) starts vLLM, serves the tiny model, and cleans up."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from tests.support.engine import SERVED_MODEL_NAME, VllmEngine, build_tiny_model, group_members

pytestmark = pytest.mark.engine


def _post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


def test_tiny_model_is_cached(tmp_path):
    model_dir = build_tiny_model(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (2048, 128, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["max_position_embeddings"] >= 8192
    before = os.stat(os.path.join(model_dir, "model.safetensors")).st_mtime_ns
    assert build_tiny_model(tmp_path / "m") == model_dir
    assert os.stat(os.path.join(model_dir, "model.safetensors")).st_mtime_ns == before


# started by the pool (the harness's start), stopped here: the plain 2000-block one, which test_energy_engine's
# and test_offload_engine's shard starts anyway (any shape would do: nothing here reads the residency record)
@pytest.mark.takes_engine(blocks=2000, max_model_len=4096)
def test_engine_serves_exact_lengths_and_stops_cleanly(engines):
    engine = engines.take(blocks=2000, max_model_len=4096)
    with engine:
        assert engine.url == f"http://127.0.0.1:{engine.port}"
        body = {"model": SERVED_MODEL_NAME, "prompt": list(range(10, 110)), "max_tokens": 7, "min_tokens": 7,
                "ignore_eos": True, "return_token_ids": True}
        reply = _post_json(engine.url + "/v1/completions", body)
        assert reply["usage"]["prompt_tokens"] == 100
        assert len(reply["choices"][0]["token_ids"]) == reply["usage"]["completion_tokens"] == 7
        metrics = engine.metrics_text()
        assert "vllm:cache_config_info{" in metrics
        assert 'vllm:prompt_tokens_total{' in metrics
        pid = engine._proc.pid
        assert len(group_members(pid)) >= 2  # API server + engine core (+ worker) share the group
    assert not engine.running
    assert group_members(pid) == []  # the whole process group (API server, engine core, worker) is gone


def test_start_failure_reports_log_tail(tmp_path):
    engine = VllmEngine(tmp_path / "no-such-model", log_path=tmp_path / "bad.log")
    with pytest.raises(RuntimeError, match="vLLM exited") as info:
        engine.start(timeout=120)
    assert "bad.log" in str(info.value) and len(str(info.value)) > 100
    assert not engine.running
