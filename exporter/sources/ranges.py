"""Value ranges and fixed words shared by every engine adapter and the HTTP read (engine-neutral: no adapter
imports another adapter for them)."""

from __future__ import annotations

GIB = 2 ** 30
# The largest counter or gauge value taken (docs/architecture.md "Data-parallel engines and value ranges"):
# no real server comes near (FLOPs per GPU at 1e16/s for 30 years is 1e25), and below it a window's sum of
# deltas stays finite, so every figure does. A value above it, negative, NaN or infinite is refused.
MAX_VALUE = 1e30
OUT_OF_RANGE = "out_of_range"  # the fixed reason word in the source status (details go to the log)
