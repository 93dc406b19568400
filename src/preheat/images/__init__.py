"""Container image cache on a node (OCI registry client)."""
