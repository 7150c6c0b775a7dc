"""The store: bounded per-server histories of Intervals and the incremental windows over them (sliding
aggregates and fixed-grid buckets). It sits between samples and derive: it imports samples, never derive;
derive reads its aggregates and imports nothing from here but types (tests/test_layers_store.py)."""

from exporter.store.aggregate import ScopeSums, WindowAggregate, aggregate_of, gauge_values, is_loaded
from exporter.store.buckets import Bucket, Grid, bucket_index, buckets_of
from exporter.store.deltas import DeviceTracker, EnergyAccumulator, counter_deltas, engine_deltas, reset_engines
from exporter.store.history import ServerHistory

__all__ = ["Bucket", "DeviceTracker", "EnergyAccumulator", "Grid", "ScopeSums", "ServerHistory",
           "WindowAggregate", "aggregate_of", "bucket_index", "buckets_of", "counter_deltas", "engine_deltas",
           "gauge_values", "is_loaded", "reset_engines"]
