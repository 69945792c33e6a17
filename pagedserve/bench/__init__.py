"""Benchmarks: workloads, the offline and serve runners, plots, and the GPU scripts."""
