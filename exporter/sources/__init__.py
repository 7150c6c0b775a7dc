"""Where kvwatt's readings come from: engine adapters (the seam: engine.py), their HTTP read (endpoint.py), NVML
and RAPL.

Importing the package loads the built-in engine adapters once; each registers itself into the seam's registry
at import (engine.register, node_exporter's registerCollector style), so ``engine.adapters()`` is complete
whenever anything under exporter.sources has been imported. Their order in auto-detection is the ``order`` each
one registers with (engine.py: vLLM, SGLang, TensorRT-LLM, then the add-ons LMCache and Dynamo), not the order
of the lines below.
"""

from exporter.sources import dynamo, lmcache, sglang, trtllm, vllm  # noqa: F401  (they register themselves)
