"""Routing policies, one module each, behind one Policy protocol (pure)."""
