"""A set of experts of every MoE layer, loaded from the checkpoint, and their grouped FFN."""

from __future__ import annotations

from collections.abc import Sequence

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


class ExpertBank:
    """The experts `expert_ids` (global ids, ascending) of every MoE layer.

    Weights per MoE layer: w_gate_up [E_local, 2 * I, H] and w_down [E_local, H, I].
    """

    def __init__(
        self, config: ModelConfig, checkpoint: Checkpoint, expert_ids: Sequence[int],
        dtype: torch.dtype,
    ) -> None:
        self.expert_ids = list(expert_ids)
        self.w_gate_up: dict[int, torch.Tensor] = {}
        self.w_down: dict[int, torch.Tensor] = {}
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        for layer, is_moe in enumerate(config.moe_layers):
            if not is_moe:
                continue
            gate_up, down = [], []
            for expert in self.expert_ids:
                g, u, d = expert_tensor_names(config, layer, expert)
                gate_up.append(torch.cat([checkpoint.get(g, (inter, hidden), dtype),
                                          checkpoint.get(u, (inter, hidden), dtype)]))
                down.append(checkpoint.get(d, (hidden, inter), dtype))
            self.w_gate_up[layer] = torch.stack(gate_up)
            self.w_down[layer] = torch.stack(down)

    def forward(self, layer: int, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """Expert FFN of x [N, H] grouped by local expert -> [N, H] (router weights not applied)."""
        return grouped_swiglu(x, tokens_per_expert, self.w_gate_up[layer], self.w_down[layer])

    def nbytes(self) -> int:
        tensors = [*self.w_gate_up.values(), *self.w_down.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
