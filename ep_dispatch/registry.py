"""Dispatch backends by name; optional packages are imported only when their backend is chosen."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ep_dispatch.base import Dispatcher


def _local(**kwargs: Any) -> Dispatcher:
    from ep_dispatch.local import LocalDispatcher

    return LocalDispatcher(num_experts=kwargs["num_experts"])


_BACKENDS: dict[str, Callable[..., Dispatcher]] = {"local": _local}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def create_dispatcher(name: str, **kwargs: Any) -> Dispatcher:
    """Build the backend called `name`; unknown names get an error listing the known ones."""
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown dispatch backend {name!r}; available: {', '.join(available_backends())}"
        )
    return _BACKENDS[name](**kwargs)
