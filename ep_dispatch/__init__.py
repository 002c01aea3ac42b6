"""All-to-all between attention ranks and expert ranks: `dispatch` tokens, `combine` outputs.

Backends are chosen by name with `ep_dispatch.registry.create_experts_client`.
"""

from ep_dispatch.base import Dispatcher, DispatchHandle, ExpertsClient
from ep_dispatch.registry import BackendContext, available_backends, create_experts_client

__all__ = ["BackendContext", "DispatchHandle", "Dispatcher", "ExpertsClient",
           "available_backends", "create_experts_client"]
