"""Switchyard's services: attention (engine core) and expert (a share of the experts)."""
