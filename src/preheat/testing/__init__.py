"""Reusable helpers for tests and benchmarks: real servers on 127.0.0.1, started and stopped by PID."""
