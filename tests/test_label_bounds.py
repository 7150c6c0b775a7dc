"""Upstream label values without bound: per family and server kvwatt keeps the first
rules.MAX_LABEL_VALUES values of tier / reason / stage, drops the rest with reason label_values_capped (logged
once per change), and an engine label changing at every read is logged a bounded number of times."""

from pathlib import Path

from exporter.rules import MAX_LABEL_VALUES
from exporter.samples import EngineInfo, EngineReading
from exporter.sources.labelcap import LabelCap
from exporter.store import ServerHistory
from tests.conftest import FIXTURES
from tests.support.daemon import KvwattDaemon
from tests.support.loopback import MetricsServer

LOW = [p.read_text() for p in sorted((FIXTURES / "low-pressure").glob("*.prom"))]
CAP = int(MAX_LABEL_VALUES.default)


def many_tiers(text: str, n: int, scrape: int) -> str:
    lines = [f'vllm:kv_offload_tiering_{kind}_total{{engine="0",model_name="tiny",tier="{i}:fs"}} {1000.0 * scrape + i}'
             for i in range(n) for kind in ("write_bytes", "read_bytes", "chunk_queries", "chunk_hits")]
    return text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"


def test_label_cap_keeps_the_first_values_seen_and_says_how_many_it_dropped(caplog):
    cap = LabelCap("s", max_values=3)
    r = lambda vals: EngineReading(counters={f"tier@{v}": 1.0 for v in vals} | {"g": 1.0}, gauges={}, info=EngineInfo(),
                                   engine_counters={"0": {f"tier@{v}": 1.0 for v in vals}})
    with caplog.at_level("INFO", logger="kvwatt.engine"):
        problems: list[str] = []
        out = cap.apply(r(["a", "b", "c", "d", "e"]), problems)
        assert set(out.counters) == {"tier@a", "tier@b", "tier@c", "g"} and set(out.engine_counters["0"]) == \
            {"tier@a", "tier@b", "tier@c"}
        assert problems == ["label_values_capped: tier: 2 value(s) beyond the first 3 dropped"]
        for _ in range(20):  # the same values again: the same kept, one log line in all
            out = cap.apply(r(["z", "e", "a", "b", "c"]), [])
        assert set(out.counters) == {"tier@a", "tier@b", "tier@c", "g"}
        assert cap.apply(r(["a"]), problems := []) and problems == []  # within the bound: ok again
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]


def test_ten_thousand_tier_values_give_bounded_metrics_and_a_reason():
    scrape = [0]

    def body():
        scrape[0] += 1
        return many_tiers(LOW[-1], 10_000, scrape[0])

    # the per-tier families are opt-in (docs/fleet.md "Series budget"): asked for, so the cap shows on /metrics
    with MetricsServer(body) as srv, KvwattDaemon(servers={"s": srv.url}, interval="500ms",
                                                 config={"windows": ["1m"], "metrics_opt_in": ["all"]}) as d:
        d.wait_for(lambda d: scrape[0] > 4, timeout=60, what="a few reads")
        d.wait_for(lambda d: d.status()["servers"][0]["state"] == "degraded", timeout=30, what="degraded")
        status = d.status()["servers"][0]
        assert status["reason_code"] == "label_values_capped", status
        assert f"beyond the first {CAP} dropped" in status["reason"]
        text = d.metrics_text()
        tiers = {line.split('tier="', 1)[1].split('"', 1)[0] for line in text.splitlines() if 'tier="' in line}
        assert 0 < len(tiers) <= CAP
        assert len(text.splitlines()) < 5_000, len(text.splitlines())
        assert Path(d.log_path).read_text().count("distinct label values") == 1


def test_an_engine_label_changing_at_every_read_logs_a_bounded_number_of_lines(caplog):
    h = ServerHistory(600, name="s")
    with caplog.at_level("INFO", logger="kvwatt.store"):
        for t in range(200):
            e = f"id-{t}"
            h.add_reading(float(t), EngineReading(counters={"g": 10.0 * t}, gauges={}, info=EngineInfo(),
                                                  engine_counters={e: {"g": 10.0 * t}}))
    assert len(caplog.records) <= 8, [r.getMessage() for r in caplog.records]
    assert sum("changes at nearly every read" in r.getMessage() for r in caplog.records) == 1
    assert len(h.identity.levels) == 1
