"""kvwatt's lab: ``replay`` (agentic traces against an OpenAI-compatible server) and ``experiment`` (the
paired ON/OFF offloading study, its measurement through the daemon's own sampler and model, its report).

A separate distribution (lab/pyproject.toml, ``make lab``): it imports the daemon's package ``exporter``;
the daemon never imports it (tests/test_layers.py). Its commands reach ``kvwatt`` through the
``kvwatt.commands`` entry points.
"""
