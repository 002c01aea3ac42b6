"""DeepSeek's expert-parallelism load balancer (EPLB): redundant copies of the heaviest
experts, packed onto ranks so that each rank's expected load is as even as it can be.

Ported from `eplb.py` of github.com/deepseek-ai/EPLB (MIT License, Copyright (c) 2025
DeepSeek), which is a module, not a package one can depend on. The algorithm and its
outputs are unchanged; tests/ep_dispatch/test_eplb.py runs its README's example.

- `replicate_experts`: each redundant slot goes, one at a time, to the expert whose load
  per copy is the highest.
- `balanced_packing`: items, heaviest first, go to the lightest pack that has room, every
  pack taking the same number of items.
- The policy is hierarchical where the nodes divide the expert groups: groups are packed
  onto nodes, then replicated within a node, then packed onto the node's ranks.
  Group-limited routing then keeps a token's traffic inside few nodes. Otherwise the policy
  is global, as for one node of one group.
"""

from __future__ import annotations

import torch

from ep_dispatch.placement import Placement, PlacementError


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack each row's n weighted items into `num_packs` packs of n / num_packs items each,
    the packs' weights as even as the greedy rule makes them.

    Args:
        weight: [X, n] each item's weight; n is a multiple of num_packs.

    Returns:
        pack_index [X, n] int64: each item's pack; rank_in_pack [X, n] int64: its position
        in the pack.
    """
    rows, n = weight.shape
    assert n % num_packs == 0
    per_pack = n // num_packs
    if per_pack == 1:
        return (torch.arange(n, dtype=torch.int64).expand(weight.shape).clone(),
                torch.zeros(weight.shape, dtype=torch.int64))
    order = weight.float().sort(-1, descending=True).indices
    pack_index = torch.full(weight.shape, -1, dtype=torch.int64)
    rank_in_pack = torch.full(weight.shape, -1, dtype=torch.int64)
    for i in range(rows):
        loads, counts = [0.0] * num_packs, [0] * num_packs
        for item in order[i].tolist():
            pack = min((p for p in range(num_packs) if counts[p] < per_pack),
                       key=loads.__getitem__)
            pack_index[i, item], rank_in_pack[i, item] = pack, counts[pack]
            loads[pack] += float(weight[i, item])
            counts[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_physical: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Make `num_physical` copies of each row's experts, one each first, the rest one at a
    time to the expert with the highest load per copy.

    Args:
        weight: [X, num_logical] each expert's load.

    Returns:
        phy2log [X, num_physical]: each copy's expert; rank [X, num_physical]: which copy
        of its expert it is; count [X, num_logical]: each expert's copies.
    """
    rows, num_logical = weight.shape
    assert num_physical >= num_logical
    phy2log = torch.arange(num_physical, dtype=torch.int64).repeat(rows, 1)
    rank = torch.zeros(rows, num_physical, dtype=torch.int64)
    count = torch.ones(rows, num_logical, dtype=torch.int64)
    every = torch.arange(rows, dtype=torch.int64)
    for i in range(num_logical, num_physical):
        heaviest = (weight / count).max(dim=-1).indices  # [X]
        phy2log[:, i] = heaviest
        rank[:, i] = count[every, heaviest]
        count[every, heaviest] += 1
    return phy2log, rank, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    return inv.scatter_(1, perm, torch.arange(perm.size(1), dtype=torch.int64)
                        .expand(perm.shape))


def rebalance_hierarchical(weight: torch.Tensor, num_physical: int, num_groups: int,
                           num_nodes: int, num_ranks: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EPLB's hierarchical policy; `rebalance_experts` documents the arguments. Returns
    phy2log [L, num_physical], each copy's replica rank [L, num_physical], and each
    expert's copies [L, E]."""
    layers, experts = weight.shape
    group_size, groups_per_node = experts // num_groups, num_groups // num_nodes
    per_rank = num_physical // num_ranks
    # 1: expert groups onto nodes
    group_load = weight.unflatten(-1, (num_groups, group_size)).sum(-1)  # [L, groups]
    group_pack, group_rank = balanced_packing(group_load, num_nodes)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size).unsqueeze(-1)
                + torch.arange(group_size, dtype=torch.int64)).flatten(-2)  # [L, E]
    mlog2log = _inverse(log2mlog)
    # 2: copies within each node, [L * nodes, E / nodes]
    node_load = weight.gather(-1, mlog2log).view(-1, experts // num_nodes)
    phy2mlog, phy_rank, mlog_count = replicate_experts(node_load, num_physical // num_nodes)
    # 3: copies onto the node's ranks
    copy_load = (node_load / mlog_count).gather(-1, phy2mlog)
    pack, in_pack = balanced_packing(copy_load, num_ranks // num_nodes)
    pphy2phy = _inverse(pack * per_rank + in_pack)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    pphy2mlog = (pphy2mlog.view(layers, num_nodes, -1) + torch.arange(
        0, experts, experts // num_nodes).view(1, -1, 1)).flatten(-2)
    return (mlog2log.gather(-1, pphy2mlog), phy_rank.gather(-1, pphy2phy).view(layers, -1),
            mlog_count.view(layers, -1).gather(-1, log2mlog))


def rebalance_experts(weight: torch.Tensor, num_physical: int, num_groups: int,
                      num_nodes: int, num_ranks: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EPLB's entry point.

    Args:
        weight: [L, E] each MoE layer's expert loads, e.g. routed tokens over a window.
        num_physical: copies per layer (E plus the redundant ones), a multiple of num_ranks.
        num_groups: expert groups, DeepSeek-V3's n_group; 1 without group routing.
        num_nodes: nodes, whose ranks talk faster among themselves; divides num_ranks.
        num_ranks: expert ranks.

    Returns:
        phy2log [L, num_physical] int64: the expert of each copy, copies of rank r at
        [r * num_physical / num_ranks, (r + 1) * num_physical / num_ranks);
        log2phy [L, E, max copies] int64: each expert's copies, -1 past its count;
        count [L, E] int64: each expert's copies.
    """
    layers, experts = weight.shape
    _check(experts, num_physical, num_groups, num_nodes, num_ranks)
    weight = weight.float().cpu()
    if num_groups % num_nodes == 0:
        phy2log, rank, count = rebalance_hierarchical(weight, num_physical, num_groups,
                                                      num_nodes, num_ranks)
    else:  # the global policy
        phy2log, rank, count = rebalance_hierarchical(weight, num_physical, 1, 1, num_ranks)
    most = int(count.max())
    log2phy = torch.full((layers, experts, most), -1, dtype=torch.int64)
    log2phy.view(layers, -1).scatter_(-1, phy2log * most + rank, torch.arange(
        num_physical, dtype=torch.int64).expand(layers, -1))
    return phy2log, log2phy, count


def _check(experts: int, num_physical: int, num_groups: int, num_nodes: int,
           num_ranks: int) -> None:
    if num_ranks < 1 or num_nodes < 1 or num_ranks % num_nodes:
        raise PlacementError(f"{num_ranks} expert ranks cannot be split over {num_nodes} "
                             f"nodes")
    if num_physical < experts:
        raise PlacementError(f"{num_physical} expert copies cannot hold {experts} experts")
    if num_physical % num_ranks:
        raise PlacementError(f"{num_physical} expert copies ({experts} experts and "
                             f"{num_physical - experts} redundant) do not fill {num_ranks} "
                             f"ranks evenly: choose --num-redundant-experts so that they do")
    if num_groups < 1 or experts % num_groups:
        raise PlacementError(f"{num_groups} expert groups do not divide {experts} experts")


def placement_from_load(load: torch.Tensor, moe_layers: list[int], num_ranks: int,
                        num_redundant: int, num_groups: int = 1, num_nodes: int = 1
                        ) -> Placement:
    """The `Placement` EPLB makes from each MoE layer's expert loads `load` [L, E], rows
    in `moe_layers`' order. Every rank holds (E + num_redundant) / num_ranks copies. An
    expert with two copies on one rank is listed there twice, so that rank gets twice the
    share of that expert's rows, as EPLB's plan intends."""
    if load.dim() != 2 or load.shape[0] != len(moe_layers):
        raise PlacementError(f"the load has shape {list(load.shape)}; expected one row per "
                             f"MoE layer ({len(moe_layers)}) and one column per expert")
    if (load < 0).any():
        raise PlacementError("expert loads must not be negative")
    experts = load.shape[1]
    phy2log, _, _ = rebalance_experts(load, experts + num_redundant, num_groups, num_nodes,
                                      num_ranks)
    per_rank = (experts + num_redundant) // num_ranks
    replicas = {}
    for row, layer in enumerate(moe_layers):
        ranks: list[list[int]] = [[] for _ in range(experts)]
        for slot, expert in enumerate(phy2log[row].tolist()):
            ranks[expert].append(slot // per_rank)
        replicas[layer] = tuple(tuple(r) for r in ranks)
    return Placement(num_ranks, experts, replicas)
