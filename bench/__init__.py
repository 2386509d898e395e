"""Benchmarks and profiles; run each as a module from the repository root, e.g.
`python -m bench.serving_bench`. Shared helpers (random checkpoints and adapters, copy
bandwidth, compile counting, profile configurations) live in bench/common.py."""
