"""`kvwatt check-config FILE`: load and validate; print a summary; exit 2 with one line on the first problem.

It loads what `kvwatt run` loads at start from the paths the configuration names (the web configuration file,
each server's recorded baseline and model config.json) with the same loaders, so a file `run` would refuse is
refused here too, not reported ok."""

from __future__ import annotations

import argparse

from exporter.config import Config, format_window, load_file, shown_server
from exporter.model import offload
from exporter.serve import webconfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="YAML configuration file")


def load_named_files(cfg: Config) -> list[str]:
    """The files the configuration names, loaded as `kvwatt run` loads them (ConfigError on a bad one); what
    was loaded, for the summary."""
    loaded = []
    if cfg.web_config_path:
        webconfig.load(cfg.web_config_path)
        loaded.append(f"web config {cfg.web_config_path}")
    for s in cfg.servers:
        offload.setup(s)  # its model config.json and recorded baseline, as the daemon's model loads them
        loaded += [f"{s.name} {what} {path}" for what, path in (("model_config", s.model_config_path),
                                                                ("recorded_baseline", s.recorded_baseline_path))
                   if path]
    return loaded


def main(args: argparse.Namespace) -> int:
    cfg = load_file(args.file)
    loaded = load_named_files(cfg)
    servers = (", ".join(shown_server(s) for s in cfg.servers)
               or "none (default http://127.0.0.1:8000)")
    windows = ", ".join(format_window(w) for w in cfg.windows_seconds)
    files = f"; loaded: {', '.join(loaded)}" if loaded else ""
    print(f"{args.file}: ok; servers: {servers}; windows: {windows}; listen {cfg.listen}{files}")
    return 0
