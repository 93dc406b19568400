"""Artifact references and manifests (pure: no I/O)."""
