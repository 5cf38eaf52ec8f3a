"""Benchmarks that compare Lumen side by side with baselines, reported as ratios."""
