"""Train the bundled demo model: a small DeepSeek-V3 (MLA, a shared expert, `noaux_tc`
group routing, one multi-token-prediction layer) that adds and subtracts integers 0..999.

    .venv/bin/python training/train_demo.py --out switchyard/models/arith-moe

CPU only, reproducible from `--seed` (a fixed number of steps, seeded data and init, torch's
deterministic CPU kernels). The model is transformers' own `DeepseekV3ForCausalLM`
(transformers is a test/dev dependency), trained on chat-formatted problems from
`switchyard.demo_task` with the loss on the answer tokens only:

- **Balance** as DeepSeek-V3 does without an auxiliary loss (report §2.1.2): after each
  step, every router's `e_score_correction_bias` moves by `--bias-update` towards its
  under-loaded experts.
- **MTP** (report §2.2): one module, saved as DeepSeek's checkpoints keep it
  (`model.layers.{num_hidden_layers}.*`: `enorm`, `hnorm`, `eh_proj`, a decoder block,
  `shared_head.norm`, `shared_head.head`, `embed_tokens`), joins the normalised final hidden
  state at position i with the embedding of token i+1 and predicts token i+2 through the
  shared head. Its loss weight is `--mtp-weight` (0.3), then `--mtp-weight-late` (0.1) for
  the last `--late-fraction` of the steps. Input layout as vLLM's `deepseek_mtp`
  (`cat([enorm(embed), hnorm(hidden)])`, the embedding at position 0 zeroed).
- **W4A4**: the last `--qat-fraction` of the steps is quantization-aware. The routed
  experts see MXFP4 weights and activations into both GEMMs, as `--quantization w4a4` serves
  them (straight-through gradients), so one checkpoint serves float32 and W4A4 alike.

Every `--eval-every` steps it prints greedy exact match on held-out problems (float32 and,
once QAT began, MXFP4) and the MTP layer's agreement with the model's own greedy tokens.
The output is a normal HF directory: config.json, model.safetensors, tokenizer.json
(byte-level, built with `tokenizers`) and tokenizer_config.json with the chat template,
plus `training_log.json` (the loss curves and evaluations).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

if TYPE_CHECKING:  # transformers is imported where used: it takes seconds
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from switchyard.demo_model import build_tokenizer
from switchyard.demo_task import Problem, draw_training, problems

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Compact on purpose: fewer tokens per example is faster training on a 2-core CPU.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
NUM_LAYERS = 4


def model_config(vocab_size: int, eos: int, bos: int) -> DeepseekV3Config:
    """The main model's config; the MTP layer is one more decoder layer of the same shape."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384,
        moe_intermediate_size=192, num_hidden_layers=NUM_LAYERS, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope_interleave=True,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, routed_scaling_factor=1.0, norm_topk_prob=True,
        topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=1,
        max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6,
        eos_token_id=eos, bos_token_id=bos, pad_token_id=bos, tie_word_embeddings=False)


class Encoder:
    def __init__(self) -> None:
        self.tok = build_tokenizer(SPECIAL_TOKENS)
        self.ids = {t: self.tok.token_to_id(t) for t in SPECIAL_TOKENS}
        self.pad, self.end = self.ids["<|endoftext|>"], self.ids["<|end|>"]

    def prompt(self, question: str) -> list[int]:
        return [self.ids["<|user|>"], *self.tok.encode(question).ids, self.ids["<|assistant|>"]]

    def answer(self, answer: str) -> list[int]:
        return [*self.tok.encode(answer).ids, self.end]


def make_batch(enc: Encoder, probs: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids [B, L] and labels [B, L] (-100 outside the answers)."""
    rows = [(enc.prompt(p.question), enc.answer(p.answer)) for p in probs]
    width = max(len(q) + len(a) for q, a in rows)
    ids = torch.full((len(rows), width), enc.pad, dtype=torch.int64)
    labels = torch.full((len(rows), width), -100, dtype=torch.int64)
    for i, (q, a) in enumerate(rows):
        ids[i, :len(q) + len(a)] = torch.tensor(q + a)
        labels[i, len(q):len(q) + len(a)] = torch.tensor(a)
    return ids, labels


class SharedHead(nn.Module):
    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        self.norm = DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)
        # A copy of lm_head, written at save time: DeepSeek's checkpoints repeat it here.
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.head.weight.requires_grad_(False)


def add_mtp_layer(model: DeepseekV3ForCausalLM, block: nn.Module | None = None) -> nn.Module:
    """Append the MTP module as decoder layer `num_hidden_layers`, so that save_pretrained
    writes it under DeepSeek's names; the main forward still runs only the first
    `num_hidden_layers` layers (it slices `layers[:num_hidden_layers]`). `block`: its
    decoder block as loaded (`load`), else a new one."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
    )

    config = model.config
    mtp = block
    if mtp is None:
        mtp = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        for module in mtp.modules():
            model._init_weights(module)
    h = config.hidden_size
    mtp.enorm = DeepseekV3RMSNorm(h, config.rms_norm_eps)
    mtp.hnorm = DeepseekV3RMSNorm(h, config.rms_norm_eps)
    mtp.eh_proj = nn.Linear(2 * h, h, bias=False)
    nn.init.normal_(mtp.eh_proj.weight, std=config.initializer_range)
    mtp.shared_head = SharedHead(config)
    # A copy of embed_tokens, written at save time, as in DeepSeek's checkpoints.
    mtp.embed_tokens = nn.Embedding(config.vocab_size, h)
    mtp.embed_tokens.weight.requires_grad_(False)
    if block is None:
        model.model.layers.append(mtp)
    return mtp


def load(path: Path) -> tuple[DeepseekV3ForCausalLM, nn.Module]:
    """A checkpoint this script saved, MTP layer included, to train on: loaded with one
    more decoder layer (transformers converts the MTP block's experts as any layer's),
    then that layer given the MTP module's own weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config.from_pretrained(path)
    n = config.num_hidden_layers
    config.num_hidden_layers = n + 1
    model = DeepseekV3ForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
    model.config.num_hidden_layers = n
    mtp = add_mtp_layer(model, block=model.model.layers[n])
    tensors = load_file(path / "model.safetensors")
    own = {name: tensors[f"model.layers.{n}.{name}"] for name in (
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
        "shared_head.head.weight", "embed_tokens.weight")}
    missing, unexpected = mtp.load_state_dict(own, strict=False)
    assert not unexpected and not [m for m in missing if m.split(".")[0] in (
        "enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")], missing
    return model, mtp


@dataclass
class Forward:
    loss: torch.Tensor  # main + weight * MTP, for backward
    main_loss: float
    mtp_loss: float
    logits: torch.Tensor  # [B, L, V] the main head's
    mtp_logits: torch.Tensor  # [B, L, V] at position i: the guess for token i+2
    chain_loss: float = 0.0
    # [B, L, V] at position j, the MTP run again on its own output at j-1 (a second
    # draft, as served for k > 1): the guess for token j+2
    chain_logits: torch.Tensor | None = None


def forward(model: DeepseekV3ForCausalLM, mtp: nn.Module, ids: torch.Tensor,
            labels: torch.Tensor, mtp_weight: float, chain_weight: float = 0.0,
            train_main: bool = True) -> Forward:
    """The main model and the MTP module over right-padded `ids` [B, L]; with
    `chain_weight`, the MTP's second pass too (`chain`), its loss weighted so; without
    `train_main`, the main model runs without gradients (the MTP alone trains)."""
    inner = model.model
    with torch.set_grad_enabled(train_main and torch.is_grad_enabled()):
        out = inner(input_ids=ids)
    hidden = out.last_hidden_state  # [B, L, H] after the final norm, as vLLM passes it
    logits = model.lm_head(hidden)  # [B, L, V]
    embed = inner.embed_tokens(ids)  # [B, L, H]
    # Position i sees token i+1's embedding (nothing after the last; position 0 zeroed).
    nxt = torch.cat([embed[:, 1:], torch.zeros_like(embed[:, :1])], dim=1)
    nxt[:, 0] = 0
    x = mtp.eh_proj(torch.cat([mtp.enorm(nxt), mtp.hnorm(hidden)], dim=-1))  # [B, L, H]
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    rope = inner.rotary_emb(x, positions)
    from transformers.masking_utils import create_causal_mask

    mask = create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=None,
                              cache=None, position_ids=positions)
    y = mtp(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
    mtp_logits = model.lm_head(mtp.shared_head.norm(y))  # [B, L, V]
    vocab = logits.shape[-1]
    main = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))
    ahead = F.cross_entropy(mtp_logits[:, :-2].reshape(-1, vocab), labels[:, 2:].reshape(-1))
    loss = (main if train_main else 0.0) + mtp_weight * ahead
    if not chain_weight:
        return Forward(loss, main.item(), ahead.item(), logits, mtp_logits)
    chain_logits = chain(inner, mtp, model.lm_head, x, y, nxt, positions)
    again = F.cross_entropy(chain_logits[:, :-2].reshape(-1, vocab), labels[:, 2:].reshape(-1))
    return Forward(loss + chain_weight * again, main.item(), ahead.item(), logits, mtp_logits,
                   again.item(), chain_logits)


def chain(inner: nn.Module, mtp: nn.Module, head: nn.Module, x: torch.Tensor,
          y: torch.Tensor, nxt: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The MTP's second pass as served for a second draft (`services/attention/spec_decode/
    mtp.py`): at position j, its own output y at j-1 [B, L, H] in place of the model's
    hidden state, token j+1's embedding (nxt), attending to the first pass's keys before j
    and its own at j (what the paged cache holds then). Run as one sequence of 2L rows,
    the first pass's inputs x [B, L, H] then the second's, under that mask. Returns the
    logits [B, L, V] of the second pass: at j, the guess for token j+2."""
    b, n, _ = y.shape
    prev = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], dim=1)  # [B, L, H]
    x2 = mtp.eh_proj(torch.cat([mtp.enorm(nxt), mtp.hnorm(prev)], dim=-1))
    both = torch.cat([x, x2], dim=1)  # [B, 2L, H]
    pos = torch.cat([positions, positions], dim=1)  # [1, 2L]
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = torch.cat([torch.cat([k <= q, torch.zeros(n, n, dtype=torch.bool)], dim=1),
                         torch.cat([k < q, torch.eye(n, dtype=torch.bool)], dim=1)])
    mask = torch.zeros(2 * n, 2 * n).masked_fill(~allowed, float("-inf"))[None, None]
    y2 = mtp(both, attention_mask=mask.expand(b, 1, -1, -1),
             position_ids=pos, position_embeddings=inner.rotary_emb(both, pos))[:, n:]
    return head(mtp.shared_head.norm(y2))


class Balancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: record each router's choices over the
    real (non-pad) tokens of a step, then nudge its `e_score_correction_bias` by `rate`
    towards the experts that got fewer than their share."""

    def __init__(self, model: nn.Module, rate: float) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.chosen: dict[int, torch.Tensor] = {}
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._record(i))

    def _record(self, i: int):  # noqa: ANN202 (a forward hook)
        def hook(_: nn.Module, __: object, out: tuple[torch.Tensor, ...]) -> None:
            self.chosen[i] = out[2].detach()  # [T, K] expert ids

        return hook

    @torch.no_grad()
    def update(self, real: torch.Tensor) -> list[float]:
        """`real` [T] marks non-pad tokens; returns each router's busiest load / fair share."""
        worst = []
        for i, router in enumerate(self.routers):
            load = torch.bincount(self.chosen[i][real].flatten(),
                                  minlength=router.num_experts).float()
            router.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            worst.append(float(load.max() / load.mean()))
        self.chosen.clear()
        return worst


def fake_mxfp4(t: torch.Tensor) -> torch.Tensor:
    """t as MXFP4 would round it (blocks of 32 along the last dimension), with the
    straight-through gradient: the forward sees the quantized values, the backward
    passes gradients through unchanged."""
    from moe_kernels.mxfp4 import dequantize, quantize

    return t + (dequantize(quantize(t.detach())) - t).detach()


QAT = {"on": False}


def patch_experts() -> None:
    """transformers' DeepSeek-V3 experts, computing what `--quantization w4a4` serves while
    QAT is on: MXFP4 weights, MXFP4 activations into both GEMMs (as gpt-oss was trained for
    its MXFP4 experts)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    def experts_forward(self: m.DeepseekV3Experts, hidden_states: torch.Tensor,
                        top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        q = fake_mxfp4 if QAT["on"] else (lambda t: t)
        out = torch.zeros_like(hidden_states)
        gate_up, down = q(self.gate_up_proj), q(self.down_proj)
        for expert in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == expert)
            gate, up = F.linear(q(hidden_states[token]), gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(q(self.act_fn(gate) * up), down[expert])  # [n, H]
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out

    m.DeepseekV3Experts.forward = experts_forward


@torch.no_grad()
def evaluate(model: DeepseekV3ForCausalLM, mtp: nn.Module, enc: Encoder, seed: int,
             n: int) -> dict[str, float | int]:
    """Greedy exact match on n held-out problems, and the MTP layer's agreement: at each
    answer position, whether its guess of the token after next equals the main model's own
    greedy token there (what speculative decoding with one draft token accepts)."""
    model.eval()
    probs = problems(seed, n)
    prompts = [enc.prompt(p.question) for p in probs]
    width, steps = max(map(len, prompts)), 6
    ids = torch.full((n, width + steps), enc.pad, dtype=torch.int64)
    lengths = torch.tensor([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    done = torch.zeros(n, dtype=torch.bool)
    for step in range(steps):  # greedy, right-padded: recompute the whole prefix (short)
        logits = model.lm_head(model.model(input_ids=ids).last_hidden_state)
        pos = lengths + step - 1
        tok = logits[torch.arange(n), pos].argmax(-1)
        tok[done] = enc.pad
        ids[torch.arange(n), pos + 1] = tok
        done |= tok == enc.end
    correct, agree, total = 0, 0, 0
    labels = torch.full_like(ids, -100)
    for i, p in enumerate(probs):
        row = ids[i, lengths[i]:].tolist()
        answer = row[:row.index(enc.end)] if enc.end in row else row
        correct += enc.tok.decode(answer) == p.answer
        labels[i, lengths[i]:lengths[i] + len(answer) + (enc.end in row)] = \
            ids[i, lengths[i]:lengths[i] + len(answer) + (enc.end in row)]
    out = forward(model, mtp, ids, labels, 0.0, chain_weight=1.0)
    greedy = out.logits.argmax(-1)  # [B, L]: the main model's token after position i
    guess = out.mtp_logits.argmax(-1)  # [B, L]: the MTP's token after position i+1
    # Position i+1's greedy token is the one generated there: a draft of it made at i.
    # A second draft made at j-1 (the chain's, at j) guesses the same token as a first
    # draft made at j.
    counted = (labels[:, 2:] != -100) & (labels[:, 1:-1] != -100)
    agree = int(((guess[:, :-2] == greedy[:, 1:-1]) & counted).sum())
    assert out.chain_logits is not None
    again = int(((out.chain_logits.argmax(-1)[:, :-2] == greedy[:, 1:-1]) & counted).sum())
    total = int(counted.sum())
    model.train()
    return {"exact_match": correct / n, "mtp_agreement": agree / max(total, 1),
            "mtp_second_agreement": again / max(total, 1), "drafts": total}


def save(model: DeepseekV3ForCausalLM, mtp: nn.Module, enc: Encoder, out: Path) -> None:
    save_mtp_checkpoint(model, mtp, out)
    enc.tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
        "eos_token": "<|end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": model.config.max_position_embeddings}, indent=2))


def save_mtp_checkpoint(model: DeepseekV3ForCausalLM, mtp: nn.Module, out: Path) -> None:
    """The model's weights with the MTP layer's as DeepSeek's checkpoints keep them."""
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        mtp.shared_head.head.weight.copy_(model.lm_head.weight)
        mtp.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
    model.save_pretrained(out)
    # save_pretrained writes layer num_hidden_layers with the others; check it did.
    tensors = load_file(out / "model.safetensors")
    n = model.config.num_hidden_layers
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head",
                 "embed_tokens"):
        assert f"model.layers.{n}.{name}.weight" in tensors, name
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class Log:
    args: dict[str, object]
    steps: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=9000)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--mtp-weight-late", type=float, default=0.1)
    ap.add_argument("--late-fraction", type=float, default=0.3,
                    help="the last fraction of steps trained with --mtp-weight-late")
    ap.add_argument("--qat-fraction", type=float, default=0.15,
                    help="the last fraction of steps with MXFP4 experts (0: none)")
    ap.add_argument("--bias-update", type=float, default=1e-3,
                    help="noaux_tc balancing: the router bias step per training step")
    ap.add_argument("--near", type=float, default=0.0,
                    help="the fraction of training problems with close operands "
                         "(`demo_task.draw_near`)")
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--eval-problems", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    ap.add_argument("--init", type=Path, default=None,
                    help="continue from a checkpoint this script saved (a new schedule and "
                         "a new data stream)")
    ap.add_argument("--mtp-only", action="store_true",
                    help="train the MTP layer alone, the model frozen (with --init)")
    ap.add_argument("--mtp-chain-weight", type=float, default=0.0,
                    help="the weight of the MTP's second pass's loss, run on its own "
                         "output as a second draft is (`chain`)")
    ap.add_argument("--measure", type=int, default=0, metavar="N",
                    help="only measure --init on N held-out problems (seed --seed): exact "
                         "match and the MTP layer's agreement, float32 and MXFP4 experts")
    args = ap.parse_args()
    if args.mtp_chain_weight and not args.mtp_only:
        ap.error("--mtp-chain-weight trains the MTP alone: add --mtp-only (and --init)")
    if args.threads:
        torch.set_num_threads(args.threads)
    patch_experts()
    from transformers import DeepseekV3ForCausalLM

    if args.measure:
        model, mtp = load(args.init)
        for qat in (False, True):
            QAT["on"] = qat
            got = evaluate(model, mtp, Encoder(), seed=args.seed, n=args.measure)
            print(f"{'MXFP4 experts' if qat else 'float32'}: " +
                  "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in got.items()), flush=True)
        return

    torch.manual_seed(args.seed)
    # A continuation draws a stream of its own (the same seed would replay the first run's).
    rng = random.Random(args.seed if args.init is None else f"{args.seed} after {args.init}")
    enc = Encoder()
    if args.init is not None:
        model, mtp = load(args.init)
    else:
        model = DeepseekV3ForCausalLM(model_config(enc.tok.get_vocab_size(), eos=enc.end,
                                                   bos=enc.pad))
        mtp = add_mtp_layer(model)
    if args.mtp_only:  # (its router's bias stays: the balancer sees the main model's rows)
        owned = {id(p) for p in mtp.parameters()}
        for p in model.parameters():
            p.requires_grad_(p.requires_grad and id(p) in owned)
    balancer = None if args.mtp_only else Balancer(model, args.bias_update)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"{sum(p.numel() for p in params) / 1e6:.2f}M trained parameters", flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    log, start = Log(settings), time.monotonic()
    qat_from = int(args.steps * (1 - args.qat_fraction))
    late_from = int(args.steps * (1 - args.late_fraction))
    for step in range(args.steps):
        QAT["on"] = step >= qat_from and args.qat_fraction > 0
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        ids, labels = make_batch(enc, [draw_training(rng, args.near)
                                       for _ in range(args.batch_size)])
        weight = args.mtp_weight if step < late_from else args.mtp_weight_late
        out = forward(model, mtp, ids, labels, weight, args.mtp_chain_weight,
                      train_main=not args.mtp_only)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        worst = balancer.update((ids != enc.pad).flatten()) if balancer else [0.0]
        minutes = (time.monotonic() - start) / 60
        if step % 50 == 0:
            log.steps.append({"step": step, "loss": out.main_loss, "mtp_loss": out.mtp_loss,
                              "mtp_second_loss": out.chain_loss,
                              "max_load_over_fair": max(worst), "minutes": minutes})
        if step % 200 == 0:
            print(f"step {step:5d}  loss {out.main_loss:.4f}  mtp {out.mtp_loss:.4f}  "
                  f"second {out.chain_loss:.4f}  "
                  f"busiest/fair {max(worst):.2f}  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"qat {QAT['on']}  {minutes:.1f} min", flush=True)
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            row: dict[str, float | int] = {"step": step + 1, "minutes": minutes}
            on = QAT["on"]
            QAT["on"] = False
            row |= evaluate(model, mtp, enc, seed=10_000 + step, n=args.eval_problems)
            if on:
                QAT["on"] = True
                w4a4 = evaluate(model, mtp, enc, seed=10_000 + step, n=args.eval_problems)
                row |= {f"w4a4_{k}": v for k, v in w4a4.items()}
            log.evals.append(row)
            print("eval " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()
                                      if "drafts" not in k), flush=True)
    QAT["on"] = False
    save(model, mtp, enc, args.out)
    log.args["minutes"] = (time.monotonic() - start) / 60
    (args.out / "training_log.json").write_text(json.dumps(
        {"args": log.args, "steps": log.steps, "evals": log.evals}, indent=1))
    print(f"done in {log.args['minutes']:.1f} min; saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
