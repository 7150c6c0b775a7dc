"""Argv templates: ``{name}`` placeholders substituted into each argv element on its own.

A value replaces its placeholder inside one element and stays inside it: nothing is split on spaces and no
shell ever sees the result (the command is run as an argv list), so a value such as ``a b; rm -rf x`` is one
argument, verbatim. ``{{`` and ``}}`` are literal braces. Only bare names are allowed: ``{port}``, never
``{port:05d}``, ``{x!r}``, ``{a.b}`` or ``{a[0]}``. An unknown name is an error naming the plan key.
"""

from __future__ import annotations

import re
import string
from typing import Iterable, Mapping

from exporter.config import ConfigError

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FORMATTER = string.Formatter()


def _parse(template: str, key: str) -> list[tuple[str, str | None]]:
    """(literal, placeholder name or None) pieces; ConfigError for anything but bare names."""
    try:
        pieces = list(_FORMATTER.parse(template))
    except ValueError as e:
        raise ConfigError(f"{key}: bad template {template!r} ({e}); write {{{{ and }}}} for literal braces") from None
    out = []
    for literal, name, spec, conversion in pieces:
        if name is not None and (not _NAME_RE.match(name) or spec or conversion):
            shown = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ConfigError(f"{key}: bad placeholder {{{shown}}} in {template!r}: only {{name}} is allowed")
        out.append((literal, name))
    return out


def placeholders(template: str, key: str) -> list[str]:
    return [name for _, name in _parse(template, key) if name is not None]


def check(template: str, known: Iterable[str], key: str) -> None:
    """ConfigError naming ``key`` when the template uses a placeholder not in ``known``."""
    known = set(known)
    for name in placeholders(template, key):
        if name not in known:
            raise ConfigError(f"{key}: unknown placeholder {{{name}}} in {template!r} "
                              f"(known: {', '.join(sorted(known))})")


def substitute(template: str, values: Mapping[str, str], key: str) -> str:
    """The template with each placeholder replaced by its value, verbatim."""
    out = []
    for literal, name in _parse(template, key):
        out.append(literal)
        if name is not None:
            if name not in values:
                raise ConfigError(f"{key}: unknown placeholder {{{name}}} in {template!r}")
            out.append(values[name])
    return "".join(out)


def render_argv(templates: Iterable[str], values: Mapping[str, str], key: str) -> list[str]:
    """One output element per template element: never more, never fewer."""
    return [substitute(t, values, f"{key}[{i}]") for i, t in enumerate(templates)]
