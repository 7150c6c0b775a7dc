"""`kvwatt experiment`: the paired ON/OFF study of methods.md s2 run from a plan file (docs/experiment.md)."""
