"""The GPU check: every GPU path against the CPU path, then timed, on one NVIDIA GPU.

    .venv/bin/python -m benchmarks.gpu_check [--json FILE] [--skip-serve] [--skip-kernel]

Made to run once, within 8 minutes and without network access, on a lent machine:

1. machine: GPU, driver, torch/CUDA/Triton versions; device-to-device copy bandwidth
   (bytes read + written) and bf16 matmul TFLOP/s (8192^3);
2. the bundled demo model on `--device cuda` (local backend) against the CPU in float32:
   logits of fixed prompts through the paged-KV path (`Engine.score`), float32 and
   bfloat16, and greedy continuations; and seeded sampling (penalties, logprobs) giving the
   same tokens twice on CUDA;
3. the same with W4A4 experts (the Triton kernel on CUDA against the torch path on CPU);
4. `switchyard serve --device cuda` (gateway, attention, 2 expert services over `rpc`, all
   on this GPU) answering the demo questions as the CPU does;
5. the W4A4 grouped GEMM (`benchmarks/gpu_mxfp4.py`): checked against the torch path, and
   timed at decode and prefill shapes against the copy bandwidth;
6. decode step time of the demo model on CUDA at batch 1, 16 and 64;
7. the `nccl` backend's CuPy collective at world size 1 (rows to itself, and the flag).

The `torch` and `nccl` backends across ranks need two GPUs (NCCL refuses two ranks on
one), and the `deepep` backend is not built: the table says so. Exits 0
with a message where there is no CUDA device. One table on stdout, everything as JSON.

On this workplace's lent H200 (torch, Triton and CuPy installed; no network), after
`scripts/gpu-wheels` here, one device run with `carry: [".whl"]` and `timeout_s: 540`:

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && \
    export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 && \
    python3 -m benchmarks.gpu_check --json $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from benchmarks.gpu_mxfp4 import copy_bandwidth, time_ms
from switchyard.demo_model import DEFAULT_MODEL, DEFAULT_MODEL_NAME

if TYPE_CHECKING:
    from services.attention.engine import Engine

ROWS: list[dict[str, object]] = []
PROMPTS = [[1, 5, 9, 17, 33, 65, 129, 200], [7] * 24, list(range(3, 60, 2))]


def row(check: str, result: str, value: str = "", note: str = "") -> None:
    ROWS.append({"check": check, "result": result, "value": value, "note": note})
    print(f"| {check} | {result} | {value} | {note} |", flush=True)


def guarded(name: str, fn: Callable[[], None]) -> None:
    """Run one section; an exception is a FAIL row, and the other sections still run."""
    start = time.perf_counter()
    try:
        fn()
    except Exception as exc:
        row(name, "FAIL", "", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    print(f"<!-- {name}: {time.perf_counter() - start:.1f} s -->", file=sys.stderr)


def machine() -> None:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        smi = ""
    import triton

    row("GPU", "info", smi.strip() or torch.cuda.get_device_name(),
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}")
    row("copy bandwidth", "info", f"{copy_bandwidth(4.0) / 1e12:.2f} TB/s",
        "device-to-device, read + written")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: a @ a, warmup=3, iters=10, flush=None)
    row("bf16 matmul", "info", f"{2 * 8192**3 / (ms * 1e-3) / 1e12:.0f} TFLOP/s", "8192^3")


def engine(device: str, dtype: str, quantization: str | None = None) -> Engine:
    from services.attention.config import AttentionConfig
    from services.attention.engine import Engine

    return Engine(AttentionConfig(model=DEFAULT_MODEL, device=device, dtype=dtype,
                                  quantization=quantization, kv_cache_memory=256 << 20))


def greedy(e: Engine, prompt: list[int], n: int = 8) -> list[int]:
    from switchyard.messages import GenerateRequest, SamplingParams

    e.add(GenerateRequest("g", prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                      ignore_eos=True)))
    out: list[int] = []
    while e.has_work():
        out += [t for d in e.step() for t in d.token_ids]
    return out


def logits_vs_cpu(quantization: str | None) -> None:
    label = "W4A4 " if quantization else ""
    cpu = engine("cpu", "float32", quantization)
    reference = [cpu.score(p) for p in PROMPTS]
    tokens = [greedy(cpu, p) for p in PROMPTS]
    # W4A4 re-quantizes between the GEMMs: float32 summation order flips a code now and then.
    # bfloat16 keeps 8 bits of mantissa: 5e-2 of the largest logit is a few of its ulps.
    for dtype, bound in (("float32", 5e-2 if quantization else 1e-3), ("bfloat16", 5e-2)):
        gpu = engine("cuda", dtype, quantization)
        err = max(((gpu.score(p).cpu() - r).abs().max() / r.abs().max()).item()
                  for p, r in zip(PROMPTS, reference, strict=True))
        same = [greedy(gpu, p) for p in PROMPTS] == tokens
        ok = err <= bound and (same or dtype != "float32")
        row(f"{label}logits, cuda {dtype} vs cpu float32", "ok" if ok else "FAIL",
            f"max rel err {err:.1e}", f"bound {bound:g}; greedy tokens "
            f"{'equal' if same else 'differ'}")
        del gpu
        torch.cuda.empty_cache()


def sampled_twice() -> None:
    """Seeded sampling with penalties and logprobs: two CUDA engines draw the same tokens
    (per-request generators on the device; CUDA and CPU draw differently by design)."""
    from switchyard.messages import GenerateRequest, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, logprobs=3,
                            repetition_penalty=1.2, presence_penalty=0.5, ignore_eos=True)
    runs = []
    for _ in range(2):
        e = engine("cuda", "float32")
        e.add(GenerateRequest("s", PROMPTS[0], params))
        tokens: list[int] = []
        while e.has_work():
            tokens += [t for d in e.step() for t in d.token_ids]
        runs.append(tokens)
    row("seeded sampling on cuda, twice", "ok" if runs[0] == runs[1] else "FAIL",
        " ".join(map(str, runs[0])), "penalties and logprobs on")


def serve_vs_cpu() -> None:
    import httpx

    from switchyard.serve_process import Served

    questions = ["What is 123 + 456?", "What is 900 - 937?", "What is 5 + 7?"]

    def answers(device: str) -> list[str]:
        # float32 on both: a difference is then the device path's, not bfloat16's
        with Served(["--device", device, "--dtype", "float32", "--expert-services", "2"],
                    timeout=300) as served:
            return [httpx.post(f"{served.url}/v1/chat/completions", timeout=120, json={
                "model": DEFAULT_MODEL_NAME, "temperature": 0, "max_tokens": 8,
                "messages": [{"role": "user", "content": q}]}).json()["choices"][0]
                ["message"]["content"] for q in questions]

    cpu, gpu = answers("cpu"), answers("cuda")
    row("serve --device cuda (rpc, 2 expert services)", "ok" if gpu == cpu else "FAIL",
        " / ".join(gpu), f"cpu: {' / '.join(cpu)}")


def kernel() -> None:
    from benchmarks.gpu_mxfp4 import bench, check, parse_args

    argv, sys.argv = sys.argv, ["gpu_mxfp4", "--hidden", "7168", "--inter", "2048",
                                "--experts", "32", "--iters", "10"]
    try:
        args = parse_args()
        ok, variants = check(args, args.variants)
        row("W4A4 Triton kernel vs torch path", "ok" if ok else "FAIL", ", ".join(variants),
            "tables above")
        if variants:
            bench(args, variants, copy_bandwidth(4.0))
    finally:
        sys.argv = argv


def nccl_self() -> None:
    """The CuPy NCCL collective at world size 1: rows sent to oneself come back whole."""
    from ep_dispatch.nccl import CupyNccl
    from ep_dispatch.torch_dist import World
    from switchyard.launcher import free_port

    coll = CupyNccl(World(("127.0.0.1", free_port()), 1, 0, rank=0), timeout=60)
    x = torch.randn(128 * 8, 7168, dtype=torch.bfloat16, device="cuda")  # 128 tokens, top-8
    out = torch.empty_like(x)
    coll.all_to_all(out, x, [x.shape[0]], [x.shape[0]])
    ok = torch.equal(out, x) and coll.any_work(True, x.device)
    ms = time_ms(lambda: coll.all_to_all(out, x, [x.shape[0]], [x.shape[0]]), 3, 20, None)
    row("nccl (CuPy) all-to-all, world size 1", "ok" if ok else "FAIL", f"{ms * 1e3:.0f} us",
        "1024 rows x 7168 bf16 to itself (a copy through NCCL, not a network figure)")
    coll.close()


def decode_steps() -> None:
    from switchyard.messages import GenerateRequest, SamplingParams

    for batch in (1, 16, 64):
        e = engine("cuda", "bfloat16")
        for i in range(batch):
            e.add(GenerateRequest(f"r{i}", PROMPTS[0], SamplingParams(
                max_tokens=40, temperature=0.0, ignore_eos=True)))
        e.step()  # prefill
        for _ in range(5):
            e.step()
        torch.cuda.synchronize()
        start, n = time.perf_counter(), 20
        for _ in range(n):
            e.step()
        torch.cuda.synchronize()
        row(f"decode step, demo model, batch {batch}", "info",
            f"{(time.perf_counter() - start) / n * 1e3:.2f} ms", "cuda bfloat16, local")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--skip-kernel", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; this check needs an NVIDIA GPU. Nothing to do.")
        return 0
    print("| check | result | value | note |\n|---|---|---|---|")
    guarded("machine", machine)
    guarded("logits", lambda: logits_vs_cpu(None))
    guarded("W4A4 logits", lambda: logits_vs_cpu("w4a4"))
    guarded("sampling", sampled_twice)
    if not args.skip_serve:
        guarded("serve", serve_vs_cpu)
    if not args.skip_kernel:
        guarded("W4A4 kernel", kernel)
    guarded("decode steps", decode_steps)
    guarded("nccl (CuPy)", nccl_self)
    row("torch and nccl backends across ranks", "not run", "",
        "needs 2 GPUs (NCCL: one rank each)" if torch.cuda.device_count() < 2
        else "not in this check yet: run serve --dispatch-backend nccl --device cuda")
    row("deepep backend", "not built", "", "issue 11")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ROWS, f, indent=1)
    return 1 if any(r["result"] == "FAIL" for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
