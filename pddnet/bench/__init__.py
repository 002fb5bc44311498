"""Benchmarks that run compared systems side by side in one run and print ratios."""
