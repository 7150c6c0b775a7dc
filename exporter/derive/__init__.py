"""Pure functions from lists of samples.Interval to the figures kvwatt exports. No I/O, no clocks."""
