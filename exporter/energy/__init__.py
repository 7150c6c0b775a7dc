"""Energy accounting: idle baselines (baseline), device-to-server attribution (attribution) and the `kvwatt
baseline idle` measurement (idle); the per-tick energy side is exporter/model/energy.py. docs/energy.md."""
