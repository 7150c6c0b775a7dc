"""Offload-specific commands and files: the recorded OFF profile (profile.py) and `kvwatt baseline record`."""
