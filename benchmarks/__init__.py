"""Benchmarks: one script per figure, each printing one JSON line; ``python -m benchmarks.run_all``
runs them all and rewrites BENCHMARKS.md. Not tests: CI never runs them."""
