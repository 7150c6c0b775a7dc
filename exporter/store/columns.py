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
Columns are chunks of CHUNK rows: appending and dropping rows are O(1) (a chunk is freed once all its rows
are dropped), and the dead or not yet written part of the chunks never exceeds 2 * CHUNK rows.

A full chunk whose values are all one value (a counter that did not move: preemptions, failed transfers, the
histogram buckets of a quiet engine; a constant gauge; a key absent from every row) is replaced by one shared,
read-only chunk of that value (``_sealed``): two thirds of a server's full chunks in bench/soak.py's load, ~0.85 MiB
of its ~2.3 MiB hour at a 1 s interval (issue 39: the 64-server node's memory). The values read are the same
bytes; the one write into an old row (``void_deltas``) copies a shared chunk first.
"""

from __future__ import annotations

import math
import sys
from array import array
from typing import Iterable, Iterator

from exporter.samples import Interval

NAN = math.nan
CHUNK = 512  # rows a chunk (4 KiB a column)
_NAN_CHUNK = array("d", [NAN]) * CHUNK
_SECTIONS = 4  # deltas, gauges, energy_joules, idle_joules
_SHARED: dict[bytes, array] = {}  # a value's 8 bytes -> the shared chunk of it (never freed, never written)
_SHARED_IDS: set[int] = set()  # their ids: ``is shared`` by identity
_SHARED_MAX = 256  # distinct shared values (1 MiB at most); past it a constant chunk stays its own
_NAN_SHARED = _NAN_CHUNK[:]  # absent throughout: shared from the start, whatever the table holds
_SHARED[_NAN_SHARED[:1].tobytes()] = _NAN_SHARED
_SHARED_IDS.add(id(_NAN_SHARED))


def _maps(iv: Interval) -> tuple[dict, dict, dict, dict]:
    return iv.deltas, iv.gauges, iv.energy_joules, iv.idle_joules


class IntervalColumns:
    """Rows [first, end) of one server's intervals, oldest first, in chunks of CHUNK rows: every column is a
    list of preallocated ``array('d')`` chunks (NaN until written), so appending never reallocates a large
    block and dropping the oldest rows frees whole chunks (no memmove, same-sized blocks the allocator reuses:
    one-off large reallocations fragmented the heap by ~10 MB at the plateau)."""

    __slots__ = ("_t0", "_t1", "_cols", "_last", "_base", "_n", "first", "_odd", "newest")

    def __init__(self) -> None:
        self._t0: list[array] = []
        self._t1: list[array] = []
        self._cols: tuple[dict[str, list[array]], ...] = tuple({} for _ in range(_SECTIONS))  # key -> chunks
        self._last: tuple[dict[str, int], ...] = tuple({} for _ in range(_SECTIONS))  # key -> last row with it
        self._base = 0          # absolute index of the first position of the first chunk
        self._n = 0             # positions written from _base on
        self.first = 0          # absolute index of the oldest row held
        self._odd: dict[int, Interval] = {}  # rows holding a NaN value of their own: the object itself
        self.newest: Interval | None = None  # the last appended interval, as given (the per-tick reader's)

    @property
    def end(self) -> int:
        """Absolute index after the newest row."""
        return self._base + self._n

    def __len__(self) -> int:
        return self._base + self._n - self.first

    def append(self, iv: Interval) -> int:
        """Store ``iv`` as the newest row; returns its absolute index."""
        c, j = divmod(self._n, CHUNK)
        if j == 0:  # a new chunk for every column; the previous one is full: shared if constant
            self._t0.append(_chunk())
            self._t1.append(_chunk())
            for cols in self._cols:
                for chunks in cols.values():
                    if c:
                        chunks[c - 1] = _sealed(chunks[c - 1])
                    chunks.append(_chunk())
        index = self._base + self._n
        self._t0[c][j] = iv.t0
        self._t1[c][j] = iv.t1
        odd = False
        for cols, last, values in zip(self._cols, self._last, _maps(iv)):
            for key, v in values.items():
                chunks = cols.get(key)
                if chunks is None:
                    key = sys.intern(key)
                    chunks = cols[key] = [_NAN_SHARED] * c + [_chunk()]  # absent before: NaN
                chunks[c][j] = v
                last[key] = index
                odd = odd or v != v
        self._n += 1
        if odd:
            self._odd[index] = iv
        self.newest = iv
        return index

    def popleft(self) -> None:
        """Drop the oldest row (its chunk goes once every row of it is dropped)."""
        self._odd.pop(self.first, None)
        self.first += 1
        if self.first - self._base >= CHUNK:
            del self._t0[0], self._t1[0]
            for cols, last in zip(self._cols, self._last):
                for key in list(cols):
                    if last[key] < self.first:  # no row held carries it any more
                        del cols[key], last[key]
                    else:
                        del cols[key][0]
            self._base += CHUNK
            self._n -= CHUNK

    def void_deltas(self, i: int) -> Interval:
        """Row ``i`` without its counter deltas (a step found to count another process's counters,
        store/identity.py); returns the row as it is now."""
        iv = self.interval(i)
        voided = Interval(t0=iv.t0, t1=iv.t1, deltas={}, gauges=iv.gauges, energy_joules=iv.energy_joules,
                          idle_joules=iv.idle_joules)
        c, j = divmod(i - self._base, CHUNK)
        for chunks in self._cols[0].values():
            if id(chunks[c]) in _SHARED_IDS:
                chunks[c] = chunks[c][:]  # its own copy: a shared chunk is never written
            chunks[c][j] = NAN
        if i in self._odd:
            self._odd[i] = voided
        if i == self.end - 1:
            self.newest = voided
        return voided

    def t0(self, i: int) -> float:
        c, j = divmod(i - self._base, CHUNK)
        return self._t0[c][j]

    def t1(self, i: int) -> float:
        c, j = divmod(i - self._base, CHUNK)
        return self._t1[c][j]

    def interval(self, i: int) -> Interval:
        """The interval at absolute index ``i``, rebuilt (equal to the one appended, not the same object)."""
        if not self.first <= i < self.end:
            raise IndexError(i)
        if i == self.end - 1 and self.newest is not None:
            return self.newest
        odd = self._odd.get(i)
        if odd is not None:
            return odd
        c, j = divmod(i - self._base, CHUNK)
        d, g, e, idle = ({k: v for k, chunks in cols.items() if (v := chunks[c][j]) == v} for cols in self._cols)
        return Interval(t0=self._t0[c][j], t1=self._t1[c][j], deltas=d, gauges=g, energy_joules=e, idle_joules=idle)

    def first_index_from(self, t0: float) -> int:
        """The absolute index of the oldest row with t0 >= ``t0`` (rows are in time order)."""
        lo, hi = self.first, self.end
        while lo < hi:
            mid = (lo + hi) // 2
            if self.t0(mid) < t0:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _values(self, chunks: list[array], lo: int, hi: int) -> list[float]:
        """Positions [lo, hi) (absolute) of one column, NaN included."""
        out: list[float] = []
        a, b = lo - self._base, hi - self._base
        while a < b:
            c, j = divmod(a, CHUNK)
            k = min(CHUNK, j + b - a)
            out.extend(chunks[c][j:k])
            a += k - j
        return out

    def gauge_values(self, key: str, lo: int, hi: int) -> list[float]:
        """The gauge's values in rows [lo, hi) that carry it, in time order (aggregate.gauge_values' rule)."""
        lo, hi = max(lo, self.first), min(hi, self.end)
        if lo >= hi:
            return []
        if self._odd:  # a row with a NaN of its own: read the rows themselves
            return gauge_values(list(self.rows(lo, hi)), key)
        g = self._cols[1]
        if key == "pending":
            r, w = g.get("running"), g.get("waiting")
            if r is None or w is None:
                return []
            return [x + y for x, y in zip(self._values(r, lo, hi), self._values(w, lo, hi)) if x == x and y == y]
        col = g.get(key)
        return [] if col is None else [x for x in self._values(col, lo, hi) if x == x]

    def rows(self, lo: int, hi: int) -> Iterator[Interval]:
        for i in range(max(lo, self.first), min(hi, self.end)):
            yield self.interval(i)


def _chunk() -> array:
    return _NAN_CHUNK[:]


def _sealed(chunk: array) -> array:
    """A full chunk, or the shared chunk of its one value when every row holds the same bytes (NaN included)."""
    one = chunk[:1].tobytes()
    if id(chunk) in _SHARED_IDS or chunk.tobytes() != one * CHUNK:
        return chunk
    shared = _SHARED.get(one)
    if shared is None:
        if len(_SHARED) >= _SHARED_MAX:
            return chunk
        shared = _SHARED[one] = chunk[:1] * CHUNK
        _SHARED_IDS.add(id(shared))
    return shared


def gauge_values(x: Iterable[Interval], key: str) -> list[float]:
    """The gauge's values in time order over intervals (an aggregate iterates its held ones: O(n))."""
    if key == "pending":
        return [iv.gauges["running"] + iv.gauges["waiting"] for iv in x
                if "running" in iv.gauges and "waiting" in iv.gauges]
    return [iv.gauges[key] for iv in x if key in iv.gauges]


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
