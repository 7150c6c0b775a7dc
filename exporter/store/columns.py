"""Compact storage of one server's intervals: columns of doubles instead of an object per interval
(docs/architecture.md "Windows").

An hour at a 0.25 s interval is 14,400 intervals per server; as ``Interval`` objects (four dicts each) that was
~2.8 KB and five garbage-collector-tracked objects per interval. Here an interval is one row: its t0 and t1,
and one ``array('d')`` column per key of each of its four maps (counter deltas, gauges, energy, idle energy;
keys interned, a key absent from a row is NaN), ~8 bytes per value and nothing the collector walks.

Rows have absolute indices (0 for the first row ever appended): the history, its window aggregates and its grid
buckets name the rows they hold by index range (``Span``) and an ``Interval`` is rebuilt on demand
(``interval(i)``). A row whose values include a NaN of its own (sources refuse non-finite values, but a
test or a replay may carry one) is kept as its original object instead, so absence and NaN never mix.
Dropping rows from the head is amortized O(1): the dropped prefix is cut out of the columns once it is a
sixteenth of them (at least CUT_MIN_ROWS), so the dead prefix never costs more than ~6% of the memory.
"""

from __future__ import annotations

import math
import sys
from array import array
from typing import Iterator

from exporter.samples import Interval

NAN = math.nan
CUT_MIN_ROWS = 64
_SECTIONS = 4  # deltas, gauges, energy_joules, idle_joules


def _maps(iv: Interval) -> tuple[dict, dict, dict, dict]:
    return iv.deltas, iv.gauges, iv.energy_joules, iv.idle_joules


class IntervalColumns:
    """Rows [first, end) of one server's intervals, oldest first."""

    __slots__ = ("_t0", "_t1", "_cols", "_cut", "first", "_odd", "newest")

    def __init__(self) -> None:
        self._t0, self._t1 = array("d"), array("d")
        self._cols: tuple[dict[str, array], ...] = tuple({} for _ in range(_SECTIONS))  # key -> column
        self._cut = 0           # rows dropped but still in the arrays (cut out once they are half of them)
        self.first = 0          # absolute index of the oldest row held
        self._odd: dict[int, Interval] = {}  # rows holding a NaN value of their own: the object itself
        self.newest: Interval | None = None  # the last appended interval, as given (the per-tick reader's)

    @property
    def end(self) -> int:
        """Absolute index after the newest row."""
        return self.first + len(self._t0) - self._cut

    def __len__(self) -> int:
        return len(self._t0) - self._cut

    def append(self, iv: Interval) -> int:
        """Store ``iv`` as the newest row; returns its absolute index."""
        n = len(self._t0)  # rows in the arrays before this one
        self._t0.append(iv.t0)
        self._t1.append(iv.t1)
        odd = False
        for cols, values in zip(self._cols, _maps(iv)):
            for key, v in values.items():
                col = cols.get(key)
                if col is None:
                    col = cols[sys.intern(key)] = array("d", [NAN]) * n
                col.append(v)
                odd = odd or v != v
            for key, col in cols.items():
                if len(col) == n:  # absent from this row
                    col.append(NAN)
        index = self.end - 1
        if odd:
            self._odd[index] = iv
        self.newest = iv
        return index

    def popleft(self) -> None:
        """Drop the oldest row."""
        self._odd.pop(self.first, None)
        self.first += 1
        self._cut += 1
        if self._cut >= max(CUT_MIN_ROWS, len(self._t0) >> 4):
            self._compact()

    def _compact(self) -> None:
        cut = self._cut
        del self._t0[:cut], self._t1[:cut]
        for cols in self._cols:
            for key in list(cols):
                col = cols[key]
                del col[:cut]
                if all(v != v for v in col):  # no row held carries it any more
                    del cols[key]
        self._cut = 0
        if not self._t0:
            self.newest = None

    def t0(self, i: int) -> float:
        return self._t0[i - self.first + self._cut]

    def t1(self, i: int) -> float:
        return self._t1[i - self.first + self._cut]

    def interval(self, i: int) -> Interval:
        """The interval at absolute index ``i``, rebuilt (equal to the one appended, not the same object)."""
        if not self.first <= i < self.end:
            raise IndexError(i)
        if i == self.end - 1 and self.newest is not None:
            return self.newest
        odd = self._odd.get(i)
        if odd is not None:
            return odd
        j = i - self.first + self._cut
        d, g, e, idle = ({k: v for k, col in cols.items() if (v := col[j]) == v} for cols in self._cols)
        return Interval(self._t0[j], self._t1[j], d, g, e, idle)

    def first_index_from(self, t0: float) -> int:
        """The absolute index of the oldest row with t0 >= ``t0`` (rows are in time order)."""
        a, lo, hi = self._t0, self._cut, len(self._t0)
        while lo < hi:
            mid = (lo + hi) // 2
            if a[mid] < t0:
                lo = mid + 1
            else:
                hi = mid
        return lo - self._cut + self.first

    def gauge_values(self, key: str, lo: int, hi: int) -> list[float]:
        """The gauge's values in rows [lo, hi) that carry it, in time order (aggregate.gauge_values' rule)."""
        lo, hi = max(lo, self.first), min(hi, self.end)
        if lo >= hi:
            return []
        if self._odd:  # a row with a NaN of its own: read the rows themselves
            from exporter.store.aggregate import gauge_values
            return gauge_values(list(self.rows(lo, hi)), key)
        a, b = lo - self.first + self._cut, hi - self.first + self._cut
        g = self._cols[1]
        if key == "pending":
            r, w = g.get("running"), g.get("waiting")
            if r is None or w is None:
                return []
            return [x + y for x, y in zip(r[a:b], w[a:b]) if x == x and y == y]
        col = g.get(key)
        return [] if col is None else [x for x in col[a:b] if x == x]

    def rows(self, lo: int, hi: int) -> Iterator[Interval]:
        for i in range(max(lo, self.first), min(hi, self.end)):
            yield self.interval(i)


class Span:
    """The rows [lo, hi) of an IntervalColumns that a window aggregate or a grid bucket holds, read as a
    sequence of Intervals (rebuilt on demand). Rows the columns have already dropped (an old bucket's) are
    skipped: what remains readable is what the history still keeps."""

    __slots__ = ("store", "lo", "hi")

    def __init__(self, store: IntervalColumns) -> None:
        self.store = store
        self.lo = self.hi = store.end

    def append(self, iv: Interval) -> None:
        """``iv`` is the store's newest row (appended just before)."""
        end = self.store.end
        if self.lo == self.hi:
            self.lo = end - 1
        self.hi = end

    def popleft(self) -> None:
        """Let the oldest row go (read it first through [0]: this does not rebuild it)."""
        if self.lo >= self.hi:
            raise IndexError("pop from an empty span")
        self.lo += 1

    def __len__(self) -> int:
        return self.hi - max(self.lo, self.store.first) if self.hi > self.store.first else 0

    def __bool__(self) -> bool:
        return self.hi > self.lo

    def __getitem__(self, k: int) -> Interval:
        n = len(self)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(k)
        return self.store.interval(max(self.lo, self.store.first) + k)

    def __iter__(self) -> Iterator[Interval]:
        return self.store.rows(self.lo, self.hi)

    def __repr__(self) -> str:
        return f"Span({self.lo}, {self.hi})"


class Rows:
    """Every row an IntervalColumns holds, read as a sequence of Intervals (ServerHistory.intervals): len, index
    (negative too), iteration; each read rebuilds the interval (the newest is the object appended)."""

    __slots__ = ("store", "maxlen")

    def __init__(self, store: IntervalColumns, maxlen: int | None) -> None:
        self.store, self.maxlen = store, maxlen

    def __len__(self) -> int:
        return len(self.store)

    def __bool__(self) -> bool:
        return len(self.store) > 0

    def __getitem__(self, k: int) -> Interval:
        n = len(self.store)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(k)
        return self.store.interval(self.store.first + k)

    def __iter__(self) -> Iterator[Interval]:
        return self.store.rows(self.store.first, self.store.end)

    def __repr__(self) -> str:
        return f"Rows({len(self)} intervals)"
