"""Switchyard's OpenAI-compatible HTTP gateway: tokenizes, forwards to the engine, streams back."""
