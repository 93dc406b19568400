"""The prefix-aware router: pure prefix keys and policies, and the HTTP proxy."""
