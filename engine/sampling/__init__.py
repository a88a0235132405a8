"""Batched tensor operations behind :mod:`engine.sampler` (penalties, truncation, sampling)."""
