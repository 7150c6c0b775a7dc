"""The daemon end to end over loopback HTTP: real `kvwatt run` subprocess, vLLM expositions from the real
0.32 engine fixtures, promtool on the output, failure isolation, counter resets, clean shutdown."""

import shutil
import signal
import subprocess

import pytest
import requests

from tests.conftest import FIXTURES
from tests.support.daemon import KvwattDaemon, free_port
from tests.support.loopback import MetricsServer

LOW = [p.read_text() for p in sorted((FIXTURES / "low-pressure").glob("*.prom"))]


class Sequence:
    """Serves the expositions in order, one per request, then stays on the last."""

    def __init__(self, texts):
        self.texts, self.i = list(texts), 0

    def __call__(self):
        text = self.texts[min(self.i, len(self.texts) - 1)]
        self.i += 1
        return text


@pytest.mark.prom
def test_one_dead_server_does_not_stop_the_others_and_promtool_is_clean(tmp_path):
    with MetricsServer(Sequence(LOW)) as live, \
            KvwattDaemon(servers={"live": live.url, "dead": f"http://127.0.0.1:{free_port()}"},
                         config={"metrics_opt_in": ["kvwatt_kv_pressure_threshold_ratio"]},  # opt-in: issue 39
                         interval="200ms") as d:
        d.wait_for(lambda d: d.value("kvwatt_generation_tokens_per_second", server="live", window="1m") is not None,
                   what="a first window")
        assert d.value("kvwatt_source_up", source="vllm", server="live") == 1
        assert d.value("kvwatt_source_up", source="vllm", server="dead") == 0
        assert d.value("kvwatt_source_info", source="vllm", server="dead", reason="unreachable") == 1
        assert d.value("kvwatt_server_info", server="live", model_name="tiny", offload_backend="none") == 1
        assert d.value("kvwatt_offload_enabled", server="live") == 0
        assert d.value("kvwatt_offload_enabled", server="dead") is None  # unknown, not 0
        assert d.value("kvwatt_kv_pressure_threshold_ratio", server="live") == 0.9
        text = d.metrics_text()
        promtool = shutil.which("promtool")
        assert promtool, "promtool missing: scripts/install-deps.sh installs Debian's prometheus"
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr
        assert "kvwatt_" in text and not any(l.startswith("vllm:") for l in text.splitlines())
        assert requests.get(d.url + "/").status_code == 200 and "/metrics" in requests.get(d.url + "/").text
        status = d.status()["servers"]
        assert {s["server"]: s["up"] for s in status} == {"live": True, "dead": False}


def test_sequence_of_real_expositions_gives_the_counter_deltas():
    """The low-pressure fixture run: 8,280 local_compute of 39,000 prompt tokens, all within one window."""
    seq = Sequence(LOW)
    with MetricsServer(seq) as live, KvwattDaemon(servers={"live": live.url}, interval="100ms",
                                                 config={"windows": ["1m"]}) as d:
        d.wait_for(lambda d: seq.i > len(LOW) + 2, what="the whole sequence served")
        first = LOW[0]
        share = d.value("kvwatt_prompt_token_share_ratio", server="live", source="local_compute", window="1m")
        # expected from the fixtures themselves: deltas between the first and the last exposition
        from exporter.sources.expfmt import parse
        from exporter.sources.vllm import extract
        a, b = extract(parse(first)).counters, extract(parse(LOW[-1])).counters
        lc = b["prompt_local_compute"] - a["prompt_local_compute"]
        total = sum(b[k] - a[k] for k in ("prompt_local_compute", "prompt_local_cache_hit",
                                          "prompt_external_kv_transfer"))
        assert share == pytest.approx(lc / total, rel=1e-9)


def test_counter_reset_from_a_restarted_server_never_goes_negative():
    texts = LOW[-1:] * 3 + LOW[:1] * 3  # a restart: every counter drops back
    with MetricsServer(Sequence(texts)) as live, KvwattDaemon(servers={"live": live.url}, interval="100ms") as d:
        d.wait_for(lambda d: d.status()["servers"][0]["windows"]["1m"]["covered_seconds"] > 0.8, what="samples")
        for name in ("kvwatt_generation_tokens_per_second", "kvwatt_preemptions_per_minute"):
            v = d.value(name, server="live", window="1m")
            assert v is not None and v >= 0
        # the restart step counts the new values since restart, not a drop of 12,000 tokens
        gen_first = 0  # LOW[0] is the first capture: generation tokens since start
        from exporter.sources.expfmt import parse
        from exporter.sources.vllm import extract
        gen_first = extract(parse(LOW[0])).counters["generation_tokens"]
        covered = d.value("kvwatt_window_covered_seconds", server="live", window="1m")
        rate = d.value("kvwatt_generation_tokens_per_second", server="live", window="1m")
        assert rate * covered == pytest.approx(gen_first, rel=1e-6)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_clean_shutdown_on_signals(sig):
    with MetricsServer(Sequence(LOW)) as live:
        d = KvwattDaemon(servers={"live": live.url}).start()
        try:
            assert d.stop(sig, timeout=10) == 0
            assert "kvwatt stopped" in d.log()
        finally:
            d.tmp.cleanup()


def test_a_server_answering_503_is_down_with_a_reason():
    with MetricsServer(lambda: None) as srv, KvwattDaemon(servers={"s": srv.url}) as d:
        d.wait_for(lambda d: d.value("kvwatt_source_info", server="s", reason="http_503") == 1, what="503 reason")
        assert d.value("kvwatt_source_up", server="s", source="vllm") == 0
        assert d.value("kvwatt_kv_cache_usage_p95_ratio", server="s", window="1m") is None
