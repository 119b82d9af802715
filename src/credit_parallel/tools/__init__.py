"""Tools around the library: benchmarking and profiling (not needed to train)."""
