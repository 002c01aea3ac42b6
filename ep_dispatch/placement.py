"""Which expert ranks hold which experts, per MoE layer.

A placement maps each (layer, expert) to one or more expert ranks. Replicas share an
expert's tokens: a routed row goes to replica `(first + token_index) % num_replicas`, where
each client moves `first` on from call to call, so load splits evenly, also for decode
steps of one token. The default is balanced round-robin; an operator can load a
JSON file instead to pin hot experts or add replicas:

    {"num_ranks": 2, "layers": {"0": [[0], [1], [0, 1], ...], "1": [...]}}

`layers[str(layer)][expert]` lists the ranks holding that expert.

`--expert-replicas R` puts each expert on R consecutive ranks of the round-robin. A JSON
file (`--placement`) pins experts and adds replicas, and `switchyard placement` prints the
placement a deployment would use. `switchyard placement --load URL|FILE
--num-redundant-experts R` makes one from measured load. The routing counts of a running
server's `/stats`, or a file of them, go through DeepSeek's EPLB (`ep_dispatch.eplb`). EPLB
is hierarchical over `--num-nodes` where the nodes divide the model's expert groups. The
placement it prints is what `--placement` loads. An expert with two copies on one rank is
listed there twice, and that rank takes twice the share of its rows.

Every attention and expert service of a deployment must be started with the same placement;
expert services read only their share of the checkpoint's tensors. With replicas, the `rpc`
backend routes around a lost expert rank. `/health` stays 200, with that rank's line saying
so, until the rank, restarted by compose or by `serve`, answers a probe; its expert lines
are read live from each group. The lockstep backends cannot route around a rank, because
their collectives need every rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only the routing tables are tensors: `switchyard serve` checks
    import torch  # placements without torch


class PlacementError(ValueError):
    pass


@dataclass(frozen=True)
class RoutingTable:
    """One layer's lookup tensors for vectorised dispatch.

    replica_ranks: [E, R_max], each expert's ranks, short lists padded by repeating.
    num_replicas: [E].
    local_index: [num_ranks, E], the position among the rank's experts, -1 if absent.
    num_local: per rank, the experts it holds.
    """

    replica_ranks: torch.Tensor
    num_replicas: torch.Tensor
    local_index: torch.Tensor
    num_local: list[int]


@dataclass(frozen=True)
class Placement:
    num_ranks: int
    num_experts: int
    replicas: dict[int, tuple[tuple[int, ...], ...]]  # layer -> expert -> ranks

    @classmethod
    def balanced(cls, moe_layers: list[int], num_experts: int, num_ranks: int,
                 replicas: int = 1) -> Placement:
        """Expert e on ranks e % N, (e + 1) % N, ..., `replicas` of them, in every layer.
        Each rank holds as many experts as another, give or take one."""
        if num_ranks < 1:
            raise PlacementError(f"need at least one expert rank, got {num_ranks}")
        if not 1 <= replicas <= num_ranks:
            raise PlacementError(f"--expert-replicas must be 1..{num_ranks} (the expert ranks), "
                                 f"got {replicas}")
        per_layer = tuple(tuple((e + i) % num_ranks for i in range(replicas))
                          for e in range(num_experts))
        return cls(num_ranks, num_experts, dict.fromkeys(moe_layers, per_layer))

    @classmethod
    def from_json(cls, text: str, moe_layers: list[int], num_experts: int,
                  source: str = "placement") -> Placement:
        try:
            raw = json.loads(text)
            num_ranks = int(raw["num_ranks"])
            layers = {int(k): tuple(tuple(int(r) for r in ranks) for ranks in v)
                      for k, v in raw["layers"].items()}
        except (ValueError, KeyError, TypeError) as exc:
            raise PlacementError(f"{source}: not a placement ({exc!r})") from exc
        placement = cls(num_ranks, num_experts, layers)
        placement.validate(moe_layers, source)
        return placement

    @classmethod
    def load(cls, path: str | Path, moe_layers: list[int], num_experts: int) -> Placement:
        return cls.from_json(Path(path).read_text(), moe_layers, num_experts, str(path))

    def validate(self, moe_layers: list[int], source: str = "placement") -> None:
        """Every expert of every MoE layer on at least one existing rank, and nothing else."""
        if sorted(self.replicas) != sorted(moe_layers):
            raise PlacementError(f"{source}: covers layers {sorted(self.replicas)}, the model's "
                                 f"MoE layers are {sorted(moe_layers)}")
        for layer, experts in self.replicas.items():
            if len(experts) != self.num_experts:
                raise PlacementError(f"{source}: layer {layer} lists {len(experts)} experts, "
                                     f"the model has {self.num_experts}")
            for expert, ranks in enumerate(experts):
                if not ranks:
                    raise PlacementError(f"{source}: layer {layer} expert {expert} is unplaced")
                bad = [r for r in ranks if not 0 <= r < self.num_ranks]
                if bad:
                    raise PlacementError(f"{source}: layer {layer} expert {expert} on rank(s) "
                                         f"{bad}, but there are {self.num_ranks} ranks")

    def excluding(self, ranks: frozenset[int]) -> Placement | None:
        """This placement without `ranks`, the lost expert ranks, if every expert keeps a
        replica; else None. The other ranks keep their experts, in the same local order."""
        replicas = {layer: tuple(tuple(r for r in ranks_of if r not in ranks)
                                 for ranks_of in experts)
                    for layer, experts in self.replicas.items()}
        if any(not ranks_of for experts in replicas.values() for ranks_of in experts):
            return None
        return Placement(self.num_ranks, self.num_experts, replicas)

    def to_json(self) -> str:
        return json.dumps({"num_ranks": self.num_ranks, "layers": {
            str(layer): [list(r) for r in experts] for layer, experts in
            sorted(self.replicas.items())}})

    def local_experts(self, rank: int) -> dict[int, list[int]]:
        """layer -> ascending global ids of the experts `rank` holds."""
        return {layer: [e for e, ranks in enumerate(experts) if rank in ranks]
                for layer, experts in self.replicas.items()}

    @cached_property
    def _tables(self) -> dict[int, RoutingTable]:
        return {layer: self._table(layer) for layer in self.replicas}

    def _table(self, layer: int) -> RoutingTable:
        import torch

        experts = self.replicas[layer]
        width = max(len(r) for r in experts)
        local_index = torch.full((self.num_ranks, self.num_experts), -1, dtype=torch.int64)
        held = []
        for rank in range(self.num_ranks):
            mine = [e for e, ranks in enumerate(experts) if rank in ranks]
            local_index[rank, mine] = torch.arange(len(mine))
            held.append(len(mine))
        return RoutingTable(
            replica_ranks=torch.tensor([[r[i % len(r)] for i in range(width)]
                                        for r in experts]),
            num_replicas=torch.tensor([len(r) for r in experts]),
            local_index=local_index, num_local=held)

    def table(self, layer: int, device: torch.device | None = None) -> RoutingTable:
        """Lookup tensors for vectorised dispatch of `layer`. They are built once, and
        copied once to `device` if given."""
        table = self._tables[layer]
        if device is None or device.type == "cpu":
            return table
        key = (layer, str(device))
        if key not in self._device_tables:
            self._device_tables[key] = RoutingTable(
                table.replica_ranks.to(device), table.num_replicas.to(device),
                table.local_index.to(device), table.num_local)
        return self._device_tables[key]

    @cached_property
    def _device_tables(self) -> dict[tuple[int, str], RoutingTable]:
        return {}

    @property
    def max_replicas(self) -> int:
        """The most ranks that hold one expert."""
        return max(len(ranks) for experts in self.replicas.values() for ranks in experts)

    @property
    def most_local(self) -> int:
        """The most experts one rank holds in one MoE layer."""
        return max(max(t.num_local) for t in self._tables.values())

    def describe(self) -> str:
        """Human-readable: per rank, the experts it holds in each layer."""
        lines = [f"{self.num_ranks} expert rank(s), {self.num_experts} experts per MoE layer"]
        for rank in range(self.num_ranks):
            held = self.local_experts(rank)
            same = len({tuple(v) for v in held.values()}) == 1
            if same and held:
                lines.append(f"  rank {rank}: experts {next(iter(held.values()))} "
                             f"in every MoE layer")
            else:
                lines += [f"  rank {rank} layer {layer}: experts {experts}"
                          for layer, experts in sorted(held.items())]
        return "\n".join(lines)


def make_placement(moe_layers: list[int], num_experts: int, num_ranks: int,
                   path: str | Path | None = None, replicas: int = 1) -> Placement:
    """The placement file at `path`, checked against `num_ranks`. Without a path, a
    balanced placement with `replicas` of each expert."""
    if path is None:
        return Placement.balanced(moe_layers, num_experts, num_ranks, replicas)
    if replicas != 1:
        raise PlacementError(f"{path}: a placement file lists its own replicas; give it or "
                             f"--expert-replicas, not both")
    placement = Placement.load(path, moe_layers, num_experts)
    if placement.num_ranks != num_ranks:
        raise PlacementError(f"{path}: places experts on {placement.num_ranks} ranks, "
                             f"but there are {num_ranks} expert services")
    return placement
