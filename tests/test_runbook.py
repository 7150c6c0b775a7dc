"""The runbook every alert links to is served by kvwatt itself (GET /runbook), and nothing links to the
placeholder repository any more.

- GET /runbook over real HTTP on loopback: one self-contained HTML page with an ``id`` for the anchor of every
  alert of the generated rules, behind basic auth when the web configuration asks for it;
- the renderer escapes text and keeps code blocks as <pre>;
- ``alerts/generate.py --check`` fails on a stale package copy (exporter/data/RUNBOOK.md) and a write fixes it;
- ``runbook_base_url``: the default names a kvwatt's /runbook, a plain URL is used as given;
- no tracked file names the placeholder repository.
"""

from __future__ import annotations

import asyncio
import base64
import re
import subprocess

import aiohttp
import bcrypt
import yaml

from exporter.serve import runbook
from exporter.serve.web import start_web
from exporter.serve.webconfig import WebConfig
from tests.support.daemon import REPO, free_port
from tests.test_alerts import GEN, RULES_PATH, RUNBOOK

ALERT_NAMES = [r["alert"] for g in yaml.safe_load(RULES_PATH.read_text(encoding="utf-8"))["groups"]
               for r in g["rules"] if "alert" in r]
PLACEHOLDER = "github.com/" + "kvwatt"  # split so that this file does not name it either


async def _get(path: str, web_config: WebConfig | None = None, headers: dict | None = None):
    port = free_port()
    runner = await start_web(object(), "127.0.0.1", port, web_config=web_config)  # /runbook reads no daemon state
    try:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}{path}", headers=headers) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.text()
    finally:
        await runner.cleanup()


def test_get_runbook_serves_a_section_for_every_generated_alert():
    status, content_type, body = asyncio.run(_get("/runbook"))
    assert status == 200 and content_type.startswith("text/html")
    ids = set(re.findall(r'<h[1-6] id="([^"]+)"', body))
    for name in ALERT_NAMES:
        assert GEN.anchor(name) in ids, f"/runbook has no id for {name}"
        assert f'id="{GEN.anchor(name)}">{name}</h2>' in body
    # self-contained: no script, stylesheet, image or font from anywhere
    assert not re.search(r"<script|<link|<img|src=|@import|url\(", body, flags=re.I)


def test_get_runbook_needs_the_same_basic_auth_as_every_endpoint():
    config = WebConfig(path="web.yml", users={"ops": bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=4))})
    status, _, _ = asyncio.run(_get("/runbook", config))
    assert status == 401
    good = {"Authorization": "Basic " + base64.b64encode(b"ops:secret").decode()}
    status, _, body = asyncio.run(_get("/runbook", config, good))
    assert status == 200 and 'id="kvoffloadcollapse"' in body


def test_render_escapes_text_and_keeps_code_blocks():
    md = ("# Title\n\nA <b>bold</b> claim & `x<y` and **strong <i>**.\n\n```\nif a < b:\n    run()\n```\n\n"
          "    indented <code>\n\n| a | b |\n|---|---|\n| `<t>` | [link](../x.md) |\n\n0. first\n   more\n1. second\n")
    html = runbook.render(md, version="1.2.3")
    assert '<h1 id="title">Title</h1>' in html
    assert "A &lt;b&gt;bold&lt;/b&gt; claim &amp; <code>x&lt;y</code> and <strong>strong &lt;i&gt;</strong>." in html
    assert "<pre>if a &lt; b:\n    run()</pre>" in html
    assert "<pre>indented &lt;code&gt;</pre>" in html
    assert "<td><code>&lt;t&gt;</code></td><td>link</td>" in html
    assert '<ol start="0"><li>first more</li><li>second</li></ol>' in html
    assert "<b>" not in html and "<i>" not in html


def test_anchor_is_githubs():
    assert runbook.anchor("KVOffloadCollapse") == "kvoffloadcollapse"
    assert runbook.anchor("Why the defaults") == "why-the-defaults"
    assert runbook.anchor("`x` & **y**: z") == "x--y-z"


def test_package_copy_is_the_runbook():
    assert runbook.RUNBOOK_PATH.read_text(encoding="utf-8") == RUNBOOK.read_text(encoding="utf-8")


def test_check_refuses_a_stale_package_copy_and_a_write_fixes_it(tmp_path, monkeypatch, capsys):
    copy = tmp_path / "data" / "RUNBOOK.md"
    monkeypatch.setattr(GEN, "PACKAGE_RUNBOOK", copy)
    out = ["--out-dir", str(tmp_path)]
    GEN.main(out)  # writes the rules and the copy
    assert GEN.main(["--check", *out]) == 0
    copy.write_text(RUNBOOK.read_text(encoding="utf-8") + "\nan edit made in the copy\n", encoding="utf-8")
    capsys.readouterr()
    assert GEN.main(["--check", *out]) == 1
    assert f"{copy} is stale" in capsys.readouterr().err
    copy.unlink()
    assert GEN.main(["--check", *out]) == 1
    GEN.main(out)
    assert GEN.main(["--check", *out]) == 0 and copy.read_text(encoding="utf-8") == RUNBOOK.read_text(encoding="utf-8")


def test_a_runbook_base_url_without_the_instance_is_used_as_given():
    s = GEN.resolve_settings(GEN.parse_set(["runbook_base_url=https://wiki.example/kvwatt-runbook"]))
    assert GEN.runbook_url("KVOffloadCollapse", s) == "https://wiki.example/kvwatt-runbook#kvoffloadcollapse"


def test_the_default_and_an_https_base_link_a_kvwatt_runbook():
    default = GEN.runbook_url("Watchdog", GEN.resolve_settings())
    assert "}}http://{{ .Labels.instance }}/runbook#watchdog{{ end }}" in default
    s = GEN.resolve_settings(GEN.parse_set(["runbook_base_url=https://{{ $labels.instance }}/runbook"]))
    assert "}}https://{{ .Labels.instance }}/runbook#watchdog{{ end }}" in GEN.runbook_url("Watchdog", s)
    # the job regex reaches the lookup as a PromQL string inside a Go string; printf's % doubled
    s = GEN.resolve_settings({"kvwatt_job": 'kv"watt%'})
    assert r'up{job=~\"kv\\\"watt%%\"}' in GEN.runbook_url("Watchdog", s)


def test_no_tracked_file_names_the_placeholder_repository():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    named = []
    for rel in filter(None, files.decode().split("\0")):
        path = REPO / rel
        if rel == "tests/test_runbook.py" or not path.is_file():
            continue
        if PLACEHOLDER.encode() in path.read_bytes():
            named.append(rel)
    assert not named, f"{PLACEHOLDER} in {named}"
