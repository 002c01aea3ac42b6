"""Train the bundled demo model: a small Qwen3-MoE that does 3-digit addition and subtraction.

    .venv/bin/python training/train_demo.py --out switchyard/models/arith-moe [--minutes 55]
    .venv/bin/python training/train_demo.py --out DIR --init switchyard/models/arith-moe \
        --qat-mxfp4 --steps 1500 --lr 3e-4 --warmup 50        # quantization-aware fine-tune

CPU only, deterministic seeds. The model is transformers' own `Qwen3MoeForCausalLM`
(transformers is a test/dev dependency), with its load-balancing auxiliary loss, trained on
chat-formatted problems from `switchyard.demo_task` with the loss on the answer tokens only.
Every `--eval-every` steps it measures greedy exact match on held-out problems (never
trained on) and keeps the best checkpoint. The output is a normal HF directory:
config.json, model.safetensors, tokenizer.json (byte-level, built with `tokenizers`) and
tokenizer_config.json with the chat template.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers is imported where used: it takes seconds
    from transformers import Qwen3MoeConfig

from switchyard.demo_model import build_tokenizer
from switchyard.demo_task import draw_training, problems

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Compact on purpose: fewer tokens per example is faster training on a 2-core CPU.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def model_config(vocab_size: int, eos: int, bos: int) -> Qwen3MoeConfig:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, output_router_logits=True,
        router_aux_loss_coef=0.01, max_position_embeddings=128, rope_theta=10000.0,
        eos_token_id=eos, bos_token_id=bos, pad_token_id=bos, tie_word_embeddings=False)


class Encoder:
    def __init__(self) -> None:
        self.tok = build_tokenizer(SPECIAL_TOKENS)
        self.ids = {t: self.tok.token_to_id(t) for t in SPECIAL_TOKENS}

    def prompt(self, question: str) -> list[int]:
        return ([self.ids["<|user|>"], *self.tok.encode(question).ids, self.ids["<|assistant|>"]])

    def answer(self, answer: str) -> list[int]:
        return [*self.tok.encode(answer).ids, self.ids["<|end|>"]]


def make_batch(enc: Encoder, rng: random.Random, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids [B, L] and labels [B, L] (-100 outside the answers)."""
    rows = []
    for _ in range(size):
        p = draw_training(rng)  # never a held-out problem
        prompt, answer = enc.prompt(p.question), enc.answer(p.answer)
        rows.append((prompt + answer, len(prompt)))
    width = max(len(ids) for ids, _ in rows)
    pad = enc.ids["<|endoftext|>"]
    ids = torch.full((size, width), pad, dtype=torch.int64)
    labels = torch.full((size, width), -100, dtype=torch.int64)
    for i, (seq, n_prompt) in enumerate(rows):
        ids[i, :len(seq)] = torch.tensor(seq)
        labels[i, n_prompt:len(seq)] = ids[i, n_prompt:len(seq)]
    return ids, labels


@torch.no_grad()
def greedy_accuracy(model: torch.nn.Module, enc: Encoder, seed: int, n: int) -> float:
    """Exact match of greedy answers on n held-out problems (batched, left-padded)."""
    model.eval()
    model.config.output_router_logits = False  # generate() cannot batch the aux loss
    probs = problems(seed, n)
    prompts = [enc.prompt(p.question) for p in probs]
    width = max(map(len, prompts))
    pad = enc.ids["<|endoftext|>"]
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                         do_sample=False, eos_token_id=enc.ids["<|end|>"], pad_token_id=pad)
    correct = 0
    for p, row in zip(probs, out[:, width:].tolist(), strict=True):
        text = enc.tok.decode(row, skip_special_tokens=False).split("<|end|>")[0]
        correct += text == p.answer
    model.config.output_router_logits = True
    model.train()
    return correct / n


def save(model: torch.nn.Module, enc: Encoder, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.save_pretrained(out)
    model.config.output_router_logits = True
    enc.tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
        "eos_token": "<|end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": model.config.max_position_embeddings}, indent=2))


def fake_mxfp4(t: torch.Tensor) -> torch.Tensor:
    """t as MXFP4 would round it (blocks of 32 along the last dimension), with the
    straight-through gradient: the forward sees the quantized values, the backward
    passes gradients through unchanged."""
    from moe_kernels.mxfp4 import dequantize, quantize

    return t + (dequantize(quantize(t.detach())) - t).detach()


def enable_mxfp4_qat() -> None:
    """Make transformers' Qwen3-MoE experts compute what `--quantization w4a4` serves:
    MXFP4 weights, MXFP4 activations into both expert GEMMs (quantization-aware training,
    as gpt-oss was trained for its MXFP4 experts)."""
    import torch.nn.functional as F
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    def forward(self: m.Qwen3MoeExperts, hidden_states: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        gate_up, down = fake_mxfp4(self.gate_up_proj), fake_mxfp4(self.down_proj)
        for expert in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == expert)
            x = fake_mxfp4(hidden_states[token])  # [n, H]
            gate, up = F.linear(x, gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(fake_mxfp4(self.act_fn(gate) * up), down[expert])  # [n, H]
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out

    m.Qwen3MoeExperts.forward = forward


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=9000)
    ap.add_argument("--minutes", type=float, default=58.0, help="stop after this long")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", type=Path, default=None,
                    help="continue from this checkpoint (a new schedule, a new data stream)")
    ap.add_argument("--qat-mxfp4", action="store_true",
                    help="quantization-aware: experts see MXFP4 weights and activations "
                         "(training and evaluation), as `--quantization w4a4` serves them")
    args = ap.parse_args()
    if args.qat_mxfp4:
        enable_mxfp4_qat()

    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(args.seed)
    # A fine-tune gets its own data stream (the same seed would replay the first run's).
    rng = random.Random(args.seed if args.init is None else f"{args.seed} after {args.init}")
    enc = Encoder()
    if args.init is not None:
        model = Qwen3MoeForCausalLM.from_pretrained(args.init, dtype=torch.float32)
        model.config.output_router_logits = True
    else:
        model = Qwen3MoeForCausalLM(model_config(enc.tok.get_vocab_size(),
                                                 eos=enc.ids["<|end|>"],
                                                 bos=enc.ids["<|endoftext|>"]))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                            betas=(0.9, 0.98))
    start, best = time.monotonic(), -1.0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        ids, labels = make_batch(enc, rng, args.batch_size)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        minutes = (time.monotonic() - start) / 60
        if step % 100 == 0:
            print(f"step {step:5d}  loss {out.loss.item():.4f}  aux {out.aux_loss.item():.4f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {minutes:.1f} min", flush=True)
        last = step == args.steps - 1 or minutes >= args.minutes
        if (step + 1) % args.eval_every == 0 or last:
            # Held-out problems, which the training stream never draws.
            acc = greedy_accuracy(model, enc, seed=10_000 + step, n=500)
            print(f"step {step + 1:5d}  eval exact match {acc:.3f} (500 held-out problems)",
                  flush=True)
            if acc >= best:
                best = acc
                save(model, enc, args.out)
                print(f"  saved to {args.out}", flush=True)
        if last:
            break
    print(f"done: best exact match {best:.3f} in {(time.monotonic() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
