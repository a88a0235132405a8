"""Attention backends: each owns its KV cache layout, its allocation and the per-step metadata it reads."""
