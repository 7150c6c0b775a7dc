"""The long commands' progress line: redrawn in place on a terminal, a line per quarter in a log."""

from __future__ import annotations

import io

from exporter.runtime import progress as P


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_one_line_per_quarter_and_the_last():
    out = io.StringIO()
    p = P.Progress(out, 100.0, "recording a")
    for second in range(0, 101):
        p.update(float(second), "n intervals")
    p.finish(100.0, "done")
    lines = out.getvalue().splitlines()
    assert [x.split(" (")[0] for x in lines] == ["recording a: 25 s of 100 s", "recording a: 50 s of 100 s",
                                                 "recording a: 75 s of 100 s", "recording a: 100 s of 100 s"]
    assert lines[-1].endswith("(100 %), done") and "\r" not in out.getvalue()


def test_a_terminal_line_is_redrawn_in_place_and_closed(monkeypatch):
    clock = iter(range(1000))
    monkeypatch.setattr(P.time, "monotonic", lambda: float(next(clock)))
    out = Terminal()
    p = P.Progress(out, 10.0, "measuring idle power")
    for second in range(10):
        p.update(float(second), "2 devices")
    p.finish(10.0, "2 devices")
    text = out.getvalue()
    assert text.count("\r") == 11 and text.count("\n") == 1 and text.endswith("(100 %), 2 devices\x1b[K\n")
