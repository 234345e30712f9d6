"""Adapters that run third-party models on ``ep_runtime`` (each behind an optional extra)."""
