"""Attention service: scheduler, paged KV cache, attention, router, sampling (the engine core)."""
