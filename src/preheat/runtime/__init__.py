"""Where replicas run: local processes (and Kubernetes manifests)."""
