"""The state that learns, per tick, and the figures derived from it once per tick: ``Model`` (model.py) takes each
sampler Tick; one watched server is server.py, the pressure learners pressure/, energy attribution energy.py.

Thin on purpose: importing one module of the package (``exporter.model.pressure``) does not import them all;
``exporter.model.Model`` is resolved on first use (PEP 562)."""

from __future__ import annotations

__all__ = ["Model"]


def __getattr__(name: str):
    if name == "Model":
        from exporter.model.model import Model
        return Model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
