"""The one fixed-grid bucket rule (docs/architecture.md "Windows").

Buckets are [k*W, (k+1)*W) of the shared monotonic clock, anchored at 0, so two servers read by the same
daemon tick have the same buckets. An interval belongs to the bucket its end falls in:
k = floor((t1 - 1e-9) / W), i.e. t1 in (k*W, (k+1)*W]. A bucket is complete once ``now`` reaches its end.
Used by the dE/dTPS repeat windows (methods.md s2), the collapse reference (s5) and the KV-pressure
evidence windows (s10): ServerHistory keeps one ``Grid`` per registered width; ``buckets_of`` cuts the same
buckets from a list once (a recorded run, an unregistered width).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Iterable

from exporter.samples import Interval
from exporter.store.aggregate import WindowAggregate
from exporter.store.columns import IntervalColumns
from exporter.store.packed import PackedAggregate, pack, unpack

EPS = 1e-9  # clock slack: a tick landing on a bucket's edge belongs to the bucket it ends


class Bucket:
    """One fixed-grid window [t0, t1) of the shared monotonic clock (t0 = k * width) and the aggregate of
    the intervals that ended in it: read-only once completed (a grid with a store keeps it packed,
    store/packed.py: two objects a bucket, not ~22; only the grid itself thaws it)."""

    __slots__ = ("t0", "t1", "agg")

    def __init__(self, t0: float, t1: float, agg: "WindowAggregate | PackedAggregate") -> None:
        self.t0, self.t1, self.agg = t0, t1, agg

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Bucket):
            return NotImplemented
        return (self.t0, self.t1, self.agg) == (other.t0, other.t1, other.agg)

    __hash__ = None  # type: ignore[assignment]  (mutable: the grid thaws and repacks its aggregate)

    def __repr__(self) -> str:
        return f"Bucket(t0={self.t0!r}, t1={self.t1!r}, agg={self.agg!r})"

    def live(self) -> WindowAggregate:
        """The bucket's aggregate as a live WindowAggregate (unpacked in place when packed)."""
        if type(self.agg) is PackedAggregate:
            self.agg = unpack(self.agg)
        return self.agg


def bucket_index(t1: float, width: float) -> int:
    """The bucket k an interval ending at ``t1`` belongs to: t1 in (k*W, (k+1)*W]."""
    return math.floor((t1 - EPS) / width)


class Grid:
    """Buckets of one width: the ones still open (intervals may still arrive) and the completed ones. With the
    ``store`` of a ServerHistory (every interval added is its newest row), a bucket holds its intervals' row
    range, not the intervals (store/columns.py)."""

    def __init__(self, width: float, store: IntervalColumns | None = None) -> None:
        self.width = width
        self.store = store
        self.open: dict[int, WindowAggregate] = {}
        self.done: deque[Bucket] = deque()
        self.reorders = 0  # buckets completed out of time order (a reader that keeps what it saw starts again)

    def add(self, iv: Interval) -> None:
        k = bucket_index(iv.t1, self.width)
        agg = self.open.get(k)
        if agg is None:
            for b in reversed(self.done):  # a late interval for a bucket already closed (rare): join it
                if abs(b.t0 - k * self.width) < EPS:
                    b.live().add(iv)
                    if self.store is not None:
                        self._seal(b)  # packed again (a storeless bucket stays thawed: it is rare and small)
                    return
                if b.t0 < k * self.width:
                    break
            agg = self.open[k] = WindowAggregate(store=self.store)
        agg.add(iv)

    def holding(self, iv: Interval) -> WindowAggregate | None:
        """The bucket (open or completed) ``iv`` was added to."""
        k = bucket_index(iv.t1, self.width)
        agg = self.open.get(k)
        if agg is not None:
            return agg
        for b in reversed(self.done):
            if abs(b.t0 - k * self.width) < EPS:
                return b.live()  # to be amended (history._void): left live, a rare event
            if b.t0 < k * self.width:
                break
        return None

    def close(self, now: float) -> None:
        """Complete every open bucket that ends by ``now``."""
        if not self.open:
            return
        for k in sorted(self.open):
            t0, t1 = k * self.width, (k + 1) * self.width
            if t1 > now + EPS:
                break
            b = Bucket(t0, t1, self.open.pop(k))
            self._seal(b)
            if self.done and self.done[-1].t0 > t0:  # out of order (late interval): keep time order
                self.done = deque(sorted([*self.done, b], key=lambda x: x.t0))
                self.reorders += 1
            else:
                self.done.append(b)

    def _seal(self, b: Bucket) -> None:
        """A completed bucket no longer changes: packed (store/packed.py) when its rows are a store's, else its
        sums frozen (a list of intervals: tests, a recorded run)."""
        if self.store is not None:
            b.agg = pack(b.agg)
        else:
            b.agg.freeze()

    def trim(self, oldest_t1: float) -> None:
        while self.done and self.done[0].t1 < oldest_t1:
            self.done.popleft()

    def completed(self, start: float, end: float) -> list[Bucket]:
        """Completed buckets lying wholly inside [start, end], in time order."""
        out = []
        for b in reversed(self.done):
            if b.t1 < start:
                break
            if b.t0 >= start - EPS and b.t1 <= end + EPS:
                out.append(b)
        out.reverse()
        return out


def buckets_of(intervals: Iterable[Interval], width: float, start: float = -math.inf,
               end: float = math.inf) -> list[Bucket]:
    """The grid's buckets over ``intervals`` (oldest first) lying wholly inside [start, end]; a bucket no
    interval ended in is missing, not empty. O(len(intervals))."""
    grid = Grid(float(width))
    for iv in intervals:
        grid.add(iv)
    grid.close(end)
    return grid.completed(start, end)
