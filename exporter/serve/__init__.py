"""The renderers: /metrics (collector, exposition), /api/status and the page (web, page), and the HTTP layer under
them (connections, webconfig). They serialise the published snapshot and never compute."""
