"""Money and carbon (docs/energy.md, "Money and carbon"): the conversions by hand, the configuration (number,
URL, currency; bad input is one line and exit 2), the price/intensity URL source against loopback servers
(a slow or broken URL degrades to unknown with a reason and never delays the other sources), and the figures
on /metrics and /api/status when configured, absent when not."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.config import (
    Config,
    ConfigError,
    PriceSetting,
    apply_environment,
    from_mapping,
    parse_currency,
    parse_price,
    resolve,
)
from exporter.derive import cost
from exporter.runtime.sampler import Sampler
from exporter.serve.collector import families
from exporter.serve.exposition import Exposition
from exporter.serve.web import status_json
from exporter.sources.engine import SourceError
from exporter.sources.tariff import PriceSource, PriceTracker, value_from_exposition, value_from_query
from tests import test_golden as golden
from tests.support.loopback import MetricsServer

MONEY_FAMILIES = ("kvwatt_energy_cost_per_million_tokens", "kvwatt_marginal_energy_cost_per_day",
                  "kvwatt_electricity_price_per_kwh")
CO2_FAMILIES = ("kvwatt_co2e_grams_per_thousand_tokens", "kvwatt_marginal_co2e_grams_per_day",
                "kvwatt_carbon_intensity_grams_per_kwh", "kvwatt_price_age_seconds")


# --- conversions, by hand ---------------------------------------------------------------------------------
def test_joules_per_token_to_money_per_million_tokens():
    # 0.36 J/token * 1e6 tokens = 360,000 J = 0.1 kWh; at 0.30 EUR/kWh: 0.03 EUR
    assert cost.money_per_million_tokens(0.36, 0.30) == pytest.approx(0.03)
    # 3.6 J/token * 1,000 tokens = 3,600 J = 0.001 kWh; at 400 g/kWh: 0.4 g
    assert cost.co2e_grams_per_thousand_tokens(3.6, 400.0) == pytest.approx(0.4)


def test_watts_to_money_and_co2_per_day():
    # 1,000 W for 24 h = 24 kWh: at 0.25 EUR/kWh 6 EUR, at 500 g/kWh 12,000 g
    assert cost.kwh_per_day(1000.0) == pytest.approx(24.0)
    assert cost.money_per_day(1000.0, 0.25) == pytest.approx(6.0)
    assert cost.co2e_grams_per_day(1000.0, 500.0) == pytest.approx(12_000.0)
    # 50 W above idle: 1.2 kWh/day
    assert cost.money_per_day(50.0, 0.10) == pytest.approx(0.12)


def test_unknown_in_is_unknown_out_never_zero():
    assert cost.money_per_million_tokens(None, 0.3) is None and cost.money_per_million_tokens(1.0, None) is None
    assert cost.co2e_grams_per_day(None, 400.0) is None and cost.money_per_day(100.0, None) is None
    assert cost.marginal_watts(1000.0, None, 10.0) is None and cost.marginal_watts(1000.0, 500.0, 0.0) is None
    assert cost.marginal_watts(1000.0, 400.0, 10.0) == pytest.approx(60.0)


def test_a_power_held_for_a_day_in_money_and_kilograms():
    """The arithmetic Prices.cost_of_energy applies to the marginal power, the tax and the saving in W."""
    assert cost.money_per_day(500.0, 0.2) == pytest.approx(2.4)  # 12 kWh/day
    assert cost.co2e_grams_per_day(500.0, 300) == pytest.approx(3600.0)  # 3.6 kg
    assert cost.money_per_day(None, 0.2) is None and cost.co2e_grams_per_day(500.0, None) is None


# --- configuration ----------------------------------------------------------------------------------------
def test_a_price_is_a_number_or_a_url():
    assert parse_price(0.25, "k") == PriceSetting(value=0.25)
    assert parse_price("0.25", "k") == PriceSetting(value=0.25)  # a flag or an environment variable
    assert parse_price(0, "k").value == 0.0
    q = parse_price("http://prom:9090/api/v1/query?query=price_eur", "k")
    assert q == PriceSetting(url="http://prom:9090/api/v1/query?query=price_eur")
    m = parse_price('https://grid:9100/metrics#intensity{zone="DE"}', "k")
    assert m == PriceSetting(url="https://grid:9100/metrics", series='intensity{zone="DE"}')
    assert parse_currency(" usd ", "k") == "USD"


@pytest.mark.parametrize("value, message", [
    ("abc", "expected a number >= 0, or an http(s) URL"),
    (-1, "must be >= 0"),
    ("-0.5", "must be >= 0"),
    (float("inf"), "expected a finite number"),
    (True, "expected a number >= 0"),
    ("http://prom:9090/metrics", "a URL without #series must be a Prometheus /api/v1/query"),
    ("http://prom:9090/metrics#bad name", "expected a series name"),
    (1e308, "must be >= 0.0 and <= 1000000.0"),  # once accepted: +Inf money per day
])
def test_a_bad_price_is_one_clear_error(value, message):
    with pytest.raises(ConfigError) as e:
        from_mapping({"electricity_price_per_kwh": value, "electricity_currency": "EUR"})
    assert str(e.value).startswith("electricity_price_per_kwh: ") and message in str(e.value)


def test_a_password_in_a_price_url_is_never_shown():
    with pytest.raises(ConfigError) as e:
        parse_price("http://u:secret@prom:9090/x?query=a", "k")
    assert "secret" not in str(e.value)


def test_a_price_needs_its_currency_and_none_is_invented():
    with pytest.raises(ConfigError, match="electricity_currency: required with electricity_price_per_kwh"):
        resolve(None, env={"KVWATT_ELECTRICITY_PRICE_PER_KWH": "0.3"})
    with pytest.raises(ConfigError, match="ISO 4217"):
        from_mapping({"electricity_currency": "euro"})
    cfg = resolve(None, env={})
    assert cfg.electricity_price is None and cfg.electricity_currency is None and cfg.carbon_intensity is None


def test_environment_sets_price_currency_and_intensity():
    cfg = apply_environment(Config(), {"KVWATT_ELECTRICITY_PRICE_PER_KWH": "0.31",
                                       "KVWATT_ELECTRICITY_CURRENCY": "chf",
                                       "KVWATT_CARBON_INTENSITY_G_PER_KWH": "http://g:1/metrics#ci"})
    assert cfg.electricity_price.value == 0.31 and cfg.electricity_currency == "CHF"
    assert cfg.carbon_intensity == PriceSetting(url="http://g:1/metrics", series="ci")


@pytest.mark.parametrize("flags, message", [
    (["--electricity-price-per-kwh", "abc", "--electricity-currency", "EUR"],
     "--electricity-price-per-kwh: expected a number >= 0, or an http(s) URL"),
    (["--carbon-intensity-g-per-kwh", "-3"], "--carbon-intensity-g-per-kwh: must be >= 0"),
    (["--electricity-price-per-kwh", "0.3"], "electricity_currency: required"),
    (["--carbon-intensity-g-per-kwh", "1e308"], "--carbon-intensity-g-per-kwh: must be >= 0.0 and <= 10000.0"),
])
def test_bad_flags_are_one_line_and_exit_2(tmp_path, flags, message):
    from tests.test_bad_input import kvwatt
    proc = kvwatt("run", "--server", "a=http://127.0.0.1:1", "--state-dir", str(tmp_path), *flags)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvwatt: error: ") and message in lines[0], lines


# --- the price URL source ---------------------------------------------------------------------------------
def test_prometheus_query_answers():
    vector = {"status": "success", "data": {"resultType": "vector",
                                            "result": [{"metric": {}, "value": [1.7e9, "0.284"]}]}}
    assert value_from_query(json.dumps(vector)) == 0.284
    assert value_from_query('{"status":"success","data":{"resultType":"scalar","result":[1.7e9,"412"]}}') == 412
    for body, code in [('{"status":"success","data":{"resultType":"vector","result":[]}}', "no_sample"),
                       ("<html>", "parse_error"),
                       ('{"status":"success","data":{"resultType":"vector","result":[{"value":[1,"-2"]}]}}',
                        "out_of_range"),
                       ('{"status":"success","data":{"resultType":"matrix","result":[]}}', "parse_error")]:
        with pytest.raises(SourceError) as e:
            value_from_query(body)
        assert e.value.reason == code, body


def test_exposition_series_with_labels():
    text = 'ci{zone="DE"} 380\nci{zone="FR"} 55\nother 1\n'
    assert value_from_exposition(text, 'ci{zone="FR"}') == 55
    with pytest.raises(SourceError, match="2 samples of ci"):
        value_from_exposition(text, "ci")
    with pytest.raises(SourceError, match="0 samples"):
        value_from_exposition(text, "missing")


def test_only_the_named_series_lines_count_wherever_they_are():
    text = 'ci_total{zone="FR"} 9\nci{zone = "FR"} 55\nci_by_zone{zone="FR"} 7\nci{zone="DE"} 380'
    assert value_from_exposition(text, 'ci{zone="FR"}') == 55  # blanks around "=": still that label
    assert value_from_exposition(text, 'ci{zone="DE"}') == 380  # the last line, without a line break
    assert value_from_exposition('ci 1\nci_total 2\n', "ci") == 1  # the first line; ci_total is another name
    assert value_from_exposition('x 1\nci{a="q\\"uote"} 3\n', 'ci{a="q\\"uote"}') == 3  # an escaped value
    with pytest.raises(SourceError, match="0 samples"):
        value_from_exposition("ci_total 2\nci_x{a=\"b\"} 1\n", "ci")


def test_a_price_or_intensity_read_beyond_its_bound_is_out_of_range():
    for quantity, body in (("electricity_price", "p 1e308\n"), ("carbon_intensity", "p 20000\n")):
        with MetricsServer(lambda: body) as srv:
            status, value = asyncio.run(_read(PriceSetting(url=srv.url + "/metrics", series="p"), quantity=quantity))
        assert value is None and status.code == "out_of_range" and "want a finite number in [0, " in status.reason
    with pytest.raises(ConfigError, match="carbon_intensity_g_per_kwh: must be >= 0.0 and <= 10000.0"):
        from_mapping({"carbon_intensity_g_per_kwh": 1e308})


def test_a_price_answer_is_decoded_off_the_event_loop(monkeypatch):
    """A 5.6 MB answer decoded on the event loop held every scrape for seconds (/metrics 4.15 s against 9.7 ms;
    bench/bench_price_fetch.py measures it): the value is taken from the answer in a worker thread."""
    import threading

    from exporter.sources import tariff

    threads = []
    real = tariff.value_from_exposition

    def spy(text, series):
        threads.append(threading.current_thread())
        return real(text, series)

    monkeypatch.setattr(tariff, "value_from_exposition", spy)
    with MetricsServer(lambda: "# TYPE ci gauge\nci 412.5\n") as srv:
        status, value = asyncio.run(_read(PriceSetting(url=srv.url + "/metrics", series="ci")))
    assert status.up and value == 412.5
    assert threads and threading.main_thread() not in threads  # the loop runs in the main thread here


async def _read(setting: PriceSetting, timeout: float = 0.5, quantity: str = "carbon_intensity"):
    async with aiohttp.ClientSession() as session:
        return await PriceSource(quantity, setting, timeout, 1 << 20).read(session)


def test_read_over_loopback_exposition_and_query():
    with MetricsServer(lambda: "# TYPE ci gauge\nci 412.5\n") as srv:
        status, value = asyncio.run(_read(PriceSetting(url=srv.url + "/metrics", series="ci")))
    assert status.up and status.state == "ok" and value == 412.5
    answer = '{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1,"0.3"]}]}}'
    # MetricsServer answers every path under /metrics: the query path sits there
    with MetricsServer(lambda: answer) as srv:
        status, value = asyncio.run(_read(PriceSetting(url=srv.url + "/metrics/api/v1/query?query=p")))
    assert status.up and value == 0.3


def test_timeout_and_bad_body_are_unknown_with_a_reason():
    def slow():
        time.sleep(1.5)
        return "ci 1\n"
    with MetricsServer(slow) as srv:
        status, value = asyncio.run(_read(PriceSetting(url=srv.url + "/metrics", series="ci"), timeout=0.3))
    assert value is None and not status.up and status.code == "timeout", status
    with MetricsServer(lambda: "this is no exposition") as srv:
        status, value = asyncio.run(_read(PriceSetting(url=srv.url + "/metrics", series="ci")))
    assert value is None and status.code == "no_sample", status
    with MetricsServer(lambda: None) as srv:  # 503
        status, value = asyncio.run(_read(PriceSetting(url=srv.url + "/metrics", series="ci")))
    assert value is None and status.code == "http_503", status


def test_last_value_is_kept_with_its_age_then_goes_unknown_when_stale():
    class Source:
        quantity = "electricity_price"
        setting = PriceSetting(url="http://x/metrics", series="p")
        results = [(True, 0.3), (False, None)]

        def status(self, up, reason, seconds, state=None):
            return PriceSource.status(self, up, reason, seconds, state)

        async def read(self, _session):
            up, value = self.results.pop(0)
            return self.status(up, "" if up else "timeout: no answer within 2 s", 0.1), value

    async def run():
        tracker = PriceTracker(Source(), refresh_seconds=10.0, max_age_seconds=60.0)
        first = tracker.reading(0.0)
        tracker.poll(None, 0.0)
        await asyncio.sleep(0)
        tracker.poll(None, 1.0)  # the first read's result; the next read is not due yet
        ok = tracker.reading(1.0)
        tracker.poll(None, 11.0)
        await asyncio.sleep(0)
        tracker.poll(None, 12.0)  # the second read failed: the value stays, degraded
        kept = tracker.reading(30.0)
        return first, ok, kept, tracker.reading(61.5)
    first, ok, kept, stale = asyncio.run(run())
    assert first.value is None and first.status.code == "not_read_yet"
    assert ok.value == 0.3 and ok.age_seconds == 0.0 and ok.status.state == "ok"
    assert kept.value == 0.3 and kept.age_seconds == 29.0 and kept.status.state == "degraded"
    assert kept.status.code == "timeout"
    assert stale.value is None and stale.status.code == "stale" and not stale.status.up
    assert "limit 60 s" in stale.status.reason


def test_a_dead_price_url_never_delays_a_tick_or_the_servers():
    """The price URL hangs for 3 s; the server beside it is read at every tick, each tick within its deadline."""
    def hang():
        time.sleep(3.0)
        return "p 1\n"
    exposition = (golden.FIXTURES / "low-pressure").glob("*.prom").__next__().read_text()
    with MetricsServer(hang) as price, MetricsServer(lambda: exposition) as server:
        cfg = from_mapping({"servers": [{"name": "a", "url": server.url}], "interval": "200ms",
                            "http_timeout": "5s", "electricity_price_per_kwh": price.url + "/metrics#p",
                            "electricity_currency": "EUR"})

        async def run():
            took, reads, prices = [], 0, []
            async with Sampler(cfg, energy=False) as sampler:
                for i in range(5):
                    t0 = time.monotonic()
                    tick = await sampler.tick(t0)
                    took.append(time.monotonic() - t0)
                    reads += len(tick.servers)
                    prices.append(tick.prices[0])
                    await asyncio.sleep(0.1)
            return took, reads, prices
        took, reads, prices = asyncio.run(run())
    assert max(took) < 1.0, took  # the deadline is 0.1 s; the 3 s price read is never waited for
    assert reads >= 4, reads
    assert all(p.value is None and p.status.code == "not_read_yet" for p in prices)


# --- figures: present when configured, absent when not -----------------------------------------------------
def _run(tmp_path, **prices):
    mapping = golden.config_mapping(tmp_path)
    for key in ("electricity_price_per_kwh", "electricity_currency", "carbon_intensity_g_per_kwh"):
        mapping.pop(key)
    mapping.update(prices)
    sc = golden.Scenario(tmp_path, mapping)
    from exporter.model import Model
    from exporter.runtime.daemon import Daemon
    daemon = Daemon(sc.cfg, sampler=Sampler(sc.cfg, energy=False), model=Model(sc.cfg, wall_clock=lambda: golden.WALL))
    for t in range(1, 41):
        daemon.step(sc.tick(t))
    text = Exposition(families(daemon.snapshot)).text.decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    return daemon.snapshot, names, status_json(daemon.snapshot), text


def test_absent_when_not_configured_and_status_says_how(tmp_path):
    _, names, status, _ = _run(tmp_path)
    assert not names & set(MONEY_FAMILIES + CO2_FAMILIES)
    assert set(status["prices"]["electricity_price"]) == {"state", "how"}
    assert status["prices"]["electricity_price"]["state"] == "not_configured"
    assert "electricity_price_per_kwh" in status["prices"]["electricity_price"]["how"]
    assert "carbon_intensity_g_per_kwh" in status["prices"]["carbon_intensity"]["how"]
    assert all("cost" not in w for s in status["servers"] for w in s["windows"].values())


def test_on_metrics_and_status_when_configured(tmp_path):
    snap, names, status, text = _run(tmp_path, electricity_price_per_kwh=0.25, electricity_currency="EUR",
                                     carbon_intensity_g_per_kwh=golden.CARBON_URL)
    assert set(MONEY_FAMILIES + CO2_FAMILIES) <= names
    assert 'kvwatt_electricity_price_per_kwh{currency="EUR",source="configured"} 0.25' in text
    assert 'kvwatt_carbon_intensity_grams_per_kwh{source="url"} 380.0' in text
    on = next(s for s in status["servers"] if s["server"] == "on")
    e, c = on["windows"]["1m"]["energy"]["gpu"], on["windows"]["1m"]["cost"]["gpu"]
    # by hand from the energy block: J/token and the mean power above idle
    jpt = e["marginal_joules_per_token"]
    watts = (e["joules"] - e["idle_joules"]) / e["seconds"]
    assert c["money_per_million_tokens"] == pytest.approx(jpt * 1e6 / 3.6e6 * 0.25)
    assert c["co2e_grams_per_thousand_tokens"] == pytest.approx(jpt * 1e3 / 3.6e6 * 380.0)
    assert c["marginal_watts"] == pytest.approx(watts)
    assert c["money_per_day"] == pytest.approx(watts * 0.024 * 0.25)
    assert c["co2e_grams_per_day"] == pytest.approx(watts * 0.024 * 380.0)
    assert c["currency"] == "EUR"
    assert status["prices"]["carbon_intensity"]["source"] == "url"
    assert status["prices"]["electricity_price"]["value"] == 0.25


def test_the_recomputation_tax_and_the_offload_saving_in_money_and_co2(tmp_path):
    """kvwatt_recompute_tax_watts and kvwatt_offload_saved_watts (methods.md s12), each held for a day at the
    price and the intensity; on the page beside the marginal energy's."""
    from exporter.serve import page
    snap, names, status, _ = _run(tmp_path, electricity_price_per_kwh=0.25, electricity_currency="EUR",
                                  carbon_intensity_g_per_kwh=400)
    assert {"kvwatt_recompute_tax_cost_per_day", "kvwatt_recompute_tax_co2e_grams_per_day"} <= names
    priced = 0
    for s in status["servers"]:
        for w in s["windows"].values():
            for scope, c in (w.get("cost") or {}).items():
                tax = (w.get("recompute_tax_watts") or {}).get(scope)
                saved = (w.get("offload_saved_watts") or {}).get(scope)
                for watts, key in ((tax, "recompute_tax"), (saved, "offload_saved")):
                    if watts is None:
                        assert c[f"{key}_money_per_day"] is None
                        continue
                    priced += 1
                    assert c[f"{key}_money_per_day"] == pytest.approx(watts * 0.024 * 0.25)
                    assert c[f"{key}_co2e_grams_per_day"] == pytest.approx(watts * 0.024 * 400)
    assert priced >= 2
    off = next(s for s in status["servers"] if s["server"] == "off")
    assert "recomputing evicted prompts: <b>" in page.paying(off)


def test_carbon_alone_gives_co2_and_no_money(tmp_path):
    _, names, status, _ = _run(tmp_path, carbon_intensity_g_per_kwh=400)
    assert not names & set(MONEY_FAMILIES)
    assert {"kvwatt_co2e_grams_per_thousand_tokens", "kvwatt_carbon_intensity_grams_per_kwh"} <= names
    on = next(s for s in status["servers"] if s["server"] == "on")
    assert on["windows"]["1m"]["cost"]["gpu"]["money_per_day"] is None


def test_the_page_answers_in_money_and_co2_when_set(tmp_path):
    from exporter.serve import page
    _, _, status, _ = _run(tmp_path, electricity_price_per_kwh=0.25, electricity_currency="EUR",
                           carbon_intensity_g_per_kwh=400)
    on = next(s for s in status["servers"] if s["server"] == "on")
    html = page.paying(on)
    assert 'data-field="cost"' in html and "EUR/day" in html and "kg CO2e/day" in html
    _, _, plain, _ = _run(tmp_path / "plain")
    assert 'data-field="cost"' not in page.paying(next(s for s in plain["servers"] if s["server"] == "on"))


def test_a_price_url_password_is_shown_nowhere(tmp_path):
    url = "http://user:hunter2@grid.invalid:9100/metrics#ci"
    snap, _, status, text = _run(tmp_path, carbon_intensity_g_per_kwh=url)
    assert "hunter2" not in json.dumps(status) and "hunter2" not in text
    assert status["prices"]["carbon_intensity"]["url"] == "http://user:xxxxx@grid.invalid:9100/metrics#ci"


def test_a_failing_price_url_is_a_source_with_a_reason_and_the_figures_go_absent(tmp_path):
    """The sampler hands over a URL that never answered: its source is down with the reason, no intensity
    series, no CO2 series; the servers' own figures are all still there."""
    from exporter.samples import PriceReading, SourceStatus
    mapping = golden.config_mapping(tmp_path)
    sc = golden.Scenario(tmp_path, mapping)
    down = SourceStatus(source="carbon_intensity", server="", up=False, reason="timeout: no answer within 2 s",
                        duration_seconds=2.0, state="down")
    sc.prices = lambda t: (PriceReading("carbon_intensity", None, None, down),)
    from exporter.model import Model
    from exporter.runtime.daemon import Daemon
    daemon = Daemon(sc.cfg, sampler=Sampler(sc.cfg, energy=False), model=Model(sc.cfg, wall_clock=lambda: golden.WALL))
    for t in range(1, 41):
        daemon.step(sc.tick(t))
    text = daemon.published.exposition.decode()
    assert 'kvwatt_source_up{server="",source="carbon_intensity"} 0.0' in text
    assert 'kvwatt_source_info{reason="timeout",server="",source="carbon_intensity",state="down"} 1.0' in text
    assert "kvwatt_co2e_grams_per_thousand_tokens{" not in text
    assert "kvwatt_carbon_intensity_grams_per_kwh{" not in text
    assert "kvwatt_energy_cost_per_million_tokens{" in text  # the configured price is unaffected
    assert "kvwatt_marginal_energy_per_token_joules{" in text
    status = status_json(daemon.snapshot)
    assert status["prices"]["carbon_intensity"]["state"] == "unknown"
    assert status["prices"]["carbon_intensity"]["reason"].startswith("timeout")
