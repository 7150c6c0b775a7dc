"""GET /runbook: the alert runbook of this kvwatt's own version, as one self-contained HTML page.

alerts/RUNBOOK.md is the one source; alerts/generate.py copies it into the package (exporter/data/RUNBOOK.md,
checked by ``generate.py --check``) because an installed kvwatt has no alerts/ directory. Each alert's
``runbook_url`` is ``<base>#<anchor(alert name)>``, so every heading gets ``id="<anchor(heading)>"``.

The renderer knows the Markdown RUNBOOK.md uses and nothing more: headings, paragraphs, lists, tables, fenced
code (kept as <pre>), ``inline code``, **bold** and [links](...) (shown as their text: the targets are paths
in the source tree, which this page cannot serve). Every piece of text is HTML-escaped.
"""

from __future__ import annotations

import html
import re
from functools import lru_cache
from pathlib import Path

from exporter import __version__

RUNBOOK_PATH = Path(__file__).resolve().parents[1] / "data" / "RUNBOOK.md"

_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_ORDERED = re.compile(r"^\d+\.\s+")
_UNORDERED = re.compile(r"^[-*]\s+")
_INLINE = re.compile(r"`([^`]+)`|\*\*(.+?)\*\*|\[([^\]]+)\]\([^)]*\)")

STYLE = ("body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;line-height:1.5}"
         "code,pre{font-family:ui-monospace,monospace;background:#f4f4f4}pre{padding:.5rem;overflow-x:auto}"
         "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2rem .4rem;vertical-align:top}"
         ":target{background:#fff3c4}")


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens
    ('KVOffloadCollapse' -> 'kvoffloadcollapse', 'Why the defaults' -> 'why-the-defaults').
    alerts/generate.py builds each alert's runbook_url with it."""
    text = re.sub(r"`|\*\*", "", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def inline(text: str) -> str:
    """One line of Markdown text as escaped HTML with <code> and <strong>."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(html.escape(text[pos:m.start()]))
        code, bold, link = m.groups()
        if code is not None:
            out.append(f"<code>{html.escape(code)}</code>")
        elif bold is not None:
            out.append(f"<strong>{inline(bold)}</strong>")
        else:
            out.append(inline(link))
        pos = m.end()
    out.append(html.escape(text[pos:]))
    return "".join(out)


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def _table(rows: list[str]) -> str:
    head, body = _cells(rows[0]), [_cells(r) for r in rows[2:]]  # rows[1] is the |---| line
    th = "".join(f"<th>{inline(c)}</th>" for c in head)
    trs = "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in r) + "</tr>" for r in body)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def _list(items: list[str], ordered: bool) -> str:
    tag = "ol" if ordered else "ul"
    start = ""
    if ordered and items:
        first = int(_ORDERED.match(items[0]).group(0).rstrip(". \t"))
        start = f' start="{first}"' if first != 1 else ""
    pattern = _ORDERED if ordered else _UNORDERED
    lis = "".join(f"<li>{inline(pattern.sub('', item, count=1))}</li>" for item in items)
    return f"<{tag}{start}>{lis}</{tag}>"


def _blocks(lines: list[str]):
    """Yield HTML blocks for the Markdown ``lines``."""
    i, seen = 0, {}
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            yield "<pre>" + html.escape("\n".join(lines[i + 1:j])) + "</pre>"
            i = j + 1
        elif m := _HEADING.match(line):
            level, text = len(m.group(1)), m.group(2)
            base = anchor(text)
            n = seen.get(base, 0)
            seen[base] = n + 1
            hid = base if n == 0 else f"{base}-{n}"  # GitHub numbers repeated headings
            yield f'<h{level} id="{html.escape(hid)}">{inline(text)}</h{level}>'
            i += 1
        elif line.startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            yield _table(lines[i:j])
            i = j
        elif line.startswith("    "):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            yield "<pre>" + html.escape("\n".join(x[4:] for x in lines[i:j]).rstrip("\n")) + "</pre>"
            i = j
        elif _ORDERED.match(line) or _UNORDERED.match(line):
            ordered = bool(_ORDERED.match(line))
            pattern = _ORDERED if ordered else _UNORDERED
            items: list[str] = []
            while i < len(lines) and lines[i].strip() and not _HEADING.match(lines[i]):
                if pattern.match(lines[i]):
                    items.append(lines[i])
                else:  # a continuation line of the item above
                    items[-1] += " " + lines[i].strip()
                i += 1
            yield _list(items, ordered)
        else:
            j = i
            while (j < len(lines) and lines[j].strip() and not lines[j].startswith(("```", "|"))
                   and not _HEADING.match(lines[j])
                   and not (j > i and (_ORDERED.match(lines[j]) or _UNORDERED.match(lines[j])))):
                j += 1
            yield "<p>" + inline(" ".join(x.strip() for x in lines[i:j])) + "</p>"
            i = j


def render(markdown: str, version: str = __version__) -> str:
    """The whole page: no scripts, no external stylesheet, fonts or images."""
    body = "\n".join(_blocks(markdown.splitlines()))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>kvwatt {html.escape(version)} alert runbook</title><style>{STYLE}</style></head>\n"
            f"<body>\n<p><small>kvwatt {html.escape(version)}: the runbook shipped with this exporter.</small></p>\n"
            f"{body}\n</body></html>\n")


@lru_cache(maxsize=1)
def page() -> str | None:
    """The rendered package copy, read once; None when the package was installed without it."""
    try:
        return render(RUNBOOK_PATH.read_text(encoding="utf-8"))
    except OSError:
        return None
