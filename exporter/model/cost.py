"""Money and carbon in the model: the price and carbon intensity in force at a tick, and the window's energy
figures in money and CO2e per day (docs/energy.md, "Money and carbon").

    prices = Prices(cfg)
    prices.ingest(tick)                          # the URLs' values, as the sampler last read them
    prices.costs(energy, tax_watts, saved_watts)  # a window's CostFigures from its energy figures

A configured number is in force from the start; a URL's value once read (unknown after its staleness limit).
Neither set: no PriceFigure value and no CostFigure at all (absent, never 0).
"""

from __future__ import annotations

from exporter.config import Config, PriceSetting
from exporter.derive import cost
from exporter.figures import CostFigure, EnergyFigure, PriceFigure
from exporter.samples import PriceReading, SourceStatus, Tick

# how each quantity is set, for /api/status's "not configured" (key, flag, environment variable)
HOW_TO_SET = {
    "electricity_price": "set electricity_price_per_kwh with electricity_currency (flags --electricity-price-per-kwh "
                         "and --electricity-currency, $KVWATT_ELECTRICITY_PRICE_PER_KWH and "
                         "$KVWATT_ELECTRICITY_CURRENCY): a number or a series URL (docs/energy.md)",
    "carbon_intensity": "set carbon_intensity_g_per_kwh (flag --carbon-intensity-g-per-kwh, "
                        "$KVWATT_CARBON_INTENSITY_G_PER_KWH): a number or a series URL (docs/energy.md)",
}


class Prices:
    def __init__(self, cfg: Config) -> None:
        self.settings: dict[str, PriceSetting | None] = {"electricity_price": cfg.electricity_price,
                                                          "carbon_intensity": cfg.carbon_intensity}
        self.currency = cfg.electricity_currency
        self.readings: dict[str, PriceReading] = {}

    def ingest(self, tick: Tick) -> None:
        for r in tick.prices:
            self.readings[r.quantity] = r

    def value(self, quantity: str) -> float | None:
        setting = self.settings.get(quantity)
        if setting is None:
            return None
        if setting.url is None:
            return setting.value
        r = self.readings.get(quantity)
        return None if r is None else r.value

    @property
    def any_configured(self) -> bool:
        return any(s is not None for s in self.settings.values())

    def cost_of_energy(self, e: EnergyFigure, tax_watts: float | None = None,
                       saved_watts: float | None = None) -> CostFigure:
        """One scope's marginal J/token and marginal power in money and carbon; with the scope's recomputation
        tax and offload saving in W (methods.md s12), those per day too."""
        jpt = e.marginal_joules_per_token
        watts = None if jpt is None else cost.marginal_watts(e.basis.energy_joules, e.basis.idle_joules,
                                                               e.basis.seconds)
        price, intensity = self.value("electricity_price"), self.value("carbon_intensity")
        return CostFigure(scope=e.scope, marginal_watts=watts,
                          money_per_million_tokens=cost.money_per_million_tokens(jpt, price),
                          co2e_grams_per_thousand_tokens=cost.co2e_grams_per_thousand_tokens(jpt, intensity),
                          money_per_day=cost.money_per_day(watts, price),
                          co2e_grams_per_day=cost.co2e_grams_per_day(watts, intensity), currency=self.currency,
                          recompute_tax_money_per_day=cost.money_per_day(tax_watts, price),
                          recompute_tax_co2e_grams_per_day=cost.co2e_grams_per_day(tax_watts, intensity),
                          offload_saved_money_per_day=cost.money_per_day(saved_watts, price),
                          offload_saved_co2e_grams_per_day=cost.co2e_grams_per_day(saved_watts, intensity))

    def costs(self, energy: tuple[EnergyFigure, ...], tax_watts: dict[str, float] | None,
              saved_watts: dict[str, float] | None) -> tuple[CostFigure, ...]:
        """A window's CostFigures, one per energy scope, while it is assembled (model/server.py ServerModel.window):
        empty when no price or intensity is configured."""
        if not self.any_configured:
            return ()
        tax, saved = tax_watts or {}, saved_watts or {}
        return tuple(self.cost_of_energy(e, tax.get(e.scope), saved.get(e.scope)) for e in energy)

    def figures(self) -> tuple[PriceFigure, ...]:
        return tuple(self._figure(q) for q in self.settings)

    def _figure(self, quantity: str) -> PriceFigure:
        setting = self.settings[quantity]
        currency = self.currency if quantity == "electricity_price" else None
        if setting is None:
            return PriceFigure(quantity=quantity, value=None, source="not_configured", reason=HOW_TO_SET[quantity])
        if setting.url is None:
            return PriceFigure(quantity=quantity, value=setting.value, source="configured", currency=currency)
        r = self.readings.get(quantity)
        reason = "not_read_yet" if r is None else r.status.reason
        return PriceFigure(quantity=quantity, value=self.value(quantity), source="url", currency=currency,
                           url=setting.shown, age_seconds=None if r is None else r.age_seconds, reason=reason)

    def statuses(self) -> tuple[SourceStatus, ...]:
        """The price URLs' health, beside nvml and rapl (kvwatt_source_up{source="electricity_price"} ...)."""
        return tuple(self.readings[q].status for q, s in self.settings.items()
                     if s is not None and s.url is not None and q in self.readings)
