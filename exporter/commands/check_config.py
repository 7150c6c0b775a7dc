"""`kvwatt check-config FILE`: load and validate; print a summary; exit 2 with one line on the first problem."""

from __future__ import annotations

import argparse

from exporter.config import format_window, load_file, shown_server


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="YAML configuration file")


def main(args: argparse.Namespace) -> int:
    cfg = load_file(args.file)
    servers = (", ".join(shown_server(s) for s in cfg.servers)
               or "none (default http://127.0.0.1:8000)")
    windows = ", ".join(format_window(w) for w in cfg.windows_seconds)
    print(f"{args.file}: ok; servers: {servers}; windows: {windows}; listen {cfg.listen}")
    return 0
