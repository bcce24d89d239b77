"""Benchmark harness: providers, timing, sweep runner, tables, plots, environment record."""
