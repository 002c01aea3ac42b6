""".venv/bin/python -m benchmarks.generate [--batch-sizes 1 16] [--input-len 64] [--output-len 64]

Output tokens/s of Switchyard's engine vs. transformers `generate()`, side by side.

Same checkpoint (a random mid-size Qwen3-MoE built by transformers), same prompts, greedy,
fixed output length, float32 for both, batch 1 and 16, in one run.

The checkpoint is cached under --workdir (default /tmp/switchyard-bench).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from common.messages import GenerateRequest, SamplingParams
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.engine import Engine

MID_SIZE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048,
                moe_intermediate_size=768, num_hidden_layers=8, num_attention_heads=16,
                num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
                norm_topk_prob=True, max_position_embeddings=4096)


def add_workdir_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/switchyard-bench"),
                    help="where the benchmark checkpoint is built once and cached")


# DeepSeek-V3's shape at about 0.46B parameters: MLA (with q_lora_rank), a dense first
# layer, 64 routed experts of which 6 per token, in 8 groups of which 4 compete, 2 shared.
DEEPSEEK_MID = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                    moe_intermediate_size=256, num_hidden_layers=8, first_k_dense_replace=1,
                    num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384,
                    kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
                    v_head_dim=64, n_routed_experts=64, num_experts_per_tok=6,
                    n_shared_experts=2, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                    max_position_embeddings=4096)
CHECKPOINTS = ("qwen3-moe-mid", "deepseek-v3-mid")


def build_checkpoint(workdir: Path, name: str = "qwen3-moe-mid") -> Path:
    """The random benchmark checkpoint `name` (CHECKPOINTS), built once in `workdir`."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen3MoeConfig

    path = workdir / name
    if (path / "config.json").is_file():
        return path
    print(f"building the random checkpoint {name} in {path} ...", flush=True)
    torch.manual_seed(0)
    config = DeepseekV3Config(**DEEPSEEK_MID) if name == "deepseek-v3-mid" \
        else Qwen3MoeConfig(**MID_SIZE)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if name == "deepseek-v3-mid":  # a score-correction bias that matters (it is 0 at init)
        with torch.no_grad():
            for buffer_name, b in model.named_buffers():
                if buffer_name.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.02)
    model.save_pretrained(path)
    return path


def make_prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def bench_transformers(model: object, prompts: list[list[int]], output_len: int) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=output_len, min_new_tokens=output_len,
                             pad_token_id=0)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) * len(prompts) / elapsed


def bench_switchyard(engine: Engine, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add(GenerateRequest(f"b{len(prompts)}-{i}-{start}", p, params))
    produced = 0
    while engine.has_work():
        produced += sum(len(d.token_ids) for d in engine.step())
    elapsed = time.perf_counter() - start
    assert produced == output_len * len(prompts)
    return produced / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workdir_flag(ap)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    path = build_checkpoint(args.workdir)
    print("loading transformers model ...", flush=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    print("loading switchyard engine ...", flush=True)
    engine = build_engine(AttentionConfig(model=path, dtype="float32", kv_cache_memory=1 << 30,
                                    max_num_batched_tokens=1024))
    vocab = engine.model_config.vocab_size
    # Warm both up once so first-call allocations are not measured.
    bench_transformers(hf, make_prompts(1, 8, vocab), 2)
    bench_switchyard(engine, make_prompts(1, 8, vocab), 2)
    rows = []
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, args.input_len, vocab)
        print(f"batch {batch}: transformers ...", flush=True)
        hf_tps = bench_transformers(hf, prompts, args.output_len)
        print(f"batch {batch}: switchyard ...", flush=True)
        sy_tps = bench_switchyard(engine, prompts, args.output_len)
        rows.append((batch, hf_tps, sy_tps))
    print(f"\ninput {args.input_len} tokens, output {args.output_len} tokens, float32, "
          f"{torch.get_num_threads()} threads")
    print("| batch | transformers tok/s | switchyard tok/s | ratio |")
    print("|---:|---:|---:|---:|")
    for batch, hf_tps, sy_tps in rows:
        print(f"| {batch} | {hf_tps:.1f} | {sy_tps:.1f} | {sy_tps / hf_tps:.2f}x |")


if __name__ == "__main__":
    main()
