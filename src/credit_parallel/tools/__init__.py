"""Tools above the library: the benchmark suite, the profiler and the launcher with its failure forensics.

Nothing in the library imports from here; these modules use the library like a user would.
"""
