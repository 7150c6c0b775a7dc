"""A completed grid bucket's aggregate, packed (docs/architecture.md "Garbage collection").

A completed bucket never changes (a late interval is rare: store/buckets.py thaws it back into a
``WindowAggregate``), yet as a live aggregate it was ~22 objects (its sums' lists, two scopes' sums, five sorted
arrays, its span), and an hour holds ~180 buckets a server: most of the tracked objects a full collection walks and
~30 % of the RSS at 64 servers. ``PackedAggregate`` holds the same figures in one ``array('d')`` and a ``Layout``
shared by every bucket with the same keys (the key sets seen are few), and answers the read side of
``WindowAggregate``'s interface with the very same numbers: every sum is read as the aggregate read it
(``s + compensation``) once, when the bucket is packed.

Values, in order (``Layout`` holds the offsets):
    n, covered seconds, loaded seconds, first row, end row
    the still keys' block: n, 0, 0.0, covered seconds
    per counter key: intervals carrying it, those with a nonzero delta, its delta sum, its seconds
    per energy scope: n, covered, loaded, energy, idle n, idle, idle-subset energy, idle-subset seconds,
                      then its counter keys as above
    per sorted gauge: its length; then the gauges' sorted values one after the other

A counter that did not move in the bucket and is carried by every interval (preemptions, failed transfers, a
quiet engine's histogram buckets: most of a server's keys) reads n, 0, 0.0, covered seconds: every such key
points at the one still keys' block instead of four values of its own (issue 39: ~20 of bench/soak.py's 35 keys,
a fifth of a bucket). The layout names them, so the reads are the same numbers.
"""

from __future__ import annotations

import math
from array import array
from typing import TYPE_CHECKING, Iterator

from exporter.rules.quantile import interpolate_sorted
from exporter.store.aggregate import SCOPE_KEYS, ScopeKeyed
from exporter.store.columns import IntervalColumns, Span

if TYPE_CHECKING:
    from exporter.samples import Interval
    from exporter.store.aggregate import WindowAggregate

_HEAD = 5            # n, covered, loaded, first row, end row; then the still keys' block (_PER_KEY values)
_SCOPE_HEAD = 8      # n, covered, loaded, energy, idle n, idle, idle-subset energy, idle-subset seconds
_PER_KEY = 4         # count, nonzero count, delta, seconds
POOL_PREFIX = "kv_pool_usage@"


class Layout:
    """Where each figure sits in a packed bucket's values; one per key set, shared by the buckets."""

    __slots__ = ("keys", "scopes", "gauges", "gauge_at")

    def __init__(self, keys: tuple[str, ...], scopes: tuple[tuple[str, tuple[str, ...] | None], ...],
                 gauges: tuple[str, ...], still: frozenset[str] = frozenset()) -> None:
        at = _HEAD + _PER_KEY
        self.keys = {}
        for k in keys:  # in the bucket's key order; a still key at the shared block
            if k in still:
                self.keys[k] = _HEAD
            else:
                self.keys[k], at = at, at + _PER_KEY
        self.scopes: dict[str, tuple[int, dict[str, int]]] = {}
        for name, skeys in scopes:
            base = at + _SCOPE_HEAD
            if skeys is None:  # the scope's counter sums are the bucket's own (every interval has its energy)
                self.scopes[name], at = (at, self.keys), base
                continue
            self.scopes[name] = (at, {k: base + i * _PER_KEY for i, k in enumerate(skeys)})
            at = base + len(skeys) * _PER_KEY
        self.gauges = gauges
        self.gauge_at = at  # the gauges' lengths, then their values


_LAYOUTS: dict[tuple, Layout] = {}


def _layout(keys: tuple[str, ...], scopes: tuple, gauges: tuple[str, ...], still: frozenset[str]) -> Layout:
    sig = (keys, scopes, gauges, still)
    found = _LAYOUTS.get(sig)
    if found is None:
        if len(_LAYOUTS) > 256:  # key sets seen are few (engines, versions); bound them anyway
            _LAYOUTS.clear()
        found = _LAYOUTS[sig] = Layout(keys, scopes, gauges, still)
    return found


def _key_values(sums) -> list[float]:
    out: list[float] = []
    for key in sums.keys():
        k = sums._keys[key]
        out += (float(k[0]), float(k[1]), sums.delta(key), sums.seconds_with(key))
    return out


def pack(agg: "WindowAggregate") -> "PackedAggregate":
    """The read-only twin of a completed bucket's aggregate (held in a store's rows: a Span). A scope whose
    counter sums equal the bucket's (the usual case: every interval carries its energy; the same intervals
    added in the same order give the same sums) shares them instead of a copy (~1 KB a bucket)."""
    span = agg.intervals
    keys = tuple(agg.keys())
    block = [float(agg.n), 0.0, 0.0, agg.covered_seconds]  # a still key's values, read as its own
    out = [float(agg.n), agg.covered_seconds, agg.loaded_seconds, float(span.lo), float(span.hi)] + block
    main = _key_values(agg)
    by_key = {k: main[i * _PER_KEY:(i + 1) * _PER_KEY] for i, k in enumerate(keys)}
    still = frozenset(k for k, v in by_key.items() if v == block and math.copysign(1.0, v[2]) > 0)  # not -0.0
    out += [x for k in keys if k not in still for x in by_key[k]]
    scopes = []
    for name, sc in agg._scopes.items():
        if sc.n == 0:
            continue
        skeys, svalues = tuple(sc.keys()), _key_values(sc)
        # a scope sums only SCOPE_KEYS: shared when each of those reads as the bucket's own
        shared = set(skeys) == {k for k in keys if k in SCOPE_KEYS} and \
            svalues == [v for k in skeys for v in by_key[k]]
        scopes.append((name, None if shared else skeys))
        out += (float(sc.n), sc.covered_seconds, sc.loaded_seconds, sc.energy_joules, float(sc.idle_n),
                sc.idle_subset_idle_joules, sc.idle_subset_energy_joules, sc.idle_subset_seconds)
        if not shared:
            out += svalues
    gauges = tuple(k for k, s in agg._sorted.items() if s)
    layout = _layout(keys, tuple(scopes), gauges, still)
    values = array("d", out)
    values.extend(float(len(agg._sorted[k])) for k in gauges)
    for k in gauges:
        values.extend(agg._sorted[k])
    return PackedAggregate(layout, values, span.store)


class _PackedSums:
    """Counter-sum queries over a packed range (the whole bucket, or one scope)."""

    __slots__ = ()
    _v: array

    def _key_at(self) -> dict[str, int]:
        raise NotImplementedError

    def delta(self, key: str) -> float | None:
        i = self._key_at().get(key)
        return None if i is None else self._v[i + 2]

    def seconds_with(self, key: str) -> float:
        i = self._key_at().get(key)
        return 0.0 if i is None else self._v[i + 3]

    def count_with(self, key: str) -> int:
        i = self._key_at().get(key)
        return 0 if i is None else int(self._v[i])

    def keys(self) -> list[str]:
        return list(self._key_at())


class PackedScope(ScopeKeyed, _PackedSums):
    """ScopeSums' read side over a packed bucket (made when asked for: nothing kept per scope); as ScopeSums, only
    the counters of SCOPE_KEYS (a shared layout's table holds the bucket's other keys too)."""

    __slots__ = ("name", "_v", "_at", "_keys")

    def __init__(self, name: str, values: array, at: int, keys: dict[str, int]) -> None:
        self.name, self._v, self._at, self._keys = name, values, at, keys

    def _key_at(self) -> dict[str, int]:
        return self._keys

    n = property(lambda self: int(self._v[self._at]))
    covered_seconds = property(lambda self: self._v[self._at + 1])
    loaded_seconds = property(lambda self: self._v[self._at + 2])
    energy_joules = property(lambda self: self._v[self._at + 3])
    idle_n = property(lambda self: int(self._v[self._at + 4]))
    idle_subset_idle_joules = property(lambda self: self._v[self._at + 5])
    idle_subset_energy_joules = property(lambda self: self._v[self._at + 6])
    idle_subset_seconds = property(lambda self: self._v[self._at + 7])

    @property
    def idle_joules(self) -> float | None:
        """As ScopeSums: None unless every interval of the scope has idle energy."""
        n = self.n
        return None if n == 0 or self.idle_n != n else self._v[self._at + 5]


class PackedAggregate(_PackedSums):
    """WindowAggregate's read side (sums, scopes, sorted gauges, the rows held) over one array of doubles."""

    __slots__ = ("_layout", "_v", "_store")

    def __init__(self, layout: Layout, values: array, store: IntervalColumns) -> None:
        self._layout, self._v, self._store = layout, values, store

    def _key_at(self) -> dict[str, int]:
        return self._layout.keys

    n = property(lambda self: int(self._v[0]))
    covered_seconds = property(lambda self: self._v[1])
    loaded_seconds = property(lambda self: self._v[2])

    @property
    def rows(self) -> tuple[int, int]:
        """The store rows [lo, hi) of the bucket's intervals."""
        return int(self._v[3]), int(self._v[4])

    @property
    def intervals(self) -> Span:
        span = Span(self._store)
        span.lo, span.hi = self.rows
        return span

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator["Interval"]:
        return iter(self.intervals)

    def __repr__(self) -> str:
        return f"PackedAggregate(n={self.n}, covered_seconds={self.covered_seconds:g})"

    def scope(self, name: str) -> PackedScope | None:
        found = self._layout.scopes.get(name)
        return None if found is None else PackedScope(name, self._v, *found)

    def sorted_gauge(self, key: str) -> "list[float] | array":
        """The gauge's values in ascending order (do not modify)."""
        lay, v = self._layout, self._v
        at = lay.gauge_at + len(lay.gauges)
        for i, k in enumerate(lay.gauges):
            n = int(v[lay.gauge_at + i])
            if k == key:
                return v[at:at + n]
            at += n
        if key in ("kv_usage", "pending", "running", "waiting", "waiting_capacity") or key.startswith(POOL_PREFIX):
            return []  # kept in order and held by no interval
        lo, hi = self.rows
        return sorted(self._store.gauge_values(key, lo, hi))

    def quantile(self, gauge_key: str, q: float) -> float | None:
        return interpolate_sorted(self.sorted_gauge(gauge_key), q)

    def pools(self) -> list[str]:
        return sorted(k for k in self._layout.gauges if k.startswith(POOL_PREFIX))

    def gauge_min(self, key: str) -> float | None:
        s = self.sorted_gauge(key)
        return s[0] if s else None

    def gauge_max(self, key: str) -> float | None:
        s = self.sorted_gauge(key)
        return s[-1] if s else None

    def gauge_count(self, key: str) -> int:
        return len(self.sorted_gauge(key))


def unpack(p: PackedAggregate) -> "WindowAggregate":
    """The live aggregate again (a late interval joins the bucket, or a held step is voided: store/buckets.py),
    reading exactly as the packed one did; each sum's compensation is folded into it."""
    from exporter.store.aggregate import ORDERED_GAUGES, ScopeSums, WindowAggregate
    lay, v = p._layout, p._v
    agg = WindowAggregate(store=p._store)
    agg.intervals.lo, agg.intervals.hi = p.rows
    agg.n = p.n
    agg._cov[0], agg._loaded[0] = v[1], v[2]
    agg._keys = _unpacked_keys(v, lay.keys)
    for name, (at, keys) in lay.scopes.items():
        sc = agg._scopes[name] = ScopeSums(name)
        sc.n, sc._cov[0], sc._loaded[0], sc._energy[0] = int(v[at]), v[at + 1], v[at + 2], v[at + 3]
        sc.idle_n, sc._idle[0], sc._idle_energy[0], sc._idle_seconds[0] = int(v[at + 4]), v[at + 5], v[at + 6], \
            v[at + 7]
        sc._keys = _unpacked_keys(v, {k: i for k, i in keys.items() if k in SCOPE_KEYS})  # shared: the bucket's
    agg._sorted = {k: array("d") for k in ORDERED_GAUGES}
    for k in lay.gauges:
        agg._sorted[k] = array("d", p.sorted_gauge(k))
    return agg


def _unpacked_keys(v: array, keys: dict[str, int]) -> dict[str, list]:
    # [count, nonzero count, sum, sum compensation, seconds, seconds compensation] (store/aggregate.py)
    return {k: [int(v[i]), int(v[i + 1]), v[i + 2], 0.0, v[i + 3], 0.0] for k, i in keys.items()}
