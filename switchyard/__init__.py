"""Switchyard: serving Mixture-of-Experts language models as asyncio microservices."""

__version__ = "0.1.0"
