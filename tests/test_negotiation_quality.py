"""Content negotiation of /metrics with quality values and versions: ``q=0`` refuses a
media range or a coding (RFC 9110 s12.4.2), and an OpenMetrics version kvwatt does not produce is never echoed
in the Content-Type (prometheus/common expfmt.Negotiate skips it). prometheus_client's choose_encoder and
gzip_accepted ignore q and echo any version >= 1.0.0."""

import gzip

import pytest
from prometheus_client.metrics_core import GaugeMetricFamily

from exporter.serve.exposition import Exposition, gzip_accepted, negotiate

TEXT = "text/plain; version=0.0.4; charset=utf-8"
OM = "application/openmetrics-text; version=1.0.0; charset=utf-8"
# what Prometheus 3 sends
PROMETHEUS = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
              "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
              "text/plain;version=0.0.4;q=0.3,*/*;q=0.2")


def exposition() -> Exposition:
    g = GaugeMetricFamily("kvwatt_test_ratio", "a test gauge", labels=["server"])
    g.add_metric(["a"], 0.5)
    return Exposition([g])


@pytest.mark.parametrize("accept,content_type", [
    ("application/openmetrics-text; version=1.0.0; q=0", TEXT),
    ("application/openmetrics-text;q=0, text/plain;q=0.5", TEXT),
    ("application/openmetrics-text; version=9.9.9", TEXT),
    ("application/openmetrics-text; version=9.9.9, application/openmetrics-text; version=1.0.0; q=0.5",
     OM + "; escaping=underscores"),
    ("text/plain;q=0.1, application/openmetrics-text;q=0.5", OM),
    (PROMETHEUS, OM + "; escaping=allow-utf-8"),
    ("application/openmetrics-text; version=1.x", TEXT),
    (None, TEXT),
])
def test_accept_quality_and_version_choose_a_format_kvwatt_produces(accept, content_type):
    assert negotiate(accept)[1] == content_type
    served = exposition().serve(accept, None, None)
    assert served.content_type == content_type
    assert served.body.endswith(b"# EOF\n") == content_type.startswith("application/openmetrics-text")


@pytest.mark.parametrize("encoding,gzipped", [
    ("gzip;q=0", False), ("gzip; q=0.000", False), ("deflate, gzip;q=0", False), ("identity", False), (None, False),
    ("gzip", True), ("deflate, gzip;q=0.9", True), ("GZIP", True),
])
def test_accept_encoding_q0_means_no_gzip(encoding, gzipped):
    assert gzip_accepted(encoding) is gzipped
    e = exposition()
    served = e.serve(None, encoding, None)
    assert served.gzipped is gzipped and ("Content-Encoding" in served.headers()) is gzipped
    assert (gzip.decompress(served.body) if gzipped else served.body) == e.text
    cached = e.cached(None, encoding, None)
    assert cached is not None and cached.gzipped is gzipped
