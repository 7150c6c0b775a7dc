"""Energy accounting: idle baselines (baseline), device-to-server attribution (attribution), the daemon's
per-tick energy side (runtime) and the `kvwatt baseline idle` command (idle_command). docs/energy.md."""
