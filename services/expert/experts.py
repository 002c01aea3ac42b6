"""A set of experts of every MoE layer, loaded from the checkpoint, and their grouped FFN."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moe_kernels.grouped_gemm import grouped_swiglu
from services.model.checkpoint import Checkpoint
from services.model.config import ModelConfig

# Per-architecture names of (gate, up, down) inside one expert.
_PROJ_NAMES = {
    "Qwen3MoeForCausalLM": ("gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("w1", "w3", "w2"),
}


def expert_tensor_names(config: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    base = f"model.layers.{layer}.{config.expert_prefix}.experts.{expert}"
    return tuple(f"{base}.{proj}.weight" for proj in _PROJ_NAMES[config.architecture])


def all_experts(config: ModelConfig) -> dict[int, list[int]]:
    """Every expert of every MoE layer (what the in-process `local` backend holds)."""
    return {layer: list(range(config.num_experts))
            for layer, is_moe in enumerate(config.moe_layers) if is_moe}


class ExpertBank:
    """Some experts of every MoE layer: `experts[layer]` lists global ids, ascending.

    Weights per MoE layer: w_gate_up [E_local, 2 * I, H] and w_down [E_local, H, I]. Only
    these experts' tensors are read from the checkpoint.
    """

    def __init__(
        self, config: ModelConfig, checkpoint: Checkpoint, experts: Mapping[int, Sequence[int]],
        dtype: torch.dtype,
    ) -> None:
        self.experts = {layer: list(ids) for layer, ids in experts.items()}
        self.dtype = dtype
        self.hidden_size = config.hidden_size
        self.w_gate_up: dict[int, torch.Tensor] = {}
        self.w_down: dict[int, torch.Tensor] = {}
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        for layer, expert_ids in self.experts.items():
            if not expert_ids:
                continue
            gate_up, down = [], []
            for expert in expert_ids:
                g, u, d = expert_tensor_names(config, layer, expert)
                gate_up.append(torch.cat([checkpoint.get(g, (inter, hidden), dtype),
                                          checkpoint.get(u, (inter, hidden), dtype)]))
                down.append(checkpoint.get(d, (hidden, inter), dtype))
            self.w_gate_up[layer] = torch.stack(gate_up)
            self.w_down[layer] = torch.stack(down)

    def forward(self, layer: int, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """Expert FFN of x [N, H] grouped by local expert -> [N, H] (router weights not applied)."""
        if x.shape[0] == 0:
            return x
        return grouped_swiglu(x, tokens_per_expert, self.w_gate_up[layer], self.w_down[layer])

    def nbytes(self) -> int:
        tensors = [*self.w_gate_up.values(), *self.w_down.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
