"""Everything of the model except the experts: embeddings, attention, norms, router gates,
dense MLPs, lm_head. Expert FFNs are reached through an `ExpertsClient`."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from dcp.batch import StepBatch
from ep_dispatch.base import Exchange, ExpertsClient
from moe_kernels.cpu_kernels import cpu_kernels
from moe_kernels.selection import DenseWeight, linear, panels_for_cpu
from services.attention.kv_cache import KVCache
from services.attention.mla import (
    MLACache,
    MLAWeights,
    Panels,
    compiled_mla_block,
    load_mla,
    mla_queries,
    panel_args,
)
from services.attention.router import route
from services.attention.timeline import FINAL, StepTimeline
from services.attention.weights import WeightReader
from services.model.config import ModelConfig
from services.model.layers import qkv_heads, rms_norm, rope_cos_sin

Attend = Callable[[KVCache, int, torch.Tensor, StepBatch], torch.Tensor]
# (layer, x [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H]: an `ExpertsClient`, or
# `LocalExperts.on_device` inside a CUDA graph
MoE = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


Weight = DenseWeight  # a linear's, in the layout its kernel reads


@dataclass(frozen=True)
class LayerWeights:
    """One layer's weights. The linears are [out, in], in the layout of the dense scheme's
    kernel (`WeightReader`); on the CPU that is float32 or int8 panels. The router's linear
    is the exception: it stays float."""

    input_norm: torch.Tensor  # [H]
    post_attn_norm: torch.Tensor  # [H]
    qkv: Weight | None  # [(heads + 2 * kv_heads) * D, H], q, k, v stacked; None with MLA
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * D] (Qwen2-MoE)
    mla: MLAWeights | None  # DeepSeek's latent attention, instead of qkv
    o: Weight  # [H, heads * D], or [H, heads * v_head_dim] with MLA
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None  # [D]
    gate: Weight | None  # [E, H] router, for MoE layers
    gate_bias: torch.Tensor | None  # [E] float32, DeepSeek-V3's e_score_correction_bias
    mlp_gate_up: Weight | None  # [2I, H], for dense layers
    mlp_down: Weight | None  # [H, I]
    shared_gate_up: Weight | None  # [2 I_s, H], a MoE layer's shared experts
    shared_down: Weight | None  # [H, I_s]
    shared_gate: Weight | None  # [1, H], Qwen2-MoE's sigmoid gate on them


def load_layer(read: WeightReader, cfg: ModelConfig, i: int) -> LayerWeights:
    p = f"model.layers.{i}"
    h, d = cfg.hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d

    def get(name: str, *shape: int, as_dtype: torch.dtype | None = None) -> torch.Tensor:
        return read.get(f"{p}.{name}", *shape, as_dtype=as_dtype)

    def linear(*parts: tuple[str, int, int]) -> Weight:
        return read.linear(*((f"{p}.{name}", n, k) for name, n, k in parts))

    def mlp(prefix: str, inter: int) -> tuple[Weight, Weight]:
        return (linear((f"{prefix}.gate_proj.weight", inter, h),
                       (f"{prefix}.up_proj.weight", inter, h)),
                linear((f"{prefix}.down_proj.weight", h, inter)))

    # An MTP layer, i >= num_layers, is DeepSeek's MoE block.
    dense, mla = i < cfg.num_layers and not cfg.moe_layers[i], cfg.mla
    gate_up, down = mlp("mlp", cfg.intermediate_size) if dense else (None, None)
    shared = cfg.shared_experts if not dense else None
    s_gate_up, s_down = mlp(shared.prefix, shared.intermediate_size) if shared else (None, None)
    # DeepSeek's routers, the only ones with a `Routing` of their own, run in float32
    # whatever the model's dtype, as transformers' routers do.
    gate_dtype = torch.float32 if cfg.routing is not None else read.dtype
    return LayerWeights(
        input_norm=get("input_layernorm.weight", h),
        post_attn_norm=get("post_attention_layernorm.weight", h),
        qkv=None if mla else linear(("self_attn.q_proj.weight", q_rows, h),
                                    ("self_attn.k_proj.weight", kv_rows, h),
                                    ("self_attn.v_proj.weight", kv_rows, h)),
        qkv_bias=torch.cat([get("self_attn.q_proj.bias", q_rows),
                            get("self_attn.k_proj.bias", kv_rows),
                            get("self_attn.v_proj.bias", kv_rows)]) if cfg.qkv_bias else None,
        mla=load_mla(read, p, cfg) if mla else None,
        o=linear(("self_attn.o_proj.weight", h,
                  cfg.num_heads * mla.v_head_dim if mla else q_rows)),
        q_norm=get("self_attn.q_norm.weight", d) if cfg.qk_norm else None,
        k_norm=get("self_attn.k_norm.weight", d) if cfg.qk_norm else None,
        # the router stays float: its top-k is what an error there would change
        gate=None if dense else panels_for_cpu(
            get(f"{cfg.expert_prefix}.gate.weight", cfg.num_experts, h, as_dtype=gate_dtype),
            pad=True),
        gate_bias=get("mlp.gate.e_score_correction_bias", cfg.num_experts,
                      as_dtype=torch.float32)
        if not dense and cfg.routing and cfg.routing.method == "noaux_tc" else None,
        mlp_gate_up=gate_up,
        mlp_down=down,
        shared_gate_up=s_gate_up,
        shared_down=s_down,
        shared_gate=panels_for_cpu(get("mlp.shared_expert_gate.weight", 1, h), pad=True)
        if shared and shared.gated else None,
    )


def in_panels(w: LayerWeights) -> bool:
    """Whether the layer's attention weights are all in the CPU kernels' panels, float32
    or int8, with no q/k/v bias. The compiled attention block reads them that way."""
    if w.mla is not None:
        m = w.mla
        return all(isinstance(x, Panels) for x in (m.qkv_a, m.w_uk, m.w_uv, w.o)) \
            and (m.q_b is None or isinstance(m.q_b, Panels))
    return isinstance(w.qkv, Panels) and isinstance(w.o, Panels) and w.qkv_bias is None


def _swiglu(x: torch.Tensor, gate_up: Weight, down: Weight) -> torch.Tensor:
    """A SwiGLU MLP of x [T, H] -> [T, H] (gate_up [2I, H], down [H, I])."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)  # 2 x [T, I]
    return linear(F.silu(gate) * up, down)


def shared_experts(w: LayerWeights, x: torch.Tensor) -> torch.Tensor | None:
    """The layer's shared experts over x [T, H] -> [T, H], or None if it has none. They run
    here, not on the expert services: every token needs them, so dispatching them would
    send each row once more per layer and balance nothing (`services.model.families`)."""
    if w.shared_gate_up is None or w.shared_down is None:
        return None
    y = _swiglu(x, w.shared_gate_up, w.shared_down)
    if w.shared_gate is not None:  # Qwen2-MoE
        y = torch.sigmoid(linear(x, w.shared_gate)) * y
    return y


class DenseModel:
    """The attention service's share of the model, run over one `StepBatch` at a time."""

    def __init__(self, cfg: ModelConfig, read: WeightReader, attend: Attend | None = None
                 ) -> None:
        self.cfg = cfg
        # Paged attention over this process's KV cache, or a DCP group's sharded one.
        self.attend: Attend = attend or (lambda kv, layer, q, batch: kv.attend(layer, q, batch))
        self._own_cache = attend is None  # every key is here, so the compiled block may run
        self.dtype, self.dense_quantization = read.dtype, read.scheme
        h = cfg.hidden_size

        # Embeddings stay float, since a token reads only one row.
        self.embed = read.get("model.embed_tokens.weight", cfg.vocab_size, h)
        self.layers = [load_layer(read, cfg, i) for i in range(cfg.num_layers)]
        self.norm = read.get("model.norm.weight", h)
        tied = cfg.tie_word_embeddings and "lm_head.weight" not in read.ckpt
        # When tied, the panels on the CPU are a second copy of the embeddings.
        self.lm_head = read.layout(self.embed) if tied \
            else read.linear(("lm_head.weight", cfg.vocab_size, h))
        # Routed token copies per (layer, expert) since start: what operators balance on.
        # Counted on the device without a host sync; `publish_load()` reads it between steps.
        # Where the MTP layers draft, their rows are counted too.
        self._load = torch.zeros(cfg.num_layers + cfg.mtp_layers, cfg.num_experts,
                                 dtype=torch.int64, device=read.device)
        self.expert_load = self._load.cpu()
        self._panels = all(in_panels(w) for w in self.layers)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: KVCache, experts: ExpertsClient | MoE
                ) -> torch.Tensor:
        """Hidden states [T, H] after the final norm, for the batch's T tokens."""
        run = self._layers(batch, kv)
        try:
            call = next(run)
            while True:
                call = run.send(experts(*call))
        except StopIteration as done:
            return done.value

    @torch.inference_mode()
    def forward_pipelined(self, batches: list[StepBatch], kv: KVCache,
                          start: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor],
                                          Exchange],
                          timeline: StepTimeline | None = None) -> list[torch.Tensor]:
        """`forward` of several micro-batches, of disjoint sequences, as a ping-pong
        pipeline.

        Each micro-batch runs its layers up to its next MoE layer, starts that exchange with
        `start`, which sends the rows out to the experts, and gives way to the next. So one
        micro-batch's attention runs while the experts compute another's layer. Exchanges
        finish in the order they started. Returns each batch's hidden states [T_j, H].
        `timeline` gets each micro-batch's computing and exchange intervals.
        """
        runs = [self._layers(b, kv) for b in batches]
        out: list[torch.Tensor | None] = [None] * len(runs)
        waiting: deque[tuple[int, int, float, Exchange]] = deque()  # j, layer, sent, call
        timeline = StepTimeline() if timeline is None else timeline

        def advance(j: int, moe: torch.Tensor | None) -> None:
            began = time.perf_counter()
            try:
                call = next(runs[j]) if moe is None else runs[j].send(moe)
            except StopIteration as done:
                out[j] = done.value
                timeline.add("attention", j, FINAL, began)
                return
            sent = timeline.add("attention", j, call[0], began)
            waiting.append((j, call[0], sent, start(*call)))

        try:
            for j in range(len(runs)):
                advance(j, None)
            while waiting:
                j, layer, sent, exchange = waiting.popleft()
                moe = exchange.finish()
                timeline.add("exchange", j, layer, sent, exchange.held_s)
                advance(j, moe)
        except BaseException:
            for *_, exchange in waiting:  # read the calls in flight, so the connections stay
                with contextlib.suppress(Exception):  # in step for the next one
                    exchange.finish()
            raise
        return [h for h in out if h is not None]

    def _layers(self, batch: StepBatch, kv: KVCache
                ) -> Generator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor],
                               torch.Tensor, torch.Tensor]:
        """The layers over one batch.

        Yields each MoE layer's call, (layer, x [T, H], topk_ids [T, K], topk_weights
        [T, K]), and takes its output [T, H] back. Returns the hidden states [T, H] after
        the final norm.
        """
        cos, sin = rope_cos_sin(batch.positions, self.cfg.rope_dim, self.cfg.rope_theta,
                                self.dtype, self.cfg.rope)
        h = self.embed[batch.input_ids]  # [T, H]
        # what each routed copy adds to the load counts: 1, or 0 for a graph's padding rows
        rows = torch.ones_like(batch.input_ids) if batch.real_rows is None else batch.real_rows
        counted = rows.repeat_interleave(self.cfg.top_k)  # [T*K] int64
        forced = batch.forced_routing  # a warm-up's; its rows count as load, as they ran
        compiled = self.compiled_block(h, batch)
        routing = self.cfg.routing_spec
        for i, w in enumerate(self.layers):
            h, x = self.attention_block(i, w, h, cos, sin, batch, kv, compiled)
            if w.gate is None:
                h = h + _swiglu(x, w.mlp_gate_up, w.mlp_down)  # type: ignore[arg-type]
            else:
                ids, weights = route(x, w.gate, routing, w.gate_bias)
                if forced is not None:
                    ids = ids.index_put((forced[0],), forced[1])
                flat = ids.reshape(-1)  # [T*K]
                self._load[i].index_add_(0, flat, counted)
                shared = shared_experts(w, x)  # [T, H] or None
                routed = yield i, x, ids, weights
                h = h + (routed if shared is None else routed + shared)
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps)

    def attention_block(
        self, i: int, w: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        batch: StepBatch, kv: KVCache, compiled: ModuleType | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's attention block over the residual stream h [T, H].

        Returns h plus the attention's output [T, H], and that sum RMSNorm'd for the MLP or
        MoE [T, H]. Where `compiled` (from `compiled_block`) is given, the block is one
        compiled call, with the same bits.
        """
        cfg, t, eps = self.cfg, h.shape[0], self.cfg.rms_norm_eps
        if compiled is not None and w.mla is not None:  # weights in panels (`compiled_block`)
            return compiled_mla_block(compiled, cfg, w.mla, (w.input_norm, w.o,
                                                             w.post_attn_norm),
                                      h, cos, sin, kv.k[i], batch)
        if compiled is not None:  # every qkv and o in panels (`compiled_block`)
            return compiled.attention_block_f32(
                h, w.input_norm, *panel_args(w.qkv), w.q_norm, w.k_norm, cos, sin, kv.k[i],
                kv.v[i], batch.slot_mapping, batch.decode_kv_slots, batch.decode_mask,
                *panel_args(w.o), w.post_attn_norm, cfg.num_heads, cfg.num_kv_heads, eps,
                cfg.attention_scale)
        x = rms_norm(h, w.input_norm, eps)
        if w.mla is not None:
            q, rows = mla_queries(cfg, w.mla, x, cos, sin)  # rows [T, 1, C + R]
            kv.write(i, rows, None, batch.slot_mapping, batch.foreign_slots)
            latent = MLACache(kv, cfg, w.mla)
            values = self.attend(latent, i, q, batch).reshape(t, -1)  # type: ignore[arg-type]
        else:
            qkv = linear(x, w.qkv)  # type: ignore[arg-type]
            qkv = qkv if w.qkv_bias is None else qkv + w.qkv_bias
            q, k, v = qkv_heads(qkv, w.q_norm, w.k_norm, cos, sin, cfg.num_heads,
                                cfg.num_kv_heads, eps)  # [T, heads|kv, D]
            kv.write(i, k, v, batch.slot_mapping, batch.foreign_slots)
            values = self.attend(kv, i, q, batch).reshape(t, -1)  # [T, heads * D]
        h = h + linear(values, w.o)
        return h, rms_norm(h, w.post_attn_norm, eps)

    def compiled_block(self, h: torch.Tensor, batch: StepBatch) -> ModuleType | None:
        """The CPU kernels, where a step's attention blocks may run as one call each; else
        None. That needs a decode step over this process's own cache, with float32 weights in
        panels. At a decode step's few rows, the Python between the kernels costs more than
        their arithmetic."""
        if not self._own_cache or h.device.type != "cpu" or h.dtype != torch.float32 \
                or batch.prefills or batch.foreign_slots \
                or batch.decode_rows.numel() != h.shape[0] or not self._panels \
                or self.cfg.head_dim % 16:  # head_dim must fill the compiled attention's vectors
            return None
        return cpu_kernels()

    def count_load(self, layer: int, ids: torch.Tensor) -> None:
        """Count routed copies ids [T, K] of `layer`, an MTP layer's when drafting."""
        self._load[layer].index_add_(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1)))

    def publish_load(self) -> None:
        """Copy the routing counts to the host (`expert_load`), after a step synchronised."""
        self.expert_load = self._load.cpu()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [S, V] of hidden rows [S, H]."""
        return linear(hidden, self.lm_head).float()
