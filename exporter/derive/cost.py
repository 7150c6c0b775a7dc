"""Energy figures in money and carbon (docs/energy.md, "Money and carbon"). Pure arithmetic, no state.

    money per 1e6 generated tokens = J/token * 1e6 / 3.6e6 J/kWh * price per kWh
    g CO2e per 1,000 tokens        = J/token * 1e3 / 3.6e6 J/kWh * g CO2e per kWh
    kWh per day                    = W * 86,400 s / 3.6e6 J/kWh  (= W * 0.024)
    money per day                  = kWh/day * price per kWh
    g CO2e per day                 = kWh/day * g CO2e per kWh        (kg: / 1,000)

None in, None out: an unknown energy figure or an unconfigured (or stale) price is no number, never 0.
"""

from __future__ import annotations

from exporter.derive.marginal import above_idle

JOULES_PER_KWH = 3.6e6
SECONDS_PER_DAY = 86_400.0
TOKENS_PER_MILLION = 1e6
TOKENS_PER_THOUSAND = 1e3


def kwh_per_day(watts: float) -> float:
    """A steady power (W) as energy per day (kWh)."""
    return watts * SECONDS_PER_DAY / JOULES_PER_KWH


def money_per_million_tokens(joules_per_token: float | None, price_per_kwh: float | None) -> float | None:
    """J per generated token -> money (the price's currency) per million generated tokens."""
    if joules_per_token is None or price_per_kwh is None:
        return None
    return joules_per_token * TOKENS_PER_MILLION / JOULES_PER_KWH * price_per_kwh


def co2e_grams_per_thousand_tokens(joules_per_token: float | None,
                                   grams_per_kwh: float | None) -> float | None:
    """J per generated token -> grams CO2e per 1,000 generated tokens."""
    if joules_per_token is None or grams_per_kwh is None:
        return None
    return joules_per_token * TOKENS_PER_THOUSAND / JOULES_PER_KWH * grams_per_kwh


def money_per_day(watts: float | None, price_per_kwh: float | None) -> float | None:
    """A power (W) held for a day -> money per day."""
    if watts is None or price_per_kwh is None:
        return None
    return kwh_per_day(watts) * price_per_kwh


def co2e_grams_per_day(watts: float | None, grams_per_kwh: float | None) -> float | None:
    """A power (W) held for a day -> g CO2e per day (grams: Prometheus' base unit; the page shows kg)."""
    if watts is None or grams_per_kwh is None:
        return None
    return kwh_per_day(watts) * grams_per_kwh


def marginal_watts(energy_joules: float, idle_joules: float | None, seconds: float) -> float | None:
    """The window's mean power above idle, (E - P_idle*dt) / dt, over the intervals with an energy sample
    (derive/energy.EnergyPerToken's sums); None without an idle baseline or without time. May be negative
    when P_idle is stale, like the marginal J/token: reported, not clamped."""
    if idle_joules is None or not seconds > 0:
        return None
    return above_idle(energy_joules, idle_joules) / seconds
