"""All-to-all between attention ranks and expert ranks: `dispatch` tokens, `combine` outputs.

Backends sit behind `ep_dispatch.base.Dispatcher` and are chosen by name with
`ep_dispatch.registry.create_dispatcher`.
"""

from ep_dispatch.base import Dispatcher, DispatchHandle
from ep_dispatch.registry import available_backends, create_dispatcher

__all__ = ["DispatchHandle", "Dispatcher", "available_backends", "create_dispatcher"]
