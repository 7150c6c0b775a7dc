"""kvwatt: watches vLLM servers with KV offloading and explains KV pressure, recomputation and energy."""

__version__ = "0.1.0"
