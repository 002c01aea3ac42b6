"""All-to-all between attention ranks and expert ranks: `dispatch` tokens, `combine` outputs.

Backends are chosen by name with `ep_dispatch.registry.create_experts_client`; the
interface they share is in `ep_dispatch.base`. Nothing is imported here, so that the
placement and the backends' names and settings can be checked without torch.
"""
