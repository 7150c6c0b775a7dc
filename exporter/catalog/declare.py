"""What a catalog declaration is made of (MetricDef and its parts) and the fills every section shares.

``computes`` names the formula as a dotted path under ``exporter.`` -- a string, so that importing the catalog
(and through it serve/) imports no computation: only tests and docs tooling resolve it (``formula``). A figure
with several kinds (dE's baselines) lists each kind's formula; a figure with no formula in exporter/derive/
says what it is instead (``NotDerived``: a source's reading, an info series, a setting, ...) and why.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from exporter.catalog import bounds
from exporter.figures import ServerFigures, Snapshot, WindowFigures

Sample = tuple[tuple[str, ...], "float | bool | None"]
Fill = Callable[[Snapshot], Iterable[Sample]]

WINDOW, SERVER = "window", "server"  # scopes of /api/status: servers[].windows.<label>, servers[]


@dataclass(frozen=True)
class StatusKey:
    """Where a figure appears in /api/status: ``key`` in the dict of its scope (WINDOW or SERVER). ``value`` reads
    it from the figures (WindowFigures or ServerFigures) for the JSON and, unless the declaration has a fill of its
    own, for the series; ``json`` when the JSON writes it differently (rounded)."""

    scope: str
    key: str
    value: Callable[[object], object]
    json: Callable[[object], object] | None = None

    def json_value(self, fig) -> object:
        return (self.json or self.value)(fig)


def window_key(key: str, value: Callable[[WindowFigures], object], json=None) -> StatusKey:
    return StatusKey(WINDOW, key, value, json)


def server_key(key: str, value: Callable[[ServerFigures], object], json=None) -> StatusKey:
    return StatusKey(SERVER, key, value, json)


@dataclass(frozen=True, kw_only=True)
class Block:
    """A structured part of a server's or a window's /api/status dict that is not one figure (energy by scope,
    savings by baseline, the threshold's evidence, ...), declared in the section it belongs to: its scope (WINDOW
    or SERVER), the keys it writes (one nested key, or a few flat ones), the names of the declarations it
    serialises (any section's: the catalog checks each at import), and its small serialiser, which returns those
    keys, or {} to leave them out."""

    scope: str
    keys: tuple[str, ...]
    serialises: tuple[str, ...]
    write: Callable[[object], dict]


def window_block(keys: tuple[str, ...], serialises: tuple[str, ...], write: Callable[[WindowFigures], dict]) -> Block:
    return Block(scope=WINDOW, keys=keys, serialises=serialises, write=write)


def server_block(keys: tuple[str, ...], serialises: tuple[str, ...], write: Callable[[ServerFigures], dict]) -> Block:
    return Block(scope=SERVER, keys=keys, serialises=serialises, write=write)


@dataclass(frozen=True)
class Elsewhere:
    """A series with no key among /api/status's per-server and per-window figures, and why."""

    why: str


@dataclass(frozen=True)
class Words:
    """A row of the landing page's table of figures per window: its label, the unit it is formatted in (one of
    exporter.serve.page.FORMATS) and, when the figure's JSON value is a dict, the path to the value shown
    (default: the figure's own key)."""

    label: str
    unit: str
    path: tuple[str, ...] = ()
    absent_when_none: bool = False  # no row when no window has it (a figure the server cannot have, not unknown)


# --- what `computes` holds where the figure has no formula in exporter/derive/ -----------------------------
@dataclass(frozen=True)
class NotDerived:
    """A figure not computed by a formula in exporter/derive/: ``where`` (dotted, under exporter.) produces it,
    ``kind`` names the exception (one of NOT_DERIVED) and ``why`` says why it has no formula."""

    kind: str
    where: str
    why: str


NOT_DERIVED = {
    "reading": "a source's reading, exported as the source reports it: no formula",
    "info": "an info series: its labels describe something, its value is 1",
    "setting": "a configured value, used as given",
    "learned": "learned across windows and kept as state (model/ or the state books), not a per-window formula",
    "judged": "a verdict or choice that weighs derive/'s figures with settings or history, decided in model/",
    "bookkeeping": "a count or age kvwatt keeps about its own work, not a figure of the server",
}


def _not_derived(kind: str):
    def make(where: str, why: str = "") -> NotDerived:
        return NotDerived(kind, where, why or NOT_DERIVED[kind])
    make.__name__ = kind
    return make


reading, info, setting, learned, judged, bookkeeping = map(_not_derived, NOT_DERIVED)

Computes = "str | tuple[str, ...] | NotDerived"


def formula(where: str):
    """The object a dotted ``where`` names under exporter. (a function, a method, a property's getter), imported
    now: for tests and docs tooling only, never at serve time."""
    parts = where.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module("exporter." + ".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            owner = getattr(owner, name)
        return owner.fget if isinstance(owner, property) else owner
    raise ImportError(f"{where}: no module under exporter.")


@dataclass(frozen=True, kw_only=True)
class MetricDef:
    """One family: its series (name, type, labels, help), its formula (``computes``), its README section, how its
    samples are filled, where it is in /api/status, how the page words it and what values it may take."""

    name: str
    type: str  # "gauge" | "counter" | "info"
    labels: tuple[str, ...]
    help: str
    computes: str | tuple[str, ...] | NotDerived  # the formula (each kind's), or why there is none in derive/
    section: str
    fill: Fill | None = None  # None: derived from status.value (one sample per window or server, or per dict key)
    # where the figure is in /api/status; None: a block of exporter.serve.web names it (the test checks that)
    status: StatusKey | Elsewhere | None = None
    words: tuple[Words, ...] = ()  # rows of the page's table of figures per window
    # what physics and arithmetic allow its values (exporter/catalog/bounds.py); checked once per tick before serving
    bounds: "bounds.Bound | None" = None
    # the family that replaces this one (kube-state-metrics marks deprecated families in the declaration): still
    # served for one release, its HELP says so first (deprecation_help)
    deprecated: str | None = None

    def __post_init__(self):
        if self.deprecated is not None and not self.help.startswith(deprecation_help(self.deprecated)):
            raise ValueError(f"{self.name}: a deprecated family's HELP begins {deprecation_help(self.deprecated)!r}")
        if self.fill is None:
            if not isinstance(self.status, StatusKey):
                raise ValueError(f"{self.name}: no fill and no status key to derive it from")
            object.__setattr__(self, "fill", _fill_from(self.status, len(self.labels)))

    @property
    def wheres(self) -> tuple[str, ...]:
        """The dotted paths under exporter. of ``computes``: each kind's formula, or the NotDerived's producer."""
        c = self.computes
        return (c.where,) if isinstance(c, NotDerived) else (c,) if isinstance(c, str) else tuple(c)

    @property
    def where(self) -> str:
        """``wheres`` as one string (the README's "computed in" column)."""
        return ", ".join(self.wheres)


@dataclass(frozen=True, kw_only=True)
class Section:
    """One idea's figures (a README heading, a run of /metrics, of the page's rows and of /api/status's keys):
    its declarations in exposition order, each saying ``section=name``, and the JSON blocks of the figures that
    are not one key each. ``exporter.catalog.SECTIONS`` lists the sections in their declared order."""

    name: str
    metrics: tuple[MetricDef, ...]
    blocks: tuple[Block, ...] = ()

    def __post_init__(self):
        strays = [m.name for m in self.metrics if m.section != self.name]
        if strays:
            raise ValueError(f"section {self.name!r} holds declarations of another section: {strays}")


def deprecation_help(replacement: str) -> str:
    """The first words of a deprecated family's HELP."""
    return f"Deprecated: use {replacement}; removed in the next release."


# --- fills shared by every section: walk the snapshot ------------------------------------------------------
def flag(v: bool | None) -> float | None:
    """A boolean as a series value: 1/0, None (unknown) left out."""
    return None if v is None else (1.0 if v else 0.0)


def series_value(v):
    return flag(v) if isinstance(v, bool) else v


def per_server(get: Callable[[ServerFigures], "float | bool | None"]) -> Fill:
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            yield (s.name,), series_value(get(s))
    return fill


def per_window(get: Callable[[WindowFigures], "float | bool | None"]) -> Fill:
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            for w in s.windows:
                yield (s.name, w.window), series_value(get(w))
    return fill


def per_server_key(get: Callable[[ServerFigures], "dict | None"]) -> Fill:
    """A dict-valued server figure: one sample per key (the second label)."""
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            for key, value in (get(s) or {}).items():
                yield (s.name, key), series_value(value)
    return fill


def per_window_key(get: Callable[[WindowFigures], "dict | None"]) -> Fill:
    """A dict-valued window figure: one sample per key (the label between server and window)."""
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            for w in s.windows:
                for key, value in (get(w) or {}).items():
                    yield (s.name, key, w.window), value
    return fill


def _fill_from(status: StatusKey, n_labels: int) -> Fill:
    plain, keyed = (per_window, per_window_key) if status.scope == WINDOW else (per_server, per_server_key)
    one = 2 if status.scope == WINDOW else 1  # labels of a one-value figure: (server, window) or (server,)
    return plain(status.value) if n_labels == one else keyed(status.value)
