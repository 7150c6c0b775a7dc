"""kvwatt's commands: thin layers over the libraries (argument parsing, then one call); exporter/cli.py wires them."""
