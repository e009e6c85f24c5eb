"""Reproduction experiments and benchmarks; run each script with --help."""
