"""`kvwatt demo`: the real daemon on a bundled capture of a real engine, on loopback only (docs/demo.md)."""
