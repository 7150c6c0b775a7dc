"""Energy above idle (methods.md s1): E - P_idle x dt over the same intervals, the one subtraction every marginal
figure (J/token, power, the per-phase windows, dE's sums) is built on."""

from __future__ import annotations

# A difference this small against its operands is their rounding, not a power: a GPU drawing exactly its P_idle
# tick after tick sums to E and P_idle x dt that differ in their last bits (-1.1e-20 J/token was served as a
# "stale P_idle" rejection by the bounds fuzzer). 1e-9 of ~200 J is 2e-7 J, under any counter's resolution (NVML
# counts millijoules).
ROUNDING = 1e-9


def above_idle(energy_joules: float, idle_joules: float) -> float:
    """``energy_joules - idle_joules``, 0 where the two agree to their rounding. Still negative where P_idle is
    really above the power drawn (a stale baseline): reported, not clamped."""
    diff = energy_joules - idle_joules
    return 0.0 if abs(diff) <= ROUNDING * max(abs(energy_joules), abs(idle_joules)) else diff
