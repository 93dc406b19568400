"""The node-local content-addressed model store."""
