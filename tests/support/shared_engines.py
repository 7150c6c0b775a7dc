"""The plan of the shared engines (tests/support/engine.py's EnginePool), from the tests' markers:

    pytestmark = [pytest.mark.engine, pytest.mark.shares_engine(blocks=2000)]     # engines.get(blocks=2000)
    @pytest.mark.shares_engine(blocks=128, flags=KV_CACHE_METRICS)                 # one marker per shape used
    @pytest.mark.takes_engine(blocks=128)                                          # engines.take(blocks=128)

At collection the engine tests' modules are ordered so that the users of one shape run one after the other
(a module stays whole: its module fixtures are set up once), a module that takes a shape's engine after the
others that share it; after each test, the engine of a shape no test still declares is stopped. So each shape
starts once and at most a few idle engines (2 GB each) are held. A test that calls ``engines.get()`` for a shape
it did not declare still works: that engine is kept until the session ends.
"""

from __future__ import annotations

from collections import Counter

import pytest

_PLAN = pytest.StashKey[Counter]()


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
    items[:] = [item for name in order for item in modules[name]]
    plan: Counter = Counter()
    for item in items:
        shared, taken = shapes_of(item)
        plan.update(set(shared) | set(taken))
    config.stash[_PLAN] = plan


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
