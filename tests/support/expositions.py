"""Real vLLM expositions reshaped for tests: a data-parallel server built from single-engine captures, a
long-running engine (counters offset by what it served before the capture).

No real data-parallel capture exists (tests/data/vllm-0.32-cpu holds one engine): a second engine is the same
capture's series relabelled engine="0" -> engine="1", each printed right after its engine-0 twin so every
family stays in one block under its # HELP / # TYPE lines, as vLLM writes it.
"""

from __future__ import annotations

ENGINE0 = 'engine="0"'


def _key(line: str) -> str:
    """A sample line without its value: the series' identity."""
    return line.rsplit(" ", 1)[0]


def _name(line: str) -> str:
    return line.split("{", 1)[0].split(" ", 1)[0]


def offset_counters(text: str, offset: float) -> str:
    """Every ``vllm:*_total`` counter plus ``offset``: an engine that had served that much before."""
    out = []
    for line in text.split("\n"):
        if line.startswith("vllm:") and _name(line).endswith("_total"):
            key, value = line.rsplit(" ", 1)
            line = f"{key} {float(value) + offset!r}"
        out.append(line)
    return "\n".join(out)


def data_parallel(engine0: str, engine1: str | None) -> str:
    """``engine0``'s exposition with a second engine whose series come from ``engine1`` (another capture,
    relabelled engine="1"); ``engine1`` None: the second engine is absent (vanished)."""
    if engine1 is None:
        return engine0
    second = {_key(ln): ln for ln in engine1.split("\n") if ln.startswith("vllm:") and ENGINE0 in ln}
    out = []
    for line in engine0.split("\n"):
        out.append(line)
        twin = second.get(_key(line)) if ENGINE0 in line else None
        if twin is not None:
            out.append(twin.replace(ENGINE0, 'engine="1"'))
    return "\n".join(out)
