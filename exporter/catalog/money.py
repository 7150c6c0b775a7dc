"""Money and carbon (docs/energy.md): the price and carbon intensity in force and the energy figures priced with
them; absent unless a price or carbon intensity is configured."""

from __future__ import annotations

from typing import Iterator

from exporter.catalog import bounds
from exporter.catalog.declare import (
    Elsewhere,
    Fill,
    MetricDef,
    Sample,
    Section,
    bookkeeping,
    setting,
    window_block,
)
from exporter.figures import Snapshot, WindowFigures

MONEY_SECTION = "Money and carbon"

PRICES = Elsewhere("host-wide, not a server's figure: /api/status's top-level prices")


def _currency(snap: Snapshot) -> str:
    p = snap.price("electricity_price")
    return (p.currency if p is not None else None) or ""


def _costs(attr: str, *, with_currency: bool = False) -> Fill:
    """One sample per server, scope and window of a CostFigure attribute; money series carry the currency."""
    def fill(snap: Snapshot) -> Iterator[Sample]:
        currency = (_currency(snap),) if with_currency else ()
        for s in snap.servers:
            for w in s.windows:
                for c in w.costs:
                    yield (s.name, c.scope, w.window, *currency), getattr(c, attr)
    return fill


def _price(quantity: str, *, with_currency: bool) -> Fill:
    def fill(snap: Snapshot) -> Iterator[Sample]:
        p = snap.price(quantity)
        if p is not None and p.configured:
            yield ((p.currency or "",) if with_currency else ()) + (p.source,), p.value
    return fill


def _price_age(snap: Snapshot) -> Iterator[Sample]:
    for p in snap.prices:
        if p.source == "url":
            yield (p.quantity,), p.age_seconds


# the price and carbon intensity in force, and the energy figures priced with them (docs/energy.md)
MONEY: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_electricity_price_per_kwh", type="gauge", labels=("currency", "source"),
        help="The electricity price per kWh in force (source=configured: a number set; source=url: read from a "
             "series URL every price_refresh, absent once older than price_max_age). Absent when not configured.",
        computes=setting("model.cost.Prices.value",
                         why="a configured number, or a URL's reading used as given (docs/energy.md)"),
        section=MONEY_SECTION,
        fill=_price("electricity_price", with_currency=True),
        status=PRICES,
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_carbon_intensity_grams_per_kwh", type="gauge", labels=("source",),
        help="The grid's carbon intensity in g CO2e per kWh in force (source=configured or url, as the price). "
             "Absent when not configured.",
        computes=setting("model.cost.Prices.value",
                         why="a configured number, or a URL's reading used as given (docs/energy.md)"),
        section=MONEY_SECTION,
        fill=_price("carbon_intensity", with_currency=False),
        status=PRICES,
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_price_age_seconds", type="gauge", labels=("quantity",),
        help="Seconds since the value of a price or carbon-intensity URL (quantity=electricity_price | "
             "carbon_intensity) was read; absent before its first good read.",
        computes=bookkeeping("sources.tariff.PriceTracker.reading", why="the age of a price URL's last good read"),
        section=MONEY_SECTION,
        fill=_price_age,
        status=PRICES,
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_energy_cost_per_million_tokens", type="gauge", labels=("server", "scope", "window", "currency"),
        help="The marginal energy (kvwatt_marginal_energy_per_token_joules) of a million generated tokens at the "
             "electricity price, in its currency. Absent without a price or a marginal figure.",
        computes="derive.cost.money_per_million_tokens",
        section=MONEY_SECTION,
        fill=_costs("money_per_million_tokens", with_currency=True),
        bounds=bounds.MONEY_PER_MILLION_TOKENS,
    ),
    MetricDef(
        name="kvwatt_co2e_grams_per_thousand_tokens", type="gauge", labels=("server", "scope", "window"),
        help="The marginal energy of 1,000 generated tokens in g CO2e at the grid's carbon intensity. Absent without "
             "an intensity or a marginal figure.",
        computes="derive.cost.co2e_grams_per_thousand_tokens",
        section=MONEY_SECTION,
        fill=_costs("co2e_grams_per_thousand_tokens"),
        bounds=bounds.CO2E_PER_THOUSAND_TOKENS,
    ),
    MetricDef(
        name="kvwatt_marginal_energy_cost_per_day", type="gauge", labels=("server", "scope", "window", "currency"),
        help="The window's power above idle, (E - P_idle*dt)/dt, held for a day, at the electricity price: money per "
             "day at this load. Absent without a price or a marginal figure.",
        computes="derive.cost.money_per_day",
        section=MONEY_SECTION,
        fill=_costs("money_per_day", with_currency=True),
        bounds=bounds.money_per_day("marginal_watts"),
    ),
    MetricDef(
        name="kvwatt_marginal_co2e_grams_per_day", type="gauge", labels=("server", "scope", "window"),
        help="The window's power above idle held for a day, in g CO2e at the grid's carbon intensity. Absent without "
             "an intensity or a marginal figure.",
        computes="derive.cost.co2e_grams_per_day",
        section=MONEY_SECTION,
        fill=_costs("co2e_grams_per_day"),
        bounds=bounds.co2e_per_day("marginal_watts"),
    ),
    MetricDef(
        name="kvwatt_recompute_tax_cost_per_day", type="gauge", labels=("server", "scope", "window", "currency"),
        help="The recomputation tax's power (kvwatt_recompute_tax_watts) held for a day at the electricity price: "
             "what recomputing evicted prompts costs per day at this load. Absent without a price or a tax figure.",
        computes="derive.cost.money_per_day",
        section=MONEY_SECTION,
        fill=_costs("recompute_tax_money_per_day", with_currency=True),
        bounds=bounds.money_per_day("recompute_tax_watts"),
    ),
    MetricDef(
        name="kvwatt_recompute_tax_co2e_grams_per_day", type="gauge", labels=("server", "scope", "window"),
        help="The recomputation tax's power held for a day, in g CO2e at the grid's carbon intensity. Absent without "
             "an intensity or a tax figure.",
        computes="derive.cost.co2e_grams_per_day",
        section=MONEY_SECTION,
        fill=_costs("recompute_tax_co2e_grams_per_day"),
        bounds=bounds.co2e_per_day("recompute_tax_watts"),
    ),
    MetricDef(
        name="kvwatt_offload_saved_cost_per_day", type="gauge", labels=("server", "scope", "window", "currency"),
        help="What offloading saved (kvwatt_offload_saved_watts) held for a day at the electricity price; negative "
             "when a reload cost more than recomputing. Absent without a price or a saving figure.",
        computes="derive.cost.money_per_day",
        section=MONEY_SECTION,
        fill=_costs("offload_saved_money_per_day", with_currency=True),
        bounds=bounds.money_per_day("offload_saved_watts"),
    ),
    MetricDef(
        name="kvwatt_offload_saved_co2e_grams_per_day", type="gauge", labels=("server", "scope", "window"),
        help="What offloading saved held for a day, in g CO2e at the grid's carbon intensity. Absent without an "
             "intensity or a saving figure.",
        computes="derive.cost.co2e_grams_per_day",
        section=MONEY_SECTION,
        fill=_costs("offload_saved_co2e_grams_per_day"),
        bounds=bounds.co2e_per_day("offload_saved_watts"),
    ),
)


# --- the section's JSON and the section ----------------------------------------------------------------------------
def _cost_json(w: WindowFigures) -> dict:
    """Money and carbon of the marginal energy by scope; no key when no price or intensity is configured."""
    if not w.costs:
        return {}
    return {"cost": {c.scope: {"marginal_watts": c.marginal_watts,
                               "money_per_million_tokens": c.money_per_million_tokens,
                               "co2e_grams_per_thousand_tokens": c.co2e_grams_per_thousand_tokens,
                               "money_per_day": c.money_per_day,
                               "co2e_grams_per_day": c.co2e_grams_per_day, "currency": c.currency,
                               "recompute_tax_money_per_day": c.recompute_tax_money_per_day,
                               "recompute_tax_co2e_grams_per_day": c.recompute_tax_co2e_grams_per_day,
                               "offload_saved_money_per_day": c.offload_saved_money_per_day,
                               "offload_saved_co2e_grams_per_day": c.offload_saved_co2e_grams_per_day}
                     for c in w.costs}}


MONEY_SEC = Section(name=MONEY_SECTION, metrics=MONEY, blocks=(
    window_block(("cost",),  # docs/energy.md, "Money and carbon"; the currency is the top-level prices' one
                 ("kvwatt_energy_cost_per_million_tokens", "kvwatt_co2e_grams_per_thousand_tokens",
                  "kvwatt_marginal_energy_cost_per_day", "kvwatt_marginal_co2e_grams_per_day",
                  "kvwatt_recompute_tax_cost_per_day", "kvwatt_recompute_tax_co2e_grams_per_day",
                  "kvwatt_offload_saved_cost_per_day", "kvwatt_offload_saved_co2e_grams_per_day"), _cost_json),
))
