"""All-to-all between attention ranks and expert ranks: `dispatch` tokens, `combine` outputs.

Backends are chosen by name with `ep_dispatch.registry.create_experts_client`; the
interface they share is in `ep_dispatch.base`. Nothing is imported here, so that the
placement and the backends' names and settings can be checked without torch.

Its modules: `base` (the `ExpertsClient` interface, and its optional capabilities as
protocols: `Pipelined`, whose calls start and finish apart, and `Movable`, whose experts
move while serving), `placement` (expert to ranks, replicas), `eplb` (DeepSeek's load
balancer: a placement from measured load), `layout` (the one `Layout` of a layer call, every
backend's, `local`'s included), `wire` (tensors and MXFP4 rows on the wire), `registry` (the
backends by name), the backends `local`, `rpc` (with `rpc_pool` and `rpc_server`),
`torch_dist`, `nccl` and `deepep` (with `deepep_config`), and `metrics` (dispatch and
combine histograms and spans).
"""
