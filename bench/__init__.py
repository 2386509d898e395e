"""Benchmarks a user or maintainer runs, each as a module from the repository root
(`python -m bench.<name> --help`): serving, adapters, tensor_parallel, soak. What they share
(models, nodes built from a NodeConfig, workload, timing, tables, floors) is bench/harness.py."""
