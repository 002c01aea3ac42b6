"""The gateway's readiness check, engine side: a request whose one step computes on every
expert rank (`GenerateRequest.warmup`). Its prompt is made here, and its rows are routed
by position instead of by the router, so that every replica of every expert gets a row.

The prompt is ceil(E / K) x R positions long (E experts, top-k K, R the most replicas of any
expert). R rows in a row share K experts, so the layout gives each replica of each expert a
row whatever turn the layer call starts at. Its KV sits under a salt no request has. Its
rows count as expert load, on the engine and on the expert services alike.

The gateway sends it on each new connection (`EngineClient.keep_warm`), like vLLM's start-up
dummy run. `/health` answers 503 ("warming up ...") until every group's warm-up has come
back. A failed warm-up makes it answer with the warm-up's error, and is retried every 2 s
while connected. Compose's
gateway healthcheck (`switchyard probe .../health`) means the same.
"""

from __future__ import annotations

import torch

from services.attention.scheduler import ScheduledSeq
from services.model.config import ModelConfig


def warmup_prompt(cfg: ModelConfig, replicas: int, max_model_len: int) -> list[int]:
    """ceil(E / K) * R positions of token ids every vocabulary has. `warmup_routing`
    reaches every expert replica with them. There is at least one position, and fewer if
    the context is shorter. `replicas` is R, the most expert ranks one expert is on."""
    n = -(-cfg.num_experts // cfg.top_k) * replicas
    return [t % cfg.vocab_size for t in range(max(1, min(n, max_model_len - 1)))]


def warmup_routing(scheduled: list[ScheduledSeq], cfg: ModelConfig, replicas: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The warm-up sequences' rows of this step [W] int64, and their experts [W, K] int64.
    Position p takes experts (p // R) * K + j (mod E), so R rows in a row share K experts,
    and a layout gives consecutive rows consecutive replicas (`compute_layout`)."""
    rows: list[int] = []
    positions: list[int] = []
    first = 0
    for item in scheduled:
        if item.seq.warmup:
            start = item.seq.num_computed_tokens
            rows += range(first, first + item.num_new_tokens)
            positions += range(start, start + item.num_new_tokens)
        first += item.num_new_tokens
    group = torch.tensor(positions, dtype=torch.int64) // replicas  # [W]
    experts = (group[:, None] * cfg.top_k + torch.arange(cfg.top_k)) % cfg.num_experts
    return torch.tensor(rows, dtype=torch.int64), experts  # [W], [W, K]
