"""Switchyard: serving Mixture-of-Experts language models as asyncio microservices.

This package is the top: the command line, the launcher and its supervision, the compose
renderer, and the client tools (bench, eval, probe). Nothing below imports it."""

from common import __version__

__all__ = ["__version__"]
