"""Workloads and experiment runners shared by benchmarks and the demo."""
