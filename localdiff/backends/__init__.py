"""Compute that is not localdiff's own torch runtime: remote OpenAI-compatible endpoints (``remote``)."""
