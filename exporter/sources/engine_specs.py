"""Engine adapters described as data: which of an engine's series feed which kvwatt key (sources/engine.py).

SGLang, TensorRT-LLM, LMCache and Dynamo (sources/sglang.py, trtllm.py, lmcache.py, dynamo.py) each declare an
``EngineSpec`` and subclass ``SpecAdapter`` for what a table cannot say (a share computed from two series, the
slow-changing facts). This module does the rest the same way for all of them, with the vLLM adapter's rules
(docs/architecture.md "Data-parallel engines and value ranges"):

- only the families a spec names are parsed (``expfmt.parse_families``), under every spelling: each of the
  engine's prefixes (``sglang:`` in the code, ``sglang_`` seen in the wild), with and without ``_total``;
- a counter or summed gauge is summed per data-parallel rank (``rank_label``) and the reading keeps each
  rank's counters (``engine_counters``), so the store sees one rank reset or vanish;
- a rank is the value of ``rank_label`` (a data-parallel rank: its own requests, tokens and KV pool), prefixed
  by the worker behind a router (``worker_labels``: ``worker_addr``) when the exposition re-exports several;
- samples of a replica (``replica_labels``: a tensor- or pipeline-parallel rank reporting the same figure as
  its group's first) are counted once: of the samples that differ only in replica labels (and ``pid``, the
  process that wrote them), the one with the lowest replica ranks is kept -- rank 0's where it is there, the
  lowest present otherwise (a ``pp_rank="1"`` endpoint alone is still read). Under SGLang's DP attention each
  DP rank carries ``tp_rank`` equal to it (``dp_rank="3",tp_rank="3"``): its own group, so it is kept.
  ``all_replicas`` keeps every replica (bytes each rank holds for its own shard);
- a fraction (0..1) takes the highest rank (the fullest KV pool), and each pool's value is kept too
  (``pool_fractions``); a value out of range makes its key unknown (absent, never clamped) and is named in
  ``rejected``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exporter.samples import EngineInfo, EngineReading
from exporter.sources.engine import KV_POOL_USAGE, KV_USAGE, OFFLOAD_BUFFER, SourceError, capabilities_of, labelled_key
from exporter.sources.expfmt import Exposition, Labels, parse_families, process_start_time
from exporter.sources.ranges import MAX_VALUE

Series = dict[Labels, float]


@dataclass(frozen=True)
class Pick:
    """The samples of one family (``name``: without the engine's prefix and without ``_total``) that count."""

    name: str
    match: tuple[tuple[str, str], ...] = ()  # labels that must have exactly these values
    label_prefix: tuple[str, str] | None = None  # (label, prefix its value must start with)
    all_replicas: bool = False  # sum every replica too (per-shard bytes), not only rank 0's copy

    def matches(self, lab: dict[str, str]) -> bool:
        if any(lab.get(k) != v for k, v in self.match):
            return False
        return self.label_prefix is None or lab.get(self.label_prefix[0], "").startswith(self.label_prefix[1])


PROCESS_LABELS = ("pid",)  # who wrote a sample (prometheus_client's multiprocess mode), not what it counts


@dataclass(frozen=True)
class EngineSpec:
    prefixes: tuple[str, ...]  # wire prefixes, tried in order ("" when the names carry their own)
    counters: dict[str, tuple[Pick, ...]] = field(default_factory=dict)  # key -> picks, summed
    gauges: dict[str, tuple[Pick, ...]] = field(default_factory=dict)  # key -> picks, summed (counts, bytes)
    fractions: dict[str, Pick] = field(default_factory=dict)  # key -> a 0..1 gauge, highest rank
    info: tuple[str, ...] = ()  # further families the adapter's ``facts`` reads
    rank_label: str = ""  # the data-parallel rank label, "" when the engine has none
    replica_labels: tuple[str, ...] = ()  # labels whose further values repeat their group's first figures
    worker_labels: tuple[str, ...] = ()  # labels naming one engine of several behind a router / gateway

    def rank_of(self, lab: dict[str, str]) -> str:
        """The rank a sample belongs to: "" (one engine), "3" (DP rank 3), "10.0.0.1:30000/3" (behind a router)."""
        worker = next((lab[w] for w in self.worker_labels if lab.get(w)), "")
        rank = lab.get(self.rank_label, "") if self.rank_label else ""
        return f"{worker}/{rank}" if worker and rank else worker or rank

    def names(self) -> frozenset[str]:
        return frozenset(p.name for picks in (*self.counters.values(), *self.gauges.values()) for p in picks) | \
            {p.name for p in self.fractions.values()} | set(self.info)

    def wire_names(self) -> frozenset[str]:
        return frozenset(f"{prefix}{name}{suffix}" for prefix in self.prefixes for name in self.names()
                         for suffix in ("", "_total"))


def canonical(exp: Exposition, spec: EngineSpec) -> dict[str, Series]:
    """Series keyed by the spec's names: the prefix and ``_total`` stripped; the first spelling seen wins."""
    names = spec.names()
    out: dict[str, Series] = {}
    for wire, samples in exp.series.items():
        for prefix in spec.prefixes:
            if wire.startswith(prefix):
                name = wire[len(prefix):]
                name = name if name in names else name.removesuffix("_total")
                if name in names and name not in out:
                    out[name] = samples
                    break
    return out


def _detail(name: str, labels: Labels, v: float, high: float) -> str:
    shown = ",".join(f'{k}="{val}"' for k, val in labels)
    return f"{name}{{{shown}}} = {v!r} outside [0, {high:g}]"


def _replica_order(value: str) -> tuple[int, int | str]:
    return (0, int(value)) if value.isdigit() else (1, value)


def kept(samples: Series, pick: Pick, spec: EngineSpec) -> list[tuple[Labels, dict[str, str], float]]:
    """The picked samples, each replica group counted once (the module docstring says which sample stays)."""
    chosen: dict[tuple, tuple[tuple, Labels, dict[str, str], float]] = {}
    ignored = (*spec.replica_labels, *PROCESS_LABELS)
    for labels, v in samples.items():
        lab = dict(labels)
        if not pick.matches(lab):
            continue
        if pick.all_replicas:
            chosen[(labels,)] = ((), labels, lab, v)
            continue
        group = tuple((k, val) for k, val in labels if k not in ignored)
        order = tuple(_replica_order(lab.get(r, "0")) for r in spec.replica_labels)
        if group not in chosen or order < chosen[group][0]:
            chosen[group] = (order, labels, lab, v)
    return [(labels, lab, v) for _, labels, lab, v in chosen.values()]


def rank_sums(series: dict[str, Series], picks: tuple[Pick, ...], spec: EngineSpec, key: str,
              rejected: dict[str, str]) -> dict[str, float] | None:
    """Per rank, the sum of the picked samples; None when none is on the wire or (``rejected[key]`` says why)
    one of them or the sum is out of [0, MAX_VALUE]."""
    sums: dict[str, float] = {}
    for pick in picks:
        for labels, lab, v in kept(series.get(pick.name, {}), pick, spec):
            if not 0.0 <= v <= MAX_VALUE:  # NaN fails too
                rejected[key] = _detail(pick.name, labels, v, MAX_VALUE)
                return None
            rank = spec.rank_of(lab)
            sums[rank] = sums.get(rank, 0.0) + v
    if not sums:
        return None
    if sum(sums.values()) > MAX_VALUE:
        rejected[key] = f"{key} summed = {sum(sums.values())!r} above {MAX_VALUE:g}"
        return None
    return sums


def pool_fractions(series: dict[str, Series], pick: Pick, spec: EngineSpec, key: str,
                   rejected: dict[str, str]) -> dict[str, float] | None:
    """Per rank (one KV pool each), the highest picked sample of a fraction; None when absent or one is out
    of [0, 1]."""
    pools: dict[str, float] = {}
    for labels, lab, v in kept(series.get(pick.name, {}), pick, spec):
        if not 0.0 <= v <= 1.0:
            rejected[key] = _detail(pick.name, labels, v, 1.0)
            return None
        rank = spec.rank_of(lab)
        pools[rank] = max(pools.get(rank, v), v)
    return pools or None


def model_name(series: dict[str, Series]) -> str:
    for samples in series.values():
        for labels in samples:
            name = dict(labels).get("model_name", "")
            if name:
                return name
    return ""


def first_value(series: dict[str, Series], name: str) -> float | None:
    samples = series.get(name)
    return next(iter(samples.values())) if samples else None


@dataclass
class Parts:
    """A reading being built: what the spec's tables gave, for ``SpecAdapter.facts`` to complete."""

    series: dict[str, Series]
    counters: dict[str, float]
    by_rank: dict[str, dict[str, float]]
    gauges: dict[str, float]
    rejected: dict[str, str]

    def derive_counter(self, key: str, fn, *inputs: str) -> None:
        """``key`` = fn(inputs) server-wide and per rank, where every input is known (a share of two counters)."""
        if key in self.counters or not all(k in self.counters for k in inputs):
            return
        value = fn(*(self.counters[k] for k in inputs))
        if value is None or not 0.0 <= value <= MAX_VALUE:
            return
        self.counters[key] = value
        for counters in self.by_rank.values():
            if all(k in counters for k in inputs):
                v = fn(*(counters[k] for k in inputs))
                if v is not None and 0.0 <= v <= MAX_VALUE:
                    counters[key] = v


class SpecAdapter:
    """An engine adapter (sources/engine.py EngineAdapter) driven by an ``EngineSpec``.

    ``detect_prefixes``: an exposition is this engine's when a line starts with one of them. ``addon``: the
    component runs beside a primary engine (an offload library, a KV block manager), so its reading is merged
    into the engine's (sources/combine.py)."""

    name = ""
    addon = False
    spec: EngineSpec
    detect_prefixes: tuple[str, ...] = ()

    def detect(self, text: str) -> bool:
        return any(text.startswith(p) or f"\n{p}" in text for p in self.detect_prefixes)

    def read(self, text: str, problems: list[str] | None = None) -> EngineReading:
        exp = parse_families(text, self.spec.wire_names())
        if not exp.series:
            detail = (f"{exp.errors} malformed lines" if exp.errors
                      else f"no usable {self.name} series in the exposition")
            raise SourceError("parse_error", detail)
        if exp.errors and problems is not None:
            problems.append(f"parse_error: {exp.errors} bad lines skipped")
        return self.extract(exp, process_start_time(text))

    def extract(self, exp: Exposition, process_start: float | None = None) -> EngineReading:
        spec = self.spec
        parts = Parts(canonical(exp, spec), {}, {}, {}, {})
        for key, picks in spec.counters.items():
            sums = rank_sums(parts.series, picks, spec, key, parts.rejected)
            if sums is not None:
                parts.counters[key] = sum(sums.values())
                for rank, v in sums.items():
                    parts.by_rank.setdefault(rank, {})[key] = v
        for key, picks in spec.gauges.items():
            sums = rank_sums(parts.series, picks, spec, key, parts.rejected)
            if sums is not None:
                parts.gauges[key] = sum(sums.values())
        for key, pick in spec.fractions.items():
            pools = pool_fractions(parts.series, pick, spec, key, parts.rejected)
            if pools is not None:
                parts.gauges[key] = max(pools.values())
                if key == KV_USAGE and len(pools) > 1:  # several KV pools: each one's usage too
                    parts.gauges.update({labelled_key(KV_POOL_USAGE, rank): v for rank, v in pools.items()})
        info = self.facts(parts, process_start)
        seen = {**parts.gauges, **dict.fromkeys(parts.rejected, 0.0)}  # refused: on the wire, unknown now
        caps = capabilities_of(parts.counters, seen, info)
        if "offload_buffer_bytes" in parts.rejected:
            caps |= {OFFLOAD_BUFFER}
        return EngineReading(counters=parts.counters, gauges=parts.gauges, info=info, capabilities=caps,
                             engine=self.name, engine_counters=parts.by_rank, rejected=parts.rejected)

    def facts(self, parts: Parts, process_start: float | None) -> EngineInfo:
        """The slow-changing facts; may also complete ``parts`` (derived counters, dropped gauges)."""
        return EngineInfo(model_name=model_name(parts.series), process_start_time_seconds=process_start)
