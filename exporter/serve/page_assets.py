"""The landing page's inline style and script (exporter.serve.page). Inline, never linked: the page must work
air-gapped, behind basic auth and TLS alike, with nothing but the daemon to ask."""

REFRESH_SECONDS = 5

CSS = """
:root { --fg:#1d2430; --muted:#5b6678; --line:#d9dee7; --bg:#f4f6f9; --card:#fff;
  --good:#1f7a3a; --goodbg:#e3f4e8; --bad:#b3261e; --badbg:#fde7e5;
  --unk:#4b5563; --unkbg:#eceff3; }
* { box-sizing: border-box; }
body { margin:0; font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
  color:var(--fg); background:var(--bg); }
header.top { display:flex; flex-wrap:wrap; align-items:baseline; gap:.4em 1.2em; padding:.8em 1.4em;
  background:#1d2430; color:#fff; }
header.top h1 { margin:0; font-size:1.35em; letter-spacing:.02em; }
header.top .version { color:#aab4c3; font-size:.9em; }
header.top nav a { color:#cfe0ff; margin-right:1em; }
main { padding:1em 1.4em 2em; max-width:1320px; }
.cols { display:grid; grid-template-columns:minmax(0,1fr) auto; gap:0 1.6em; }
@media (max-width:900px) { .cols { grid-template-columns:minmax(0,1fr); } }
aside { border-left:1px solid var(--line); padding-left:1.2em; }
@media (max-width:900px) { aside { border-left:0; padding-left:0; } }
.asof { margin:.2em 0 .8em; color:var(--muted); }
.asof b { color:var(--fg); }
.chips { display:flex; flex-wrap:wrap; gap:.4em; margin:.3em 0 1em; }
.chip { display:inline-block; padding:.05em .55em; border-radius:999px; font-size:.85em; font-weight:600;
  border:1px solid transparent; white-space:nowrap; }
/* a chip's colour is its meaning (exporter.serve.page.MEANINGS): good, bad, unknown; a plain fact is neutral */
.chip.good { background:var(--goodbg); color:var(--good); }
.chip.bad { background:var(--badbg); color:var(--bad); }
.chip.unknown { background:var(--unkbg); color:var(--unk); border-color:#c9cfd8; font-style:italic; }
.chip.neutral { background:var(--card); color:var(--fg); border-color:var(--line); }
article.server { background:var(--card); border:1px solid var(--line); border-radius:10px; margin:0 0 1.4em;
  padding:1em 1.3em 1.1em; box-shadow:0 1px 2px rgba(0,0,0,.04); }
article.server > h2 { margin:0; font-size:1.3em; display:flex; align-items:center; gap:.5em; flex-wrap:wrap; }
.meta { color:var(--muted); margin:.2em 0 .6em; font-size:.92em; }
section.q { border-top:1px solid var(--line); padding:.55em 0 .3em; }
section.q h3 { margin:0 0 .3em; font-size:.8em; text-transform:uppercase; letter-spacing:.07em;
  color:var(--muted); }
section.q p { margin:.25em 0; }
.verdict { font-size:1.12em; }
.verdict.saves b.figure { color:var(--good); }
.verdict.costs b.figure { color:var(--bad); }
.verdict.unknown { font-style:italic; color:var(--unk); }
.banner { padding:.45em .7em; border-radius:6px; margin:.3em 0; font-weight:600; }
.banner.alarm { background:var(--badbg); color:var(--bad); }
.banner.calm { background:var(--goodbg); color:var(--good); }
.banner.unknown { background:var(--unkbg); color:var(--unk); }
.banner.notice { background:#e8eefc; color:#1d3f8f; border:1px solid #9db3ea; }
.small, .note { color:var(--muted); font-size:.88em; }
.unknown { color:var(--unk); font-style:italic; }
ul.todo { margin:.2em 0; padding-left:1.3em; }
ul.todo li { margin:.2em 0; }
ul.todo li.bad { color:var(--bad); }
ul.todo li.unknown { color:var(--unk); }
.todo .evidence { color:var(--muted); font-size:.88em; }
.state-word.provisional, .state-word.unknown { color:var(--unk); font-style:italic; }
table { border-collapse:collapse; margin:.35em 0; font-size:.92em; }
th, td { text-align:left; padding:.25em .7em .25em 0; border-bottom:1px solid var(--line); vertical-align:top; }
th { color:var(--muted); font-weight:600; }
table.windows td.num, table.windows th.num { text-align:right; padding-left:1.2em; }
details > summary { cursor:pointer; color:var(--muted); margin-top:.4em; }
footer { color:var(--muted); font-size:.85em; padding:0 1.4em 1.5em; }
footer .failed { color:var(--bad); font-weight:600; }
"""

# One rendering path: the server renders the whole page from /api/status's dict; this script only fetches
# the same page again and swaps the <main> in (open <details> stay open). Without JavaScript the
# <noscript> refresh reloads the page instead.
JS = """
(function () {
  var period = %d * 1000, state = document.getElementById('refresh-state');
  function say(text, failed) { state.textContent = text; state.className = failed ? 'failed' : ''; }
  function refresh() {
    fetch(window.location.pathname, {cache: 'no-store', headers: {'Accept': 'text/html'}})
      .then(function (r) { if (!r.ok) { throw new Error('HTTP ' + r.status); } return r.text(); })
      .then(function (text) {
        var fresh = new DOMParser().parseFromString(text, 'text/html').getElementById('content');
        var old = document.getElementById('content');
        if (!fresh || !old) { throw new Error('no content in the answer'); }
        old.querySelectorAll('details[id]').forEach(function (d) {
          var twin = fresh.querySelector('details[id="' + d.id + '"]');
          if (twin) { twin.open = d.open; }
        });
        old.replaceWith(fresh);
        say('Last refreshed ' + new Date().toLocaleTimeString() + '.', false);
      })
      .catch(function (e) {
        say('Refresh failed (' + e.message + '): the figures shown are as of the time above.', true);
      });
  }
  setInterval(refresh, period);
})();
""" % REFRESH_SECONDS
