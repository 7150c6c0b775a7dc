"""The recorded OFF-condition profile (profile.py) that `kvwatt baseline record` writes (the run:
exporter/runtime/recorder.py) and the `recorded` dE kind reads."""
