""".venv/bin/python -m benchmarks.gpu_check [--json FILE] [--budget S] [--skip-serve]
    [--skip-kernel] [--skip-sweep]

The GPU check: every GPU path against the CPU path, then timed, on one NVIDIA GPU.

Made to run once, within 8 minutes and without network access, on a lent machine; each
section has a time limit, and one that fails or runs over is a FAIL row while the others
still run. In order:

1. machine: GPU, driver, torch/CUDA/Triton versions; device-to-device copy bandwidth
   (bytes read + written) and bf16 matmul TFLOP/s (8192^3); then a preflight: every W4A4
   kernel once in a child process (`benchmarks/gpu_preflight.py`), so that one which
   faults the GPU is kept out of this process instead of failing every later section;
2. the W4A4 grouped GEMM (`benchmarks/gpu_mxfp4.py`): every variant checked against the
   torch path, then timed at decode and prefill shapes against the copy bandwidth;
3. the bundled demo model on `--device cuda` (local backend) against the CPU in float32:
   logits through the paged-KV path (`Engine.score`) and greedy continuations, in float32
   (random-byte prompts) and bfloat16 (demo questions, against the CPU's own bfloat16
   error), then the same with W4A4 experts; seeded sampling giving the same tokens twice
   and prompt logprobs equal to the CPU's;
   the FP8 dense linears (`--dense-quantization int8` on a GPU) against the dequantized
   operands' product, timed beside bfloat16, and the demo model answering with them;
4. decode step time at batch 1, 16 and 64, eager and replayed from CUDA graphs, and one
   step's hidden states both ways (float and W4A4 experts); a decode profile: one host
   sync's cost, the syncs a step makes (by source line, eager and with graphs), each
   step's time, cProfile's top functions;
5. the dispatch path of the `torch` (torch.distributed NCCL) and `nccl` (CuPy) backends
   at world size 1 (128 tokens x 7168, top-8 of 256 experts over 8 ranks, checked), and
   the CuPy collective alone, and its ping-pong (exchanges on its own stream while the
   current one computes: the share of their time hidden, from a torch.profiler trace);
   with two GPUs or more, the `torch`, `nccl` and (installed)
   `deepep` backends across them (`benchmarks/ep_latency.py`, bf16 and MXFP4 rows; with 9
   GPUs or more 8 expert ranks, beside DeepEP's published low-latency figures for EP 8);
6. a sweep of the W4A4 kernel's variants, tiles and launch options (`--skip-sweep`),
   whose fastest config per tokens per expert is written beside the JSON as
   `<device>.json`: this GPU's tuned table, to commit to `moe_kernels/configs/` (late:
   its configs never ran on a GPU, and one that faults would break this process's CUDA
   context for the sections after it);
7. `switchyard serve --device cuda` (gateway, attention, 2 expert services over `rpc`, all
   on this GPU) answering the demo questions as the CPU does (`--skip-serve`).

The `torch`, `nccl` and `deepep` backends across ranks need two GPUs or more (NCCL and
DeepEP give each rank its own GPU): the table says so.
Exits 0 with a message where there is no CUDA device. One table on stdout, everything as
JSON (rewritten after each row).

On this workplace's lent H200 (torch, Triton and CuPy installed; no network), after
`scripts/gpu-wheels` here, one device run with `carry: [".whl"]` and `timeout_s: 540`:

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && \
    export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 && \
    python3 -m benchmarks.gpu_check --json $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from benchmarks.gpu_mxfp4 import copy_bandwidth, time_ms
from switchyard.demo_model import DEFAULT_MODEL, DEFAULT_MODEL_NAME

if TYPE_CHECKING:
    from ep_dispatch.nccl import CupyNccl
    from services.attention.builder import build_engine
    from services.attention.engine import Engine

ROWS: list[dict[str, object]] = []
JSON_PATH: str | None = None
KERNEL_VARIANTS: list[str] = []  # the inner products (and route) that ran and matched
KERNEL_CHECKED: list[bool] = []  # [every kernel check passed], once the check ran
PREFLIGHT_FAILED: set[str] = set()  # kernels that failed in the preflight's child process
DEADLINE = float("inf")  # time.monotonic() by which every section must end
PROMPTS = [[1, 5, 9, 17, 33, 65, 129, 200], [7] * 24, list(range(3, 60, 2))]


def row(check: str, result: str, value: str = "", note: str = "") -> None:
    ROWS.append({"check": check, "result": result, "value": value, "note": note})
    print(f"| {check} | {result} | {value} | {note} |", flush=True)
    if JSON_PATH:  # after every row: a run stopped at its limit keeps what it measured
        with open(JSON_PATH, "w") as f:
            json.dump(ROWS, f, indent=1)


class SectionTimeout(BaseException):
    """A section ran past its time limit (raised from SIGALRM). Not an `Exception`, so that
    the sections' own handlers (a sweep candidate that fails, a variant that does not
    compile) cannot swallow it and run on past the limit."""


def _alarm(signum: int, frame: object) -> None:
    raise SectionTimeout


def guarded(name: str, fn: Callable[[], None], limit_s: float) -> None:
    """Run one section within min(limit_s, what is left of the budget); an exception or
    the time limit is a FAIL row, and the other sections still run."""
    left = DEADLINE - time.monotonic()
    if left < 10:
        row(name, "not run", "", "out of time (--budget)")
        return
    start = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(max(1, int(min(limit_s, left))))
    try:
        fn()
    except SectionTimeout:
        row(name, "FAIL", "", f"did not finish within {min(limit_s, left):.0f} s")
    except Exception as exc:
        row(name, "FAIL", "", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            if str(exc) else type(exc).__name__)
        traceback.print_exc(file=sys.stdout)  # into the table's file: all that comes back
    finally:
        signal.alarm(0)
    print(f"<!-- {name}: {time.perf_counter() - start:.1f} s -->", flush=True)


def machine() -> None:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20).stdout
    except (FileNotFoundError, subprocess.TimeoutExpired):
        smi = ""
    import triton

    row("GPU", "info", smi.strip() or torch.cuda.get_device_name(),
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}")
    row("copy bandwidth", "info", f"{copy_bandwidth(4.0) / 1e12:.2f} TB/s",
        "device-to-device, read + written")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: a @ a, warmup=3, iters=10, flush=None)
    row("bf16 matmul", "info", f"{2 * 8192**3 / (ms * 1e-3) / 1e12:.0f} TFLOP/s", "8192^3")


def engine(device: str, dtype: str, quantization: str | None = None,
           cuda_graph_max_batch: int = 0, dense: str = "auto") -> Engine:
    from services.attention.config import AttentionConfig

    return build_engine(AttentionConfig(model=DEFAULT_MODEL, device=device, dtype=dtype,
                                  quantization=quantization or "auto", kv_cache_memory=256 << 20,
                                  cuda_graph_max_batch=cuda_graph_max_batch,
                                  dense_quantization=dense))


def greedy(e: Engine, prompt: list[int], n: int = 8) -> list[int]:
    from common.messages import GenerateRequest, SamplingParams

    e.add(GenerateRequest("g", prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                      ignore_eos=True)))
    out: list[int] = []
    while e.has_work():
        out += [t for d in e.step() for t in d.token_ids]
    return out


def chat_prompts(n: int = 4) -> list[list[int]]:
    """Demo-task questions as the gateway renders them: the model's own distribution."""
    from gateway.text.tokenizer import Tokenizer
    from switchyard.demo_task import problems

    tok = Tokenizer.load(DEFAULT_MODEL)
    assert tok is not None
    return [tok.encode_chat([{"role": "user", "content": p.question}])
            for p in problems(0, n)]


def logits_vs_cpu(quantization: str | None) -> None:
    """Against the CPU in float32: float32 on random-byte prompts (any routing), within a
    tight bound; bfloat16 on demo questions, within 1.5x of the CPU's own bfloat16 error
    (at least 5e-2). On random-byte prompts bfloat16 flips top-k routing choices
    (transformers' own Qwen3-MoE in bfloat16 is 0.9 off its float32 there), and with W4A4
    bfloat16 activations quantize to other codes (the CPU's own error is about 0.1)."""
    label = "W4A4 " if quantization else ""
    cpu = engine("cpu", "float32", quantization)
    prompts = {"float32": PROMPTS, "bfloat16": chat_prompts()}
    reference = {d: [cpu.score(p) for p in ps] for d, ps in prompts.items()}
    tokens = {d: [greedy(cpu, p) for p in ps] for d, ps in prompts.items()}

    def error(e: Engine, dtype: str) -> float:
        return max(((e.score(p).cpu().float() - r).abs().max() / r.abs().max()).item()
                   for p, r in zip(prompts[dtype], reference[dtype], strict=True))

    cpu_bf16 = error(engine("cpu", "bfloat16", quantization), "bfloat16")
    # W4A4 re-quantizes between the GEMMs: float32 summation order flips a code now and then.
    bounds = {"float32": 5e-2 if quantization else 1e-3, "bfloat16": max(5e-2, 1.5 * cpu_bf16)}
    for dtype, bound in bounds.items():
        gpu = engine("cuda", dtype, quantization)
        err = error(gpu, dtype)
        same = [greedy(gpu, p) for p in prompts[dtype]] == tokens[dtype]
        ok = err <= bound and (same or dtype != "float32")
        row(f"{label}logits, cuda {dtype} vs cpu float32", "ok" if ok else "FAIL",
            f"max rel err {err:.1e}", f"bound {bound:.2g}; greedy tokens "
            f"{'equal' if same else 'differ'}; " + ("random-byte prompts" if dtype == "float32"
                                                    else f"demo questions; cpu bfloat16: "
                                                         f"{cpu_bf16:.1e}"))
        del gpu
        torch.cuda.empty_cache()


def fp8_dense() -> None:
    """The 8-bit dense scheme on this GPU (`--dense-quantization int8`: FP8 weights, rows
    quantized as they come, `torch._scaled_mm`): at the mid-size checkpoint's shapes,
    against the product of the dequantized operands, and timed against bfloat16's
    F.linear at 1 and 64 rows; then the demo model with it, in bfloat16, its greedy
    answers against the CPU's float32 ones on the demo questions."""
    import torch.nn.functional as F

    from moe_kernels.fp8 import fp8_linear, fp8_weights, reference_linear

    for name, (n, k) in {"attention projection": (1024, 1024),
                         "lm_head": (32000, 1024)}.items():
        w = torch.randn(n, k, device="cuda") / k**0.5
        f = fp8_weights(w)
        assert f is not None
        for rows in (1, 64):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            err = ((fp8_linear(x, f).float() - reference_linear(x.float(), f)).abs().max()
                   / reference_linear(x.float(), f).abs().max()).item()
            fp8_ms = time_ms(lambda x=x, f=f: fp8_linear(x, f), warmup=3, iters=20,
                             flush=None)
            wb = w.to(torch.bfloat16)
            bf16_ms = time_ms(lambda x=x, wb=wb: F.linear(x, wb), warmup=3, iters=20,
                              flush=None)
            row(f"FP8 dense {name} [{n}, {k}], {rows} rows", "ok" if err < 1e-2 else "FAIL",
                f"{fp8_ms * 1e3:.0f} us vs bf16 {bf16_ms * 1e3:.0f} us",
                f"max rel err vs dequantized operands {err:.1e} (bound 1e-2: bf16 output)")
    cpu = engine("cpu", "float32")
    gpu = engine("cuda", "bfloat16", dense="int8")
    prompts = chat_prompts()
    same = sum(greedy(gpu, p, 12) == greedy(cpu, p, 12) for p in prompts)
    row("FP8 dense, demo model cuda bfloat16 vs cpu float32",
        "ok" if same == len(prompts) else "FAIL", f"{same}/{len(prompts)} answers equal",
        "greedy, 12 tokens, demo questions")


def sampled_twice() -> None:
    """Seeded sampling with penalties, logit bias and logprobs: two CUDA engines draw the
    same tokens (per-request generators on the device; CUDA and CPU draw differently by
    design). The prompt logprobs they score equal the CPU's."""
    from common.messages import GenerateRequest, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, logprobs=3,
                            repetition_penalty=1.2, presence_penalty=0.5, ignore_eos=True,
                            logit_bias=((5, -2.0),), prompt_logprobs=3)
    runs, scores = [], []
    for device in ("cuda", "cuda", "cpu"):
        e = engine(device, "float32")
        e.add(GenerateRequest("s", PROMPTS[0], params))
        tokens: list[int] = []
        while e.has_work():
            for d in e.step():
                tokens += d.token_ids
                if d.prompt_logprobs is not None:
                    scores.append([x.logprob for x in d.prompt_logprobs[1:] if x is not None])
        runs.append(tokens)
    gap = max(abs(a - b) for a, b in zip(scores[0], scores[2], strict=True))
    row("seeded sampling on cuda, twice", "ok" if runs[0] == runs[1] else "FAIL",
        " ".join(map(str, runs[0])), "penalties, logit bias and logprobs on")
    row("prompt logprobs, cuda vs cpu float32",
        "ok" if gap < 1e-3 and len(scores[0]) == len(PROMPTS[0]) - 1 else "FAIL",
        f"max abs diff {gap:.1e}", f"{len(scores[0])} prompt tokens")


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


def preflight() -> None:
    """Every W4A4 kernel once, small, in a child process (`benchmarks.gpu_preflight`): one
    that fails there is kept out of this process (a GEMM variant out of the kernel check,
    the quantize or dequantize kernel replaced by the torch code it equals), so a kernel
    that faults the GPU costs a row, not every section after it. After a failure the
    kernels after it run in a fresh child."""
    from benchmarks.gpu_preflight import KERNELS, outcome

    left = list(KERNELS)
    while left:
        cmd = [sys.executable, "-m", "benchmarks.gpu_preflight", *left]
        try:  # a hung kernel is a failed one: in this process nothing could stop it
            child = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
            stdout, code, stderr = child.stdout, child.returncode, child.stderr
        except subprocess.TimeoutExpired as exc:  # killed; its output so far (bytes)
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout
            stdout, code, stderr = stdout or "", "killed after 90 s", ""
        done, failed = outcome(stdout, code)
        if failed is None:
            if code or len(done) < len(left):  # it never got to a kernel
                tail = (stderr.strip().splitlines() or [f"exit {code}"])[-1]
                row("preflight", "FAIL", "", f"did not run: {tail[:300]}")
                return
            break
        PREFLIGHT_FAILED.add(failed[0])
        row(f"preflight: {failed[0]}", "FAIL", "", failed[1][:300])
        left = left[left.index(failed[0]) + 1:]
    avoid_failed_kernels()
    row("preflight", "ok" if not PREFLIGHT_FAILED else "FAIL",
        f"{len(KERNELS) - len(PREFLIGHT_FAILED)} of {len(KERNELS)} kernels ran",
        "each once, small, in a child process")


def avoid_failed_kernels() -> None:
    """The torch code for the activations' kernels that failed the preflight (what the
    services and the checks in this process call looks them up in `triton_mxfp4`)."""
    from benchmarks.gpu_preflight import DEQUANTIZE, QUANTIZE
    from moe_kernels import mxfp4, triton_mxfp4

    if QUANTIZE in PREFLIGHT_FAILED:
        triton_mxfp4.quantize_mxfp4 = mxfp4.quantize
    if DEQUANTIZE in PREFLIGHT_FAILED:
        triton_mxfp4.dequantize_mxfp4 = lambda q, dtype=torch.bfloat16: mxfp4.dequantize(
            q, dtype)


def kernel() -> None:
    from benchmarks.gpu_mxfp4 import SWEPT, bench, check, parse_args

    argv, sys.argv = sys.argv, ["gpu_mxfp4", "--hidden", "7168", "--inter", "2048",
                                "--experts", "32", "--iters", "10"]
    try:
        args = parse_args()
        ok, variants = check(args, [v for v in args.variants if v not in PREFLIGHT_FAILED])
        KERNEL_VARIANTS[:], KERNEL_CHECKED[:] = variants, [ok]
        row("W4A4 Triton kernel vs torch path", "ok" if ok else "FAIL", ", ".join(variants),
            "tables above")
        timed = [v for v in variants if v.partition("/")[0] in SWEPT]
        if timed:  # the others lost to these on the H200 (docs/benchmarks.md)
            bench(args, timed, copy_bandwidth(4.0))
    finally:
        sys.argv = argv


def kernel_sweep(json_path: str | None) -> None:
    """The W4A4 kernel's sweep (`benchmarks.gpu_mxfp4.sweep`): one row per shape."""
    from benchmarks.gpu_mxfp4 import sweep

    if not KERNEL_VARIANTS:
        row("W4A4 kernel sweep", "not run", "", "no variant compiled and matched")
        return
    sweep_json = json_path.removesuffix(".json") + "_sweep.json" if json_path else None
    results: list[dict[str, object]] = []
    try:  # what was timed is kept even when the section runs out of time
        sweep(KERNEL_VARIANTS, copy_bandwidth(4.0), sweep_json, results=results)
    finally:
        signal.alarm(0)
        sweep_rows(results, json_path)


def sweep_rows(results: list[dict[str, object]], json_path: str | None) -> None:
    """The sweep's tuned table (to commit to moe_kernels/configs/) and best rows. Every
    timed config had passed the kernel check at its variant's default tiles and matched
    the torch path at its own (`sweep`), so a failed check elsewhere (another variant, the
    quantizer) does not keep the table from being written; its source says so."""
    from benchmarks.gpu_mxfp4 import best_per_shape, write_tuned
    from moe_kernels.kernel_configs import config_path

    if json_path and results:
        checked = "kernel check passed" if KERNEL_CHECKED == [True] else \
            "kernel check failed elsewhere (see its table)"
        path = write_tuned(results, str(config_path(torch.cuda.get_device_name(),
                                                    Path(json_path).parent)),
                           f"{time.strftime('%Y-%m-%d')}, benchmarks.gpu_check sweep, 32 "
                           f"experts, H 7168, I 2048; {checked}")
        row("W4A4 tuned configs", "info", path, "the fastest config per tokens per expert")
    for best in best_per_shape(results):
        row(f"W4A4 sweep: {best['gemm']}, {best['tokens_per_expert']} tokens/expert", "info",
            f"{best['us']:.1f} us, {best['weight_tb_s']:.2f} TB/s "
            f"({best['of_copy_bw']:.0%} of copy)",
            f"best of {best['tried']}: {best['variant']} {tuple(best['config'])}; best us per "
            f"variant: " + ", ".join(f"{v} {us:.0f}" for v, us in best['per_variant'].items()))


def dispatch_path(device: str = "cuda") -> None:
    """The `torch` and `nccl` backends' per-layer path on one GPU at world size 1: layout,
    gather, all-to-all (to itself: no network), combine, for 128 tokens of hidden 7168
    routed top-8 of 256 experts over 8 expert ranks; checked against x * sum(weights)."""
    import torch.distributed as dist

    from common.ports import free_port
    from ep_dispatch.layout import combine, compute_layout
    from ep_dispatch.nccl import CupyNccl
    from ep_dispatch.placement import Placement
    from ep_dispatch.torch_dist import Collective, TorchCollective, World, join

    t, h, k, e = 128, 7168, 8, 256
    placement = Placement.balanced([0], e, 8)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(t, h, dtype=torch.bfloat16, device=device, generator=g)  # [T, H]
    probs = torch.randn(t, e, device=device, generator=g).softmax(-1)  # [T, E]
    weights, ids = probs.topk(k)  # [T, K] each
    expected = x.float() * weights.sum(-1, keepdim=True)  # [T, H]: experts as identity
    on_gpu = device == "cuda"  # the CPU run (gloo, no CuPy) only tests this function
    join(World(("127.0.0.1", free_port()), 1, 0, rank=0), 60, "nccl" if on_gpu else "gloo")
    makers: dict[str, Callable[[], Collective]] = {
        "torch (torch.distributed NCCL)": TorchCollective}
    if on_gpu:
        makers["nccl (CuPy)"] = lambda: CupyNccl(
            World(("127.0.0.1", free_port()), 1, 0, rank=0), 60)
    for name, make in makers.items():
        try:
            coll = make()
        except Exception as exc:  # no CuPy is a gap of the image, not a failure
            result = "not run" if "needs CuPy" in str(exc) else "FAIL"
            row(f"dispatch+combine, {name}, world size 1", result, "",
                f"{type(exc).__name__}: {exc}")
            continue
        parts = {"layout": 0.0, "gather": 0.0, "all-to-all": 0.0, "combine": 0.0}

        def once(parts: dict[str, float] | None = None, coll: Collective = coll
                 ) -> torch.Tensor:
            marks = [time.perf_counter()]

            def mark() -> None:
                if on_gpu:
                    torch.cuda.synchronize()
                marks.append(time.perf_counter())

            layout = compute_layout(ids, weights.to(x.dtype), placement, 0)
            mark()
            rows = x[layout.src_token]  # [T*K, H] in send order
            mark()
            y = torch.empty_like(rows)
            coll.all_to_all(y, rows, [rows.shape[0]], [rows.shape[0]])
            mark()
            out = combine(y, layout)  # [T, H]
            mark()
            if parts is not None:
                for key, a, b in zip(parts, marks[:-1], marks[1:], strict=True):
                    parts[key] += b - a
            return out

        err = ((once().float() - expected).abs().max() / expected.abs().max()).item()
        for _ in range(5):
            once()
        n = 50
        for _ in range(n):
            once(parts)
        split = ", ".join(f"{key} {v / n * 1e6:.0f}" for key, v in parts.items())
        row(f"dispatch+combine, {name}, world size 1", "ok" if err <= 2e-2 else "FAIL",
            f"{sum(parts.values()) / n * 1e6:.0f} us",
            f"128 tokens x 7168 bf16, top-8 of 256 experts on 8 ranks, synchronised after "
            f"each part (us): {split}; max rel err {err:.1e}; a copy to itself, no network")
        coll.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def deepep() -> None:
    """DeepEP's Buffer needs 2 ranks or more, one GPU each: here only whether it imports."""
    try:
        import deep_ep
    except ImportError:
        row("deepep backend", "not run", "", "deep_ep is not installed on this machine")
        return
    row("deepep backend", "not run", getattr(deep_ep, "__version__", "installed"),
        "deep_ep imports; its Buffer needs 2+ GPUs" if torch.cuda.device_count() < 2
        else "deep_ep imports; timed across GPUs below")

def across_gpus() -> None:
    """The lockstep backends across GPUs (`benchmarks/ep_latency.py`, 128 tokens x 7168 per
    attention rank, top-8 of 256, bf16 and MXFP4 rows): 8 expert ranks where 9 GPUs or more
    allow (DeepEP publishes its low-latency figures for EP 8, 16, ...: printed beside), else
    one attention rank and an expert rank on every other GPU."""
    import tempfile

    gpus = torch.cuda.device_count()
    if gpus < 2:
        row("torch, nccl and deepep backends across GPUs", "not run", "",
            "one GPU: NCCL and DeepEP give each rank its own")
        return
    experts = 8 if gpus >= 9 else gpus - 1
    attention = min(gpus - experts, 8)
    backends = ["torch", "nccl"]
    with contextlib.suppress(ImportError):  # deepep only where it is installed
        import deep_ep  # noqa: F401

        backends.append("deepep")
    for quantization in ([], ["--quantization", "w4a4"]):
        chosen = [b for b in backends if not (quantization and b == "deepep")]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "ep.json"
            code = _run_group([sys.executable, "-m", "benchmarks.ep_latency", "--device",
                               "cuda", "--attention-ranks", str(attention), "--expert-ranks",
                               str(experts), "--timeout", "60", "--json", str(path),
                               "--backends", *chosen, *quantization], 60 * len(chosen) + 30)
            results = json.loads(path.read_text())["results"] if path.exists() else []
        for r in results:
            name = (f"dispatch+combine, {attention} attention + {experts} expert GPUs, "
                    f"{r['backend']}{', MXFP4 rows' if quantization else ''}")
            if "error" in r:
                row(name, "FAIL", "", r["error"].strip().splitlines()[-1][:200])
            else:
                row(name, "ok" if r["max_rel_err"] <= 2e-2 else "FAIL",
                    f"{r['median_us']:.0f} us", f"128 tokens x 7168 per attention rank, "
                    f"top-8 of 256; max rel err {r['max_rel_err']:.1e}; table above")
        if not results:
            row(f"dispatch across GPUs{' (MXFP4)' if quantization else ''}", "FAIL", "",
                f"ep_latency ended with {code}")


def _run_group(cmd: list[str], timeout: float) -> int | str:
    """Run cmd in its own process group, printing its output; on timeout (or this section
    being stopped) kill the whole group, so no rank is left holding a GPU."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        print(out[-6000:], flush=True)
        return proc.returncode
    except subprocess.TimeoutExpired:
        return f"a timeout after {timeout:g} s"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def nccl_alone(check: str) -> CupyNccl | None:
    """A CuPy NCCL communicator at world size 1; None, with a "not run" row for `check`,
    where CuPy is missing."""
    from common.ports import free_port
    from ep_dispatch.nccl import CupyNccl, import_nccl
    from ep_dispatch.torch_dist import World

    try:
        import_nccl()
    except ValueError as exc:
        row(check, "not run", "", str(exc))
        return None
    return CupyNccl(World(("127.0.0.1", free_port()), 1, 0, rank=0), timeout=60)


def nccl_self() -> None:
    """The CuPy NCCL collective at world size 1: rows sent to oneself come back whole."""
    if (coll := nccl_alone("nccl (CuPy) all-to-all, world size 1")) is None:
        return
    x = torch.randn(128 * 8, 7168, dtype=torch.bfloat16, device="cuda")  # 128 tokens, top-8
    out = torch.empty_like(x)
    coll.all_to_all(out, x, [x.shape[0]], [x.shape[0]])
    ok = torch.equal(out, x) and coll.agree_rounds(1, x.device) == 1
    ms = time_ms(lambda: coll.all_to_all(out, x, [x.shape[0]], [x.shape[0]]), 3, 20, None)
    row("nccl (CuPy) all-to-all, world size 1", "ok" if ok else "FAIL", f"{ms * 1e3:.0f} us",
        "1024 rows x 7168 bf16 to itself (a copy through NCCL, not a network figure); per "
        "call from an idle GPU, the host's launch included")
    coll.close()


def stream_busy(trace: dict[str, object]) -> dict[int, list[tuple[float, float]]]:
    """Each CUDA stream's busy intervals (start, end) in microseconds, merged, from a
    torch.profiler Chrome trace: its kernels and memory copies."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for ev in trace.get("traceEvents", []):  # type: ignore[union-attr]
        if ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in ev:
            stream = int(ev.get("args", {}).get("stream", ev.get("tid", -1)))
            spans.setdefault(stream, []).append((ev["ts"], ev["ts"] + ev["dur"]))
    return {stream: merged(s) for stream, s in spans.items()}


def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intervals (start, end) as their union: sorted, disjoint."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The time both unions of intervals cover (a and b merged: `merged`)."""
    both, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        both += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both


def nccl_pipeline() -> None:
    """The `nccl` backend's ping-pong at world size 1, as `DenseModel.forward_pipelined`
    drives it: per layer, each of 2 micro-batches waits for its last exchange, computes
    (a bf16 matmul standing in for attention, on the current stream) and starts its next
    exchange (rows to itself through `CupyNccl.start_all_to_all`, on the communicator's
    stream). Checked against the same steps with `all_to_all`; profiled (torch.profiler,
    trace in $OUT/nccl_pipeline.json beside --json): the fraction of the time either
    stream is busy that both are, how much of the communicator stream's busy time the
    compute stream was busy too, and the host's time to issue the step against the
    GPU's (no host wait)."""
    if (coll := nccl_alone("nccl (CuPy) ping-pong, world size 1")) is None:
        return
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(7168, 7168, dtype=torch.bfloat16, device="cuda", generator=g) / 85
    xs = [torch.randn(1024, 7168, dtype=torch.bfloat16, device="cuda", generator=g)
          for _ in range(2)]  # 2 micro-batches of 128 tokens x top-8 rows

    def step(pipelined: bool, layers: int = 8) -> list[torch.Tensor]:
        h, works = list(xs), [None, None]
        for _ in range(layers):
            for j in range(2):
                if works[j] is not None:
                    works[j].wait()
                y = h[j] @ w  # [1024, 7168]
                h[j] = torch.empty_like(y)
                if pipelined:
                    works[j] = coll.start_all_to_all(h[j], y, [y.shape[0]], [y.shape[0]])
                else:
                    coll.all_to_all(h[j], y, [y.shape[0]], [y.shape[0]])
        for work in works:
            if work is not None:
                work.wait()
        return h

    same = all(torch.equal(a, b) for a, b in zip(step(True), step(False), strict=True))
    torch.cuda.synchronize()
    host = time.perf_counter()
    step(True)
    issued = time.perf_counter() - host  # the host's time to issue: no wait on the GPU
    torch.cuda.synchronize()
    gpu = time.perf_counter() - host
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(True)
        torch.cuda.synchronize()
    path = Path(JSON_PATH).with_name("nccl_pipeline.json") if JSON_PATH else \
        Path("nccl_pipeline.json")
    prof.export_chrome_trace(str(path))
    busy = stream_busy(json.loads(path.read_text()))
    # The trace names streams by CUPTI's ids, not torch's handles: the matmuls' stream is
    # the busiest (each about 10x the copy of its output); every other one is NCCL's.
    compute = max(busy, key=lambda st: sum(e - s for s, e in busy[st]), default=-1)
    comm_spans = merged([span for st in busy if st != compute for span in busy[st]])
    computing = busy.get(compute, [])
    comm_busy = sum(e - s for s, e in comm_spans)
    hidden = overlap(comm_spans, computing)
    either = sum(e - s for s, e in merged(comm_spans + computing))
    row("nccl (CuPy) ping-pong, world size 1", "ok" if same and comm_busy > 0 else "FAIL",
        f"both streams busy {hidden / either:.0%} of the time" if comm_busy else "",
        f"8 layers x 2 micro-batches (1024 x 7168 bf16 matmul, then its rows to itself); "
        f"outputs {'equal to' if same else 'DIFFERENT from'} all_to_all's; communicator "
        f"stream busy {comm_busy:.0f} us, {hidden / max(comm_busy, 1e-9):.0%} of it while "
        f"the compute stream was; either busy {either:.0f} us; host issued the step in "
        f"{issued * 1e3:.2f} ms of its {gpu * 1e3:.2f} ms; streams seen {sorted(busy)}; "
        f"trace {path.name}")
    coll.close()


def decode_steps() -> None:
    """Decode step time at batch 1, 16 and 64 (bfloat16), eager and replayed from CUDA
    graphs (`--cuda-graph-max-batch 64`, captured at start-up); then one step both ways
    (float and W4A4 experts, 3 sequences: a graph of 4 rows with one padding row)."""
    from common.messages import GenerateRequest, SamplingParams

    def run(e: Engine, batch: int, warm: int, timed: int) -> tuple[float, dict[str, list[int]]]:
        out: dict[str, list[int]] = {}
        for i in range(batch):
            e.add(GenerateRequest(f"r{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(
                max_tokens=1 + warm + timed, temperature=0.0, ignore_eos=True)))
        for step in range(1 + warm + timed):  # the prefill, warm-up, timed steps
            if step == 1 + warm:
                torch.cuda.synchronize()
                start = time.perf_counter()
            for d in e.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / timed * 1e3, out

    for batch in (1, 16, 64):
        eager, _ = run(engine("cuda", "bfloat16"), batch, 5, 20)
        graphed, _ = run(engine("cuda", "bfloat16", cuda_graph_max_batch=64), batch, 5, 20)
        row(f"decode step, demo model, batch {batch}", "info",
            f"{eager:.2f} ms eager, {graphed:.2f} ms CUDA graphs",
            f"cuda bfloat16, local; eager / graphs {eager / graphed:.2f}x")
    # One decode step of 3 sequences (a graph of 4 rows, one padding) both ways. bfloat16
    # float experts: torch._grouped_mm synchronises for other dtypes, so only bf16 captures.
    for dtype, quantization, bound in (("bfloat16", None, 2e-2), ("float32", "w4a4", 1e-5),
                                       ("bfloat16", "w4a4", 2e-2)):
        e = engine("cuda", dtype, quantization, cuda_graph_max_batch=64)
        for i in range(3):
            e.add(GenerateRequest(f"r{i}", PROMPTS[i], SamplingParams(
                max_tokens=4, temperature=0.0, ignore_eos=True)))  # all 3 decode next
        e.step()  # the prefills
        batch = e.runner.batch(e.scheduler.schedule())
        assert e.runner.graphs is not None and e.runner.graphs.fits(batch)
        want = e.runner.model.forward(batch, e.runner.kv, e.runner.experts).float()  # [3, H]
        got = e.runner.graphs.forward(batch).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        row(f"decode step from a CUDA graph vs eager, {dtype}, "
            f"{quantization or 'float'} experts", "ok" if err <= bound else "FAIL",
            f"max rel err {err:.1e}", f"bound {bound:g}; hidden states of 3 sequences")


def decode_profile() -> None:
    """Where a decode step's time goes (batch 16): the cost of one host synchronisation
    here, the synchronisations a step makes (torch's sync debug mode, by source line), each
    step's wall time, and cProfile's top functions over 10 steps."""
    import cProfile
    import pstats
    import statistics
    import warnings
    from collections import Counter
    from pathlib import Path

    from common.messages import GenerateRequest, SamplingParams

    x = torch.ones(1, device="cuda")
    for _ in range(10):
        (x + 1).item()
    start = time.perf_counter()
    for _ in range(200):
        (x + 1).item()
    row("one tiny kernel + .item()", "info", f"{(time.perf_counter() - start) / 200 * 1e6:.0f} us",
        "a host synchronisation's round trip on this machine")
    def started(graphs: int) -> Engine:  # 16 sequences, past the prefill and first decodes
        e = engine("cuda", "bfloat16", cuda_graph_max_batch=graphs)
        for i in range(16):
            e.add(GenerateRequest(f"r{i}", PROMPTS[0], SamplingParams(
                max_tokens=60, temperature=0.0, ignore_eos=True)))
        for _ in range(4):
            e.step()
        torch.cuda.synchronize()
        return e

    for graphs, label in ((64, " (CUDA graphs)"), (0, "")):  # the eager engine stays below
        e = started(graphs)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                e.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        where = Counter(f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}"
                        for w in caught if "synchroniz" in str(w.message))
        row(f"decode step, host synchronisations{label}", "info", f"{sum(where.values())}",
            "; ".join(f"{k} x{v}" for k, v in where.most_common(15)))
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        e.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    row("decode step, batch 16, each step", "info", f"median {statistics.median(times):.1f} ms",
        "min " + f"{min(times):.1f}, max {max(times):.1f} ms (synchronised after each)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        e.step()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--skip-kernel", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true", help="skip the W4A4 kernel sweep")
    ap.add_argument("--budget", type=float, default=450,
                    help="seconds for all sections; a section that would start later is "
                         "reported as not run, one that runs over is stopped")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # a run killed at its limit keeps its lines
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; this check needs an NVIDIA GPU. Nothing to do.")
        return 0
    global JSON_PATH, DEADLINE
    JSON_PATH, DEADLINE = args.json, time.monotonic() + args.budget
    print("| check | result | value | note |\n|---|---|---|---|")
    guarded("machine", machine, 60)
    guarded("preflight", preflight, 150)
    if not args.skip_kernel:
        guarded("W4A4 kernel", kernel, 150)
    guarded("logits", lambda: logits_vs_cpu(None), 90)
    guarded("W4A4 logits", lambda: logits_vs_cpu("w4a4"), 120)
    guarded("FP8 dense", fp8_dense, 60)
    guarded("sampling", sampled_twice, 60)
    guarded("decode steps", decode_steps, 120)
    guarded("decode profile", decode_profile, 60)
    guarded("dispatch path", dispatch_path, 60)
    guarded("nccl (CuPy)", nccl_self, 60)
    guarded("nccl (CuPy) ping-pong", nccl_pipeline, 60)
    guarded("deepep", deepep, 20)
    guarded("dispatch across GPUs", across_gpus, 300)
    if not (args.skip_kernel or args.skip_sweep):  # late: its ~180 configs never ran on a
        # GPU, and a fault would break this process's CUDA context for every later section
        guarded("W4A4 kernel sweep", lambda: kernel_sweep(args.json), 200)
    if not args.skip_serve:
        guarded("serve", serve_vs_cpu, 200)
    return 1 if any(r["result"] == "FAIL" for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
