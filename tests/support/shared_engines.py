"""The plan of the shared engines (tests/support/engine.py's EnginePool), from the tests' markers:

    pytestmark = [pytest.mark.engine, pytest.mark.shares_engine(blocks=2000)]     # engines.get(blocks=2000)
    @pytest.mark.shares_engine(blocks=128, flags=KV_CACHE_METRICS)                 # one marker per shape used
    @pytest.mark.takes_engine(blocks=128)                                          # engines.take(blocks=128)

At collection the engine tests' modules are ordered so that the users of one shape run one after the other
(a module stays whole: its module fixtures are set up once), a module that takes a shape's engine after the
others that share it; after each test, the engine of a shape no test still declares is stopped. So each shape
starts once and at most a few idle engines (2 GB each) are held. A test that calls ``engines.get()`` for a shape
it did not declare still works: that engine is kept until the session ends.

Shards (scripts/run_tiers.py runs the engine tier as two pytest processes side by side, one core each, then the
modules that need both cores alone): ``--engine-shard K/N`` keeps the engine modules of shard K, ``--engine-shard
solo`` those marked ``owns_cores`` (they start engines on both cores). Whole modules are dealt, longest first,
to the shard with the least work, counting an engine start for each shape the shard has not started yet,
improved by moves and swaps, and for two shards searched for the best deal (shard_modules); a module's work is the
seconds it took in a measured run less the shared engines it started, and
each shape's start its own measured seconds (tests/engine-seconds.json, ``run_tiers.py all --store-engine-seconds``
rewrites it; a module not in it counts DEFAULT_SECONDS, a shape START_SECONDS).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

_PLAN = pytest.StashKey[Counter]()
SECONDS_FILE = Path(__file__).resolve().parents[1] / "engine-seconds.json"
DEFAULT_SECONDS = 60.0  # a module the seconds file does not know yet: about one engine start and a short load
SOLO = "solo"
SHARD_WORK: list[tuple] = []  # (k, n, this shard's work, every shard's work) once dealt: the session summary says it
START_SECONDS = 40.0  # one engine start beside another shard (measured 27-51 s): a shape not measured yet


def shape_key(blocks: int, max_model_len: int = 2048, flags=()) -> tuple:
    return int(blocks), int(max_model_len), tuple(flags)


def shapes_of(item: pytest.Item) -> tuple[list[tuple], list[tuple]]:
    """(shapes shared, shapes taken) that ``item`` declares."""
    shared = [shape_key(*m.args, **m.kwargs) for m in item.iter_markers("shares_engine")]
    taken = [shape_key(*m.args, **m.kwargs) for m in item.iter_markers("takes_engine")]
    return shared, taken


def order_and_plan(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the modules: those without a shared engine first, then for each shape (smallest first) the modules
    not yet placed that use it, those taking it last; count each shape's users."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    uses: dict[str, tuple[set, set]] = {}
    for name, members in modules.items():
        shared, taken = set(), set()
        for item in members:
            s, t = shapes_of(item)
            shared.update(s)
            taken.update(t)
        uses[name] = (shared | taken, taken)
    order = [name for name in modules if not uses[name][0]]
    for shape in sorted({shape for used, _ in uses.values() for shape in used}):
        group = [name for name in modules if name not in order and shape in uses[name][0]]
        order += sorted(group, key=lambda name: shape in uses[name][1])
    spec = config.getoption("engine_shard", None)
    if spec:
        engine = {n for n in order if any(item.get_closest_marker("engine") for item in modules[n])}
        keep = shard_modules(spec, {n: uses[n][0] for n in order if n in engine},
                             {n for n in order if any(i.get_closest_marker("owns_cores") for i in modules[n])})
        dropped = [i for n in order if n in engine and n not in keep for i in modules[n]]
        order = [n for n in order if n in keep or n not in engine]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
    items[:] = [item for name in order for item in modules[name]]
    plan: Counter = Counter()
    for item in items:
        shared, taken = shapes_of(item)
        plan.update(set(shared) | set(taken))
    config.stash[_PLAN] = plan


def shape_name(key: tuple) -> str:
    blocks, max_model_len, flags = key
    return " ".join([f"blocks={blocks}", f"max_model_len={max_model_len}", *flags])


def shard_modules(spec: str, uses: dict[str, set], solo: set[str]) -> set[str]:
    """The engine modules of shard ``spec`` ("K/N" or "solo"). A shard's work: its modules' own seconds plus
    one start of each shape they use (a shape split across shards starts in each). Longest module first to the
    shard it adds least to, then single moves and swaps while they lower the largest shard's work; with two
    shards, then the best deal by exhaustive search from there (_best_pair)."""
    if spec == SOLO:
        return set(solo)
    try:
        k, n = (int(x) for x in spec.split("/"))
        assert 0 <= k < n
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"--engine-shard: {spec!r} is neither K/N (0 <= K < N) nor {SOLO!r}") from None
    stored = engine_seconds()
    own = {m: stored.get("modules", {}).get(m, DEFAULT_SECONDS) for m in uses if m not in solo}
    starts = stored.get("starts", {})

    def work(members: set[str]) -> float:  # summed in a fixed order: the same in every shard's process
        shapes = sorted(set().union(*(uses[m] for m in members))) if members else []
        return round(sum(own[m] for m in sorted(members)) + sum(starts.get(shape_name(s), START_SECONDS)
                                                               for s in shapes), 3)

    shards: list[set[str]] = [set() for _ in range(n)]
    for module in sorted(own, key=lambda m: (-own[m], m)):
        min(shards, key=lambda sh: (work(sh | {module}) - work(sh), work(sh))).add(module)
    while True:  # deterministic: the first improving move or swap, in a fixed order, until none improves
        worst = max(range(n), key=lambda i: work(shards[i]))
        found = next(((other, better) for other in range(n) if other != worst
                      if (better := _improvement(shards[worst], shards[other], work)) is not None), None)
        if found is None:
            break
        other, (shards[worst], shards[other]) = found
    if n == 2:
        cost = {s: starts.get(shape_name(s), START_SECONDS) for m in own for s in uses[m]}
        shards = _best_pair(shards, own, uses, cost, work)
    SHARD_WORK.append((k, n, work(shards[k]), [work(sh) for sh in shards]))
    return shards[k]


def _best_pair(shards: list[set[str]], own: dict[str, float], uses: dict[str, set], cost: dict, work,
               node_limit: int = 500_000) -> list[set[str]]:
    """Two shards: the deal with the least larger shard, searched exhaustively (branch and bound, longest module
    first, from the moves' and swaps' deal) when that takes under ``node_limit`` steps, else that deal. The moves
    stop where a module's shapes tie it to its shard (CI's 21 modules: 920 s where 887 s was possible)."""
    mods = sorted(own, key=lambda m: (-own[m], m))
    best = [max(work(shards[0]), work(shards[1])) - 1.0, None]  # only a deal over a second better replaces it
    remaining = [sum(own[m] for m in mods[i:]) for i in range(len(mods) + 1)]
    nodes = 0

    def place(i: int, sides: tuple, loads: tuple, shapes: tuple) -> bool:
        nonlocal nodes
        nodes += 1
        if nodes > node_limit:
            return False
        if max(loads) >= best[0] or (loads[0] + loads[1] + remaining[i]) / 2 >= best[0]:
            return True
        if i == len(mods):
            best[:] = [max(loads), sides]
            return True
        m = mods[i]
        for k in ((0,) if i == 0 else (0, 1)):  # the first module in shard 0: the mirror deal is the same
            added = own[m] + sum(cost[s] for s in sorted(uses[m] - shapes[k]))  # a fixed order: the same sum
            grown = tuple(sides[j] + (m,) if j == k else sides[j] for j in range(2))
            new_loads = tuple(loads[j] + added if j == k else loads[j] for j in range(2))
            new_shapes = tuple(shapes[j] | uses[m] if j == k else shapes[j] for j in range(2))
            if not place(i + 1, grown, new_loads, new_shapes):
                return False
        return True

    if not place(0, ((), ()), (0.0, 0.0), (frozenset(), frozenset())) or best[1] is None:
        return shards
    found = [set(side) for side in best[1]]
    # the shard that held the longest module keeps it: shard k's modules stay where the moves put most of them
    return found if mods[0] in shards[0] else found[::-1]


def _improvement(heavy: set[str], light: set[str], work) -> tuple[set[str], set[str]] | None:
    """The first move of one module from ``heavy`` to ``light`` (or swap with one of ``light``'s), in a fixed
    order, that lowers the larger of the two shards' work by over a second; None when none does."""
    before = max(work(heavy), work(light))
    for m in sorted(heavy):
        for swap in [None, *sorted(light)]:
            a = heavy - {m} | ({swap} if swap else set())
            b = light - ({swap} if swap else set()) | {m}
            if max(work(a), work(b)) < before - 1.0:
                return a, b
    return None


def engine_seconds() -> dict:
    """The stored run (tests/engine-seconds.json): each module's own seconds ("modules": its tests' time less
    the shared engines it started) and each shape's start ("starts"); empty when there is none."""
    try:
        stored = json.loads(SECONDS_FILE.read_text())
        return stored if isinstance(stored, dict) else {}
    except (OSError, ValueError):
        return {}


def record_starts(starts: list[tuple[tuple, str, float]]) -> None:
    """Append this session's shared-engine starts to $KVWATT_ENGINE_STARTS_FILE (scripts/run_tiers.py reads it
    to store each shape's start apart from its users' seconds); nothing when unset."""
    path = os.environ.get("KVWATT_ENGINE_STARTS_FILE")
    if path and starts:
        with open(path, "a") as f:
            for key, module, seconds in starts:
                f.write(json.dumps({"shape": shape_name(key), "module": module, "seconds": seconds}) + "\n")


def plan_of(config: pytest.Config) -> Counter:
    return config.stash.get(_PLAN, Counter())


def after_test(item: pytest.Item, pool) -> None:
    """Count ``item``'s shapes as used; stop the engines no later test declares."""
    plan = plan_of(item.config)
    shared, taken = shapes_of(item)
    for key in set(shared) | set(taken):
        plan[key] -= 1
        if plan[key] <= 0 and pool is not None:
            pool.stop(key)
