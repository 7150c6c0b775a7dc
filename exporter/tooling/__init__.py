"""Checks and generators that read kvwatt's own source, never loaded by the daemon: the README's
reference tables (readme_tables.py) and the scanner for copies of a shared rule (rulecopies.py)."""
