"""Pure functions from the store's window aggregates (and grid buckets) to the figures kvwatt exports. No I/O,
no clocks; from the store only its types (tests/test_layers_store.py)."""
