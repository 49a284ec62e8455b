"""Benchmarks: each script writes JSON and prints a short table last; results under benchmarks/results/."""
