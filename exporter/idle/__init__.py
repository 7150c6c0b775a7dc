"""The idle baseline P_idle per device: learned, measured or configured, and its book (baseline.py), and
`kvwatt baseline idle`, measuring it now (measure.py); the per-tick energy side is exporter/model/energy.py.
docs/energy.md."""
