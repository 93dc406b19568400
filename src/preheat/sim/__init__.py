"""Discrete-event fleet simulator calling the same pure policy code as the live system."""
