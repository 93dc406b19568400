"""Start records, event classes, statistics, Prometheus export and reports."""
