"""A plan's `sweep:` matrix, expanded into conditions and ON/OFF pairs (docs/experiment.md "Sweeps").

    sweep:
      concurrency: [4, 8]          # the workload's closed-loop sessions
      kv_blocks: [2000, 256, 128]  # one KV-size axis: kv_blocks | gpu_memory_utilization | kv_cache_memory_bytes
      buffer_gib: [32, 64]         # the ON conditions' offload buffer
      offload: [off, on]           # default: [off, on] with buffer_gib, else [off]

Every combination of the axes is a condition: one OFF condition per (concurrency, KV size) and one ON condition
per (concurrency, KV size, buffer) whose `baseline` is the OFF condition at the same concurrency and KV size.
Each axis value is also a placeholder ({concurrency}, {kv_blocks}, {buffer_gib}, {offload}, ...); the KV axis's
vLLM flag is appended to the condition's arguments unless the server command places the placeholder itself,
and ON conditions get `offload_args` (default: vLLM's native CPU offloading with {buffer_gib} GiB).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from itertools import product
from typing import Any

from exporter.config import ConfigError, shown
from exporter.rules.limits import MAX_CONCURRENCY, MAX_RUNS
from kvwatt_lab.experiment import template, values

KV_FLAGS = {  # KV-size axis -> the vLLM flag that sets it, and its short tag in condition names
    "kv_blocks": ("--num-gpu-blocks-override", "kv"),
    "gpu_memory_utilization": ("--gpu-memory-utilization", "gmu"),
    "kv_cache_memory_bytes": ("--kv-cache-memory-bytes", "kvmem"),
}
AXES = ("concurrency", *KV_FLAGS, "buffer_gib", "offload")
SWEEP_KEYS = (*AXES, "offload_args")
DEFAULT_OFFLOAD_ARGS = ("--kv-offloading-size", "{buffer_gib}", "--kv-offloading-backend", "native")
# Sizes beyond any host (1 PiB): refused with the key, not passed on to crash the run (buffer_gib 1e308 once named
# a condition after its 309 digits, too long for a file name).
MAX_BUFFER_GIB = float(1 << 20)
MAX_KV_CACHE_BYTES = 1 << 50
# kv_cache_memory_bytes as vLLM's --kv-cache-memory-bytes reads it (vllm.utils.argparse_utils.human_readable_int):
# digits, or digits with a decimal suffix k/m/g/t (decimals allowed), or whole digits with a binary K/M/G/T
_BYTES_RE = re.compile(r"^(?:(\d+)|(\d+(?:\.\d+)?)([kmgt])|(\d+)([KMGT]))$")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_OFFLOAD_WORDS = {False: "off", True: "on", "off": "off", "on": "on"}  # YAML 1.1 reads bare on/off as booleans


def _kv_value(name: str):
    def parse(v: Any, k: str) -> Any:
        if name == "kv_blocks":
            return values.integer(v, k, 1)
        if name == "gpu_memory_utilization":
            return values.ratio(v, k)
        return _kv_bytes(v, k)
    return parse


def _kv_bytes(v: Any, k: str) -> int | str:
    """A kv_cache_memory_bytes value, checked (kv_cache_bytes) and kept as given: vLLM reads the string itself."""
    kv_cache_bytes(v, k)
    return v


def kv_cache_bytes(v: Any, k: str) -> int:
    """The bytes of an integer, or of a string as vLLM reads it (4G, 25.6g, 8589934592), from 1 to
    MAX_KV_CACHE_BYTES; ConfigError naming ``k`` otherwise."""
    expected = "a byte count (an integer, or a string such as 4G or 25.6g)"
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ConfigError(f"{k}: expected {expected}, got {shown(v)}")
    # 32 characters hold any size up to the limit; a longer string is refused before int() or float() reads it
    m = _BYTES_RE.match(v.strip()) if isinstance(v, str) and len(v) <= 32 else None
    if isinstance(v, str) and m is None:
        raise ConfigError(f"{k}: expected {expected}, got {shown(v)}")
    if m is None:
        size = v
    elif m.group(1):
        size = int(m.group(1))
    elif m.group(2):
        size = int(float(m.group(2)) * _DECIMAL[m.group(3)])  # as vLLM rounds it
    else:
        size = int(m.group(4)) * _BINARY[m.group(5)]
    if not 1 <= size <= MAX_KV_CACHE_BYTES:
        raise ConfigError(f"{k}: must be from 1 to {MAX_KV_CACHE_BYTES} bytes (1 PiB), got {shown(v)}")
    return size


def _offload_word(v: Any, k: str) -> str:
    if isinstance(v, (bool, str)) and v in _OFFLOAD_WORDS:
        return _OFFLOAD_WORDS[v]
    raise ConfigError(f"{k}: expected off or on, got {shown(v)}")


_PARSERS = {
    "concurrency": lambda v, k: values.integer(v, k, 1, MAX_CONCURRENCY),
    **{name: _kv_value(name) for name in KV_FLAGS},
    "buffer_gib": lambda v, k: values.number(v, k, 0.0, True, MAX_BUFFER_GIB),
    "offload": _offload_word,
}


def parse_axes(value: Any) -> dict[str, list]:
    """The declared axes, each a non-empty list of distinct checked values; ConfigError naming the key."""
    data = values.mapping(value, "sweep")
    values.known_keys(data, SWEEP_KEYS, "sweep")
    axes: dict[str, list] = {}
    for name in AXES:
        if name not in data:
            continue
        items = data[name]
        if not isinstance(items, list) or not items:
            raise ConfigError(f"sweep.{name}: expected a non-empty list of values, got {shown(items)}")
        if len(items) > MAX_RUNS:
            raise ConfigError(f"sweep.{name}: {len(items)} values, more than the limit of {MAX_RUNS} runs")
        parsed = [_PARSERS[name](v, f"sweep.{name}[{i}]") for i, v in enumerate(items)]
        seen: set = set()
        for i, v in enumerate(parsed):
            if v in seen:
                raise ConfigError(f"sweep.{name}[{i}]: {shown(items[i])} is listed twice")
            seen.add(v)
        axes[name] = parsed
    kv = [n for n in KV_FLAGS if n in axes]
    if len(kv) > 1:
        raise ConfigError(f"sweep.{kv[1]}: one KV-size axis per sweep (also given: sweep.{kv[0]})")
    _check_offload(axes, "offload_args" in data)
    if not any(n in axes for n in ("concurrency", *KV_FLAGS, "buffer_gib")):
        raise ConfigError(f"sweep: no axis to sweep (give one of {', '.join(a for a in AXES if a != 'offload')})")
    return axes


def _check_offload(axes: dict[str, list], custom_args: bool) -> None:
    offload = axes.setdefault("offload", ["off", "on"] if "buffer_gib" in axes else ["off"])
    if "on" in offload and "off" not in offload:
        raise ConfigError("sweep.offload: ON conditions are compared with the OFF condition at the same "
                          "concurrency and KV size; add off")
    if "buffer_gib" in axes and "on" not in offload:
        raise ConfigError("sweep.buffer_gib: only ON conditions have an offload buffer; add on to sweep.offload")
    if "on" in offload and "buffer_gib" not in axes and not custom_args:
        raise ConfigError("sweep.buffer_gib: ON conditions need a buffer size (the default sweep.offload_args "
                          "pass --kv-offloading-size {buffer_gib})")


def count(axes: dict[str, list]) -> int:
    """Conditions the axes expand into: OFF per (concurrency, KV size), ON per (concurrency, KV size, buffer)."""
    shared = math.prod(len(axes.get(n, [None])) for n in ("concurrency", *KV_FLAGS))
    on = len(axes.get("buffer_gib", [None])) if "on" in axes["offload"] else 0
    return shared * (("off" in axes["offload"]) + on)


def expand(data: dict, command: tuple[str, ...], base_workload, condition_type, plan_vars: dict) -> list:
    """The sweep's conditions (``condition_type`` is plan.Condition), OFF before the ON ones that name it."""
    axes = parse_axes(data)
    if count(axes) > MAX_RUNS:
        raise ConfigError(f"sweep: {count(axes)} conditions, more than the limit of {MAX_RUNS} runs")
    offload_args = (values.argv(data["offload_args"], "sweep.offload_args", False) if "offload_args" in data
                    else DEFAULT_OFFLOAD_ARGS)
    known = {*plan_vars, *values.BUILTINS, *axes}
    for j, t in enumerate(offload_args if "on" in axes["offload"] else ()):
        template.check(t, known, f"sweep.offload_args[{j}]")
    kv_name = next((n for n in KV_FLAGS if n in axes), None)
    kv_args = _kv_args(kv_name, command)
    out = []
    for concurrency, kv in product(axes.get("concurrency", [None]), axes.get(kv_name, [None])):
        shared = {"concurrency": concurrency, kv_name: kv}
        shared = {k: v for k, v in shared.items() if k is not None and v is not None}
        workload = base_workload if concurrency is None else replace(base_workload, concurrency=concurrency)
        off_name = _name("off", shared, kv_name)
        if "off" in axes["offload"]:
            out.append(_condition(condition_type, off_name, None, kv_args, {**shared, "offload": "off"}, workload))
        if "on" in axes["offload"]:
            for buffer in axes.get("buffer_gib", [None]):
                params = {**shared, **({} if buffer is None else {"buffer_gib": buffer}), "offload": "on"}
                out.append(_condition(condition_type, _name("on", params, kv_name), off_name,
                                      kv_args + offload_args, params, workload))
    return out


def _kv_args(kv_name: str | None, command: tuple[str, ...]) -> tuple[str, ...]:
    """The KV flag to append, unless the server command places the value itself (``{kv_blocks}``)."""
    if kv_name is None:
        return ()
    flag = KV_FLAGS[kv_name][0]
    if any(kv_name in template.placeholders(t, f"server.command[{i}]") for i, t in enumerate(command)):
        return ()
    if any(a == flag or a.startswith(flag + "=") for a in command):
        raise ConfigError(f"sweep.{kv_name}: server.command already sets {flag}; write {{{kv_name}}} there as "
                          "its value or remove it (the sweep appends it)")
    return (flag, "{" + kv_name + "}")


def _condition(condition_type, name: str, baseline: str | None, args: tuple[str, ...], params: dict, workload):
    params = {"offload": params["offload"], "concurrency": workload.concurrency,
              **{k: v for k, v in params.items() if k not in ("offload", "concurrency")}}
    return condition_type(name=name, baseline=baseline, args=tuple(args), env={},
                          vars={k: _text(v) for k, v in params.items()}, workload=workload, params=params)


def _name(offload: str, params: dict, kv_name: str | None) -> str:
    parts = [offload]
    if "concurrency" in params:
        parts.append(f"c{params['concurrency']}")
    if kv_name in params:
        parts.append(KV_FLAGS[kv_name][1] + _text(params[kv_name]))
    if "buffer_gib" in params:
        parts.append(f"buf{_text(params['buffer_gib'])}")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", "-".join(parts))


def _text(value: Any) -> str:
    """A value as a placeholder substitutes it: 64.0 -> "64", 0.25 -> "0.25"."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
