"""`python -m tests.support.faulty_render run ...`: the real `kvwatt run`, except that collecting the exposition
raises while the file named by $KVWATT_FAIL_RENDER exists (fault injection for /healthz end-to-end
tests).

    KvwattDaemon(..., module="tests.support.faulty_render", env={"KVWATT_FAIL_RENDER": flag})
"""

from __future__ import annotations

import os

from exporter.cli import main
from exporter.runtime import daemon

_real_exposition = daemon.exposition


def exposition(snap, *args, **kwargs):
    if os.path.exists(os.environ["KVWATT_FAIL_RENDER"]):
        raise RuntimeError("injected render failure")
    return _real_exposition(snap, *args, **kwargs)


daemon.exposition = exposition  # Daemon.step looks the name up in its module at each tick

if __name__ == "__main__":
    raise SystemExit(main())
