"""The incremental ``WindowAggregate``: what every derivation reads a window through (docs/architecture.md
"Windows").

A ``WindowAggregate`` keeps running sums over the intervals it holds: per counter key (sum of deltas, number of
intervals carrying it, seconds they cover), per energy scope (the same sums restricted to the intervals with an
energy sample for that scope, plus energy, idle energy and loaded seconds), and a sorted list per gauge in
``ORDERED_GAUGES`` for quantiles. Intervals enter at the tail (``add``) and leave at the head (``remove``), so a
sliding window costs O(1) amortized per interval whatever its length (the sorted lists cost O(log n) to search
plus a memmove).

Floating point: sums are compensated (TwoSum), a key whose intervals all left reads None again (its sum is reset
to 0.0), a key whose held values are all zero reads exactly 0.0, and every ``max(n, RESUM_MIN_REMOVALS)``
removals every sum is made afresh from the held intervals, so add/subtract drift stays bounded however long the
stream runs. Afresh without a pause: a shadow aggregate then sums every interval added (one more ``_add`` a
tick), and once every interval held when it started has left, it holds exactly the held intervals, summed from
zero in order: its sums are adopted (``_adopt``; what ``resum()`` would give at that moment). Summing the
held intervals at once took a tick of 32 servers from ~60 to ~300 ms each time their 60 s windows reached the
count together (every 1000 ticks), and 63-87 ms a server for a 1 h window (bench/bench_window_slide.py; issue
39: the tick's p99).

Every derivation in ``derive/`` takes an aggregate (or a scope's sums); a one-off list of intervals becomes
one through ``aggregate_of``.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, insort
from collections import deque
from typing import Iterable, Iterator

from exporter.rules.quantile import interpolate_sorted
from exporter.samples import Interval
from exporter.store.columns import IntervalColumns, Span, gauge_values  # noqa: F401 (gauge_values: re-exported)

# gauges kept in order structures: quantiles of KV usage and pending requests, and the maxima of running and
# waiting read every tick (derive/pressure.py plausible_preemptions: a scan of a 1 h window otherwise); requests
# waiting for KV capacity, whose mean and share of samples above zero are read every tick (derive/pressure.py)
ORDERED_GAUGES = ("kv_usage", "pending", "running", "waiting", "waiting_capacity")
POOL_PREFIX = "kv_pool_usage@"  # one KV pool's usage (sources/engine.py LABELLED_GAUGE_KEYS): ordered per pool
TOKENS_KEY = "generation_tokens"
# The counters read over a scope's intervals (derive/: energy per token, prompt tokens by source and the older
# prefix-cache counters standing in for them, the per-phase regression): a ScopeSums sums only these, not the
# window's other ~25 counters, which nothing reads per scope (a third of the tick's summing at 64 servers).
SCOPE_KEYS = (TOKENS_KEY, "prompt_local_compute", "prompt_local_cache_hit", "prompt_external_kv_transfer",
              "prefix_queries", "prefix_hits", "external_prefix_hits")
RUNNING_KEY = "running"
RESUM_MIN_REMOVALS = 1000


def is_loaded(iv: Interval) -> bool:
    """Tokens were generated in the interval, or requests were running at its end."""
    return (iv.deltas.get(TOKENS_KEY) or 0.0) > 0 or (iv.gauges.get(RUNNING_KEY) or 0.0) > 0


def ordered_gauge_values(iv: Interval) -> Iterator[tuple[str, float]]:
    """(key, value) of the interval's gauges kept in order structures; "pending" = running + waiting."""
    g = iv.gauges
    v = g.get("kv_usage")
    if v is not None:
        yield "kv_usage", v
    r, w = g.get("running"), g.get("waiting")
    if r is not None and w is not None:
        yield "pending", r + w
    if r is not None:
        yield "running", r
    if w is not None:
        yield "waiting", w
    c = g.get("waiting_capacity")
    if c is not None:
        yield "waiting_capacity", c
    if len(g) > 2:  # pools are there only beside kv_usage and the request gauges
        for key, v in g.items():
            if key.startswith(POOL_PREFIX):
                yield key, v


def _acc(a: list, i: int, x: float) -> None:
    """Compensated (TwoSum) a[i] + a[i+1] += x."""
    s = a[i]
    t = s + x
    if abs(s) >= abs(x):
        a[i + 1] += (s - t) + x
    else:
        a[i + 1] += (x - t) + s
    a[i] = t


# per-key state: [count, nonzero count, sum, sum compensation, seconds, seconds compensation]
_K_N, _K_NZ, _K_S, _K_SEC = 0, 1, 2, 4


class _Sums:
    """Counter sums over a set of intervals (a whole window, or its intervals carrying one energy scope)."""

    __slots__ = ("n", "_cov", "_loaded", "_keys")
    _only: tuple[str, ...] | None = None  # the keys summed; None: every key an interval carries

    def __init__(self) -> None:
        self.n = 0
        self._cov = [0.0, 0.0]
        self._loaded = [0.0, 0.0]
        self._keys: dict[str, list] = {}

    def _reset_sums(self) -> None:
        self._cov[0] = self._cov[1] = 0.0
        self._loaded[0] = self._loaded[1] = 0.0
        for k in self._keys.values():
            k[_K_S] = k[_K_S + 1] = k[_K_SEC] = k[_K_SEC + 1] = 0.0

    def _add(self, iv: Interval, seconds: float, loaded: bool) -> None:
        self.n += 1
        _acc(self._cov, 0, seconds)
        if loaded:
            _acc(self._loaded, 0, seconds)
        keys, deltas = self._keys, iv.deltas
        only = self._only
        for key, d in deltas.items() if only is None else [(k, deltas[k]) for k in only if k in deltas]:
            # _acc inlined: this loop is the hot path
            k = keys.get(key)
            if k is None:
                k = keys[key] = [0, 0, 0.0, 0.0, 0.0, 0.0]
            k[0] += 1
            if d != 0:
                k[1] += 1
                s = k[2]
                t = s + d
                k[3] += ((s - t) + d) if abs(s) >= abs(d) else ((d - t) + s)
                k[2] = t
            s = k[4]
            t = s + seconds
            k[5] += ((s - t) + seconds) if abs(s) >= seconds else ((seconds - t) + s)
            k[4] = t

    def _remove(self, iv: Interval, seconds: float, loaded: bool) -> None:
        self.n -= 1
        if self.n == 0:
            self._cov[0] = self._cov[1] = self._loaded[0] = self._loaded[1] = 0.0
        else:
            _acc(self._cov, 0, -seconds)
            if loaded:
                _acc(self._loaded, 0, -seconds)
        keys, deltas = self._keys, iv.deltas
        only = self._only
        for key, d in deltas.items() if only is None else [(k, deltas[k]) for k in only if k in deltas]:
            k = keys[key]
            k[0] -= 1
            if k[0] == 0:
                del keys[key]  # no interval carries it any more: None again, nothing left to drift
                continue
            if d != 0:
                k[1] -= 1
                if k[1] == 0:
                    k[2] = k[3] = 0.0  # every value left is zero: exactly zero
                else:
                    s = k[2]
                    t = s - d
                    k[3] += ((s - t) - d) if abs(s) >= abs(d) else ((-d - t) + s)
                    k[2] = t
            s = k[4]
            t = s - seconds
            k[5] += ((s - t) - seconds) if abs(s) >= seconds else ((-seconds - t) + s)
            k[4] = t

    # --- queries -------------------------------------------------------------------------------------------
    @property
    def covered_seconds(self) -> float:
        return self._cov[0] + self._cov[1]

    @property
    def loaded_seconds(self) -> float:
        return self._loaded[0] + self._loaded[1]

    def delta(self, key: str) -> float | None:
        """Sum of the key's deltas over the intervals carrying it; None when none carries it."""
        k = self._keys.get(key)
        if k is None:
            return None
        return k[_K_S] + k[_K_S + 1] if k[_K_NZ] else 0.0

    def seconds_with(self, key: str) -> float:
        """Seconds covered by the intervals carrying ``key`` in their deltas."""
        k = self._keys.get(key)
        return 0.0 if k is None else k[_K_SEC] + k[_K_SEC + 1]

    def count_with(self, key: str) -> int:
        k = self._keys.get(key)
        return 0 if k is None else k[_K_N]

    def keys(self) -> list[str]:
        return list(self._keys)

    def _freeze_keys(self, frozen: bool) -> None:
        """Per-key states packed in one array (frozen: a completed bucket's, ~8 bytes a number and nothing for
        the garbage collector to walk) or back to a dict of lists (to be updated again)."""
        self._keys = _PackedKeys(self._keys) if frozen else {key: list(k) for key, k in self._keys.items()}


_K_WIDTH = 6
_SCOPE_KEY_SET = frozenset(SCOPE_KEYS)


def scope_key(key: str) -> str:
    """``key`` if a scope's sums hold it (SCOPE_KEYS); a KeyError otherwise, so that a derivation reading another
    counter per scope fails in the tests instead of reading None (unknown) in production."""
    if key not in _SCOPE_KEY_SET:
        raise KeyError(f"{key}: a scope's sums hold only the counters of store/aggregate.py SCOPE_KEYS")
    return key


class ScopeKeyed:
    """The counter queries of a scope's sums, live (ScopeSums) or packed (store/packed.py PackedScope): only the
    counters of SCOPE_KEYS."""

    __slots__ = ()

    def delta(self, key: str) -> float | None:
        return super().delta(scope_key(key))  # type: ignore[misc]

    def seconds_with(self, key: str) -> float:
        return super().seconds_with(scope_key(key))  # type: ignore[misc]

    def count_with(self, key: str) -> int:
        return super().count_with(scope_key(key))  # type: ignore[misc]

    def keys(self) -> list[str]:
        return [k for k in SCOPE_KEYS if k in self._keys]  # type: ignore[attr-defined]


_KEY_INDEX: dict[tuple[str, ...], dict[str, int]] = {}  # one index per key set, shared by every bucket


class _PackedKeys:
    """A frozen bucket's per-key states, read like the dict of lists they were (get, items, iteration)."""

    __slots__ = ("_index", "_values")

    def __init__(self, keys: dict[str, list]) -> None:
        names = tuple(keys)
        index = _KEY_INDEX.get(names)
        if index is None:
            if len(_KEY_INDEX) > 256:  # key sets seen are few (engines, versions); bound them anyway
                _KEY_INDEX.clear()
            index = _KEY_INDEX[names] = {k: i * _K_WIDTH for i, k in enumerate(names)}
        self._index = index
        self._values = array("d", [x for k in keys.values() for x in k])

    def get(self, key: str):
        i = self._index.get(key)
        if i is None:
            return None
        v = self._values[i:i + _K_WIDTH]
        return (int(v[0]), int(v[1]), v[2], v[3], v[4], v[5])

    def items(self):
        return ((k, self.get(k)) for k in self._index)

    def values(self):
        return (self.get(k) for k in self._index)

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class ScopeSums(ScopeKeyed, _Sums):
    """The sums of one window restricted to its intervals with an energy sample for one scope (of the counters,
    those of SCOPE_KEYS: asking for another is an error, not None)."""

    __slots__ = ("name", "_energy", "idle_n", "_idle", "_idle_energy", "_idle_seconds")
    _only = SCOPE_KEYS

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._energy = [0.0, 0.0]
        self.idle_n = 0
        self._idle = [0.0, 0.0]            # idle joules of the intervals carrying it
        self._idle_energy = [0.0, 0.0]     # energy of those same intervals
        self._idle_seconds = [0.0, 0.0]    # and their seconds

    def _reset_sums(self) -> None:
        super()._reset_sums()
        for a in (self._energy, self._idle, self._idle_energy, self._idle_seconds):
            a[0] = a[1] = 0.0

    def _add_scope(self, iv: Interval, seconds: float, loaded: bool) -> None:
        self._add(iv, seconds, loaded)
        e = iv.energy_joules[self.name]
        _acc(self._energy, 0, e)
        idle = iv.idle_joules.get(self.name)
        if idle is not None:
            self.idle_n += 1
            _acc(self._idle, 0, idle)
            _acc(self._idle_energy, 0, e)
            _acc(self._idle_seconds, 0, seconds)

    def _remove_scope(self, iv: Interval, seconds: float, loaded: bool) -> None:
        self._remove(iv, seconds, loaded)
        if self.n == 0:
            self._energy[0] = self._energy[1] = 0.0
        else:
            _acc(self._energy, 0, -iv.energy_joules[self.name])
        idle = iv.idle_joules.get(self.name)
        if idle is not None:
            self.idle_n -= 1
            if self.idle_n == 0:
                for a in (self._idle, self._idle_energy, self._idle_seconds):
                    a[0] = a[1] = 0.0
            else:
                _acc(self._idle, 0, -idle)
                _acc(self._idle_energy, 0, -iv.energy_joules[self.name])
                _acc(self._idle_seconds, 0, -seconds)

    @property
    def energy_joules(self) -> float:
        return self._energy[0] + self._energy[1]

    @property
    def idle_joules(self) -> float | None:
        """Idle energy over the scope's intervals, or None unless every one of them has it."""
        if self.n == 0 or self.idle_n != self.n:
            return None
        return self._idle[0] + self._idle[1]

    # the intervals carrying both energy and idle energy for the scope (mean power against idle power)
    @property
    def idle_subset_seconds(self) -> float:
        return self._idle_seconds[0] + self._idle_seconds[1]

    @property
    def idle_subset_energy_joules(self) -> float:
        return self._idle_energy[0] + self._idle_energy[1]

    @property
    def idle_subset_idle_joules(self) -> float:
        return self._idle[0] + self._idle[1]


class WindowAggregate(_Sums):
    """Running aggregate over a set of Intervals, oldest first. ``remove`` takes the oldest held interval.

    Alone it holds its intervals in a deque; given the ``store`` of a ServerHistory (whose rows every interval
    added must be appended to first) it holds only their row range (store/columns.py Span) and rebuilds an
    interval when it is read or leaves. The sorted gauge values are ``array('d')`` (8 bytes a value, nothing
    for the garbage collector to walk)."""

    __slots__ = ("intervals", "_scopes", "_sorted", "_removals", "_frozen", "_shadow")

    def __init__(self, intervals: Iterable[Interval] = (), store: IntervalColumns | None = None) -> None:
        super().__init__()
        self.intervals: deque[Interval] | Span = deque() if store is None else Span(store)
        self._scopes: dict[str, ScopeSums] = {}
        self._sorted: dict[str, array] = {k: array("d") for k in ORDERED_GAUGES}
        self._removals = 0
        self._frozen = False
        # the fresh sums being made (module docstring): the shadow has summed every interval added since it
        # started, so it holds the window once its count is the window's (all held at its start have left)
        self._shadow: WindowAggregate | None = None
        for iv in intervals:
            self.add(iv)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[Interval]:
        return iter(self.intervals)

    def __repr__(self) -> str:
        return f"WindowAggregate(n={self.n}, covered_seconds={self.covered_seconds:g})"

    # --- updates -------------------------------------------------------------------------------------------
    def _sum_in(self, iv: Interval) -> None:
        seconds = iv.t1 - iv.t0
        loaded = is_loaded(iv)
        self._add(iv, seconds, loaded)
        for scope in iv.energy_joules:
            sc = self._scopes.get(scope)
            if sc is None:
                sc = self._scopes[scope] = ScopeSums(scope)
            sc._add_scope(iv, seconds, loaded)

    def freeze(self) -> None:
        """A completed grid bucket: its sums no longer change (a late interval thaws them, store/buckets.py),
        so their per-key states become tuples the garbage collector untracks (an hour of buckets is otherwise
        ~10^5 lists walked by every full collection)."""
        if not self._frozen:
            self._frozen = True
            self._freeze_keys(True)
            for sc in self._scopes.values():
                sc._freeze_keys(True)

    def _thaw(self) -> None:
        self._frozen = False
        self._freeze_keys(False)
        for sc in self._scopes.values():
            sc._freeze_keys(False)

    def add(self, iv: Interval) -> None:
        if self._frozen:
            self._thaw()
        self.intervals.append(iv)
        self._sum_in(iv)
        if self._shadow is not None:
            self._shadow._sum_in(iv)
        for key, v in ordered_gauge_values(iv):
            insort(self._sorted.setdefault(key, array("d")), v)

    def remove(self, iv: Interval | None = None) -> Interval:
        """Take the oldest interval out (``iv``, when given, must be that interval: the same object for a
        deque, an equal one for a store's rows)."""
        if self._frozen:
            self._thaw()
        q = self.intervals
        head = q[0]
        if iv is not None and iv is not head and (type(q) is deque or iv != head):
            raise ValueError("WindowAggregate.remove takes the oldest interval it holds")
        q.popleft()
        seconds = head.t1 - head.t0
        loaded = is_loaded(head)
        self._remove(head, seconds, loaded)
        for scope in head.energy_joules:
            sc = self._scopes[scope]
            sc._remove_scope(head, seconds, loaded)
        for key, v in ordered_gauge_values(head):
            s = self._sorted[key]
            del s[bisect_left(s, v)]
            if not s and key.startswith(POOL_PREFIX):
                del self._sorted[key]  # a pool no interval holds any more: gone
        self._removals += 1
        if self._shadow is None and self._removals >= max(self.n, RESUM_MIN_REMOVALS):
            self._shadow = WindowAggregate()
        if self._shadow is not None and self._shadow.n == self.n:
            self._adopt(self._shadow)
        return head

    def _adopt(self, fresh: "WindowAggregate") -> None:
        """The shadow's sums, made from zero over exactly the intervals held now, replace the running ones."""
        self.n, self._cov, self._loaded, self._keys, self._scopes = \
            fresh.n, fresh._cov, fresh._loaded, fresh._keys, fresh._scopes
        self._shadow, self._removals = None, 0

    def amend(self, old: Interval, new: Interval) -> None:
        """A held interval's counter deltas changed (``old`` -> ``new``, same times, gauges and energy): the
        counter sums follow (a step voided after the fact, store/identity.py)."""
        frozen = self._frozen
        if frozen:
            self._thaw()
        self._shadow = None  # it may hold ``old`` as it was: made again from the next removal on
        seconds = old.t1 - old.t0
        for sums in (self, *(self._scopes[s] for s in old.energy_joules)):
            _Sums._remove(sums, old, seconds, is_loaded(old))
            _Sums._add(sums, new, seconds, is_loaded(new))
        if frozen:
            self.freeze()

    def resum(self) -> None:
        """Recompute every running sum from the held intervals (bounds add/subtract drift). O(n)."""
        self._removals, self._shadow = 0, None
        self._frozen = False
        self.n = 0
        self._keys = {}
        self._reset_sums()
        self._scopes = {}
        for iv in self.intervals:
            self._sum_in(iv)

    # --- queries -------------------------------------------------------------------------------------------
    def scope(self, name: str) -> ScopeSums | None:
        """Sums over the intervals carrying an energy sample for ``name`` ("gpu", "host"); None without any."""
        sc = self._scopes.get(name)
        return sc if sc is not None and sc.n > 0 else None

    def sorted_gauge(self, key: str) -> "list[float] | array":
        """The gauge's values in ascending order (do not modify)."""
        s = self._sorted.get(key)
        if s is not None:
            return s
        q = self.intervals
        if type(q) is Span:  # straight from the column, no interval rebuilt
            return sorted(q.store.gauge_values(key, q.lo, q.hi))
        return sorted(gauge_values(q, key))

    def quantile(self, gauge_key: str, q: float) -> float | None:
        """exporter.rules.quantile.quantile over the gauge's values (PromQL quantile_over_time)."""
        return interpolate_sorted(self.sorted_gauge(gauge_key), q)

    def pools(self) -> list[str]:
        """The KV pools (their ``kv_pool_usage@<pool>`` keys) some held interval carries."""
        return sorted(k for k in self._sorted if k.startswith(POOL_PREFIX))

    def gauge_min(self, key: str) -> float | None:
        s = self.sorted_gauge(key)
        return s[0] if s else None

    def gauge_max(self, key: str) -> float | None:
        s = self.sorted_gauge(key)
        return s[-1] if s else None

    def gauge_count(self, key: str) -> int:
        return len(self.sorted_gauge(key))


def aggregate_of(intervals: Iterable[Interval]) -> WindowAggregate:
    """A fresh aggregate over ``intervals`` (oldest first)."""
    return WindowAggregate(intervals)
