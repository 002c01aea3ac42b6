"""The CPU's compiled kernels, in `csrc/`.

They cover float32 experts and linears, W4A4 experts and their quantizer, decode attention
over the paged KV cache, RMSNorm and q/k norm + rotary embedding, the router and the
dispatch layout's sort, and a decode step's whole attention block. They are built once per
machine and torch version with torch's cpp_extension (gcc, ninja) into torch's extension
cache, and loaded on first use. A machine that cannot build them runs the torch path, and
says why once; `SWITCHYARD_CPU_KERNELS=0` chooses the torch path.
`SWITCHYARD_CPU_KERNELS_PREBUILT` names a read-only folder of builds made beforehand, such
as an image's, which is looked in first. It is kept apart from the extension cache, where
compose mounts a volume that Docker would otherwise fill from the image as each container
is created.

The W4A4 grouped SwiGLU (`csrc/w4a4_cpu.cpp`) is one call per layer over every local expert.
It reads MXFP4 bytes, 4.25 bits a weight, and never makes a float copy. The activations are
decoded once per call to int8, and each 32-block is multiplied exactly in integers, then
scaled by the two blocks' powers of two; only the float sum over blocks rounds. Doubled
E2M1 values are integers up to 12. On AVX2, `vpshufb` maps codes to magnitudes and signs,
and `vpmaddubsw`/`vpmaddwd` sum the products in 16 and 32 bits; AVX-512 without VNNI takes
two blocks at a time. The kernel re-quantizes the SwiGLU output before the down projection.
Its quantizer, used on the attention side too (`selection.quantize_fused`), is bit for bit
`mxfp4.quantize`.

With AVX512-VNNI, and K a multiple of 128, the weights are re-ordered once at load into
MXFP4 panels (`panels.MXFP4Panels`, by the kernel's own `w4a4_panels`). A register block of
4 columns then reads one sequential stream. Read as stored, it would be 4 interleaved
streams a row apart, which the prefetchers followed poorly. One load gives a column's four
blocks. `vpermb` maps codes to doubled value + 12, unsigned. `vpdpbusd` multiplies them by
the signed activations, starting from the activations' -12 x lane sums, which are kept with
the decoded rows, so the integer sums are exact. The 4 columns' lanes are summed per block
in integers, and one convert and one multiply by the blocks' scales (`vscalefps` from the
E8M0 bytes) serve all 4.

A layer's call is two parallel loops over every expert's tiles at once, with no barrier per
expert, since a decode step gives most experts 1 to 4 rows. The tiles are 32 gate and 32 up
columns, ending in their SwiGLU and its re-quantized 32-block, then down columns. The
float32 grouped kernel is built the same way. Each expert's `start, end` is then its share
of the call, not an interval of its own: its tiles' time over the threads, laid end to end
from the call's start.

The float32 experts, the dense projections and lm_head run `csrc/f32_cpu.cpp` over float32
panels (`panels`, made by `selection.panels_for_cpu` in `ExpertBank` and `DenseModel`). Each
task streams its panels as one sequential read and multiplies them as outer products in a
6 x 64 register tile on AVX-512, or 2 x 32 on AVX2. So a decode step's few rows run at the
memory's bandwidth, and a batch's or a prefill's at the FMA units' rate. The experts' gate
and up panels are multiplied together, and SwiGLU is applied in the same task. The int8
linear is `csrc/int8_cpu.cpp` (`moe_kernels.int8`). The layer math has its kernels too, in
`csrc/layers_cpu.cpp`, called by `services/model/layers.py`:

- RMSNorm;
- the q/k per-head RMSNorm with rotary embedding from the stacked qkv, in one call where
  torch runs 6 to 24 small operations;
- `ep_dispatch.layout.combine`'s weighted sum in float32;
- the router's softmax, top-k and renormalisation, `route_f32`;
- the dispatch layout's sort, `sort_rows_cpu`, a counting sort.

Decode attention is `csrc/attention_cpu.cpp`. At a decode step on its own cache, the whole
attention block of a layer is one call (`csrc/decode_layer_cpu.cpp`,
`DenseModel.attention_block`): norm, qkv, rotary, KV write, attention, o, residual add and
norm, with the same kernels and the same bits. That is because the Python between kernels
ran with cold caches after each weight stream, and cost about a fifth of a batch-1 step.
The compiled attention blocks read the int8 panels too, so a decode layer stays one call.
With the `local` backend a MoE layer is one call as well (`csrc/moe_layer_cpu.cpp`,
`ep_dispatch.local`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger("switchyard.expert")
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("module.cpp", "f32_cpu.cpp", "int8_cpu.cpp", "w4a4_cpu.cpp",
                        "attention_cpu.cpp", "layers_cpu.cpp", "decode_layer_cpu.cpp",
                        "mla_cpu.cpp", "moe_layer_cpu.cpp")]
_lock = threading.Lock()
_loaded: ModuleType | None = None
_failed = False
_built: ModuleType | None = None  # kept across `set_enabled`: switching back costs nothing


def cpu_kernels() -> ModuleType | None:
    """The built extension, or None when disabled or when the build failed, which is
    logged once."""
    global _loaded, _failed
    if _loaded is not None or _failed:
        return _loaded
    with _lock:
        if _loaded is None and not _failed:
            if os.environ.get("SWITCHYARD_CPU_KERNELS", "1") in ("", "0", "false"):
                _failed = True
            else:
                _loaded = _built or _build()
                _failed = _loaded is None
    return _loaded


def set_enabled(enabled: bool) -> None:
    """Choose the kernel, built on the next use, or the torch path, for this process. This
    does what `SWITCHYARD_CPU_KERNELS` does at start-up; benchmarks compare the two in one
    run."""
    global _loaded, _failed, _built
    with _lock:
        _built = _loaded or _built
        _loaded, _failed = (_built, False) if enabled else (None, True)


def release_threads() -> None:
    """Free the calling thread's OpenMP team, after loading on a thread that will not run
    steps (`common.compute`). Where the kernels were not loaded, on a GPU or the torch
    path, it does nothing: this never builds them."""
    if _loaded is not None:
        _loaded.release_threads()


CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]


def build_name() -> str:
    """The extension's name: one per torch build, Python, kernel source and flags. Every
    venv with that torch shares the build: it is imported from the cache as it is, without
    ninja, whose commands name each venv's include paths and would rebuild it for each."""
    import torch

    digest = hashlib.sha1(f"{torch.__version__} {torch.version.git_version} "
                          f"{sys.version_info[:2]} {platform.machine()} {CFLAGS} {LDFLAGS}"
                          .encode())
    for path in sorted(p for p in (Path(__file__).parent / "csrc").iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"switchyard_cpu_kernels_{digest.hexdigest()[:12]}"


def _build() -> ModuleType | None:
    from torch.utils.cpp_extension import get_default_build_root, load

    start = time.monotonic()
    name = build_name()
    directory = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
    prebuilt = os.environ.get("SWITCHYARD_CPU_KERNELS_PREBUILT")
    places = [Path(prebuilt) / name, directory] if prebuilt else [directory]
    found = next((d for d in places if (d / "ready").exists()), None)  # a whole build
    try:
        if found is not None:
            module = _import(name, found / f"{name}.so")
        else:
            log.info("building the CPU kernels (once per machine and torch version: 1-3 min "
                     "on 2 cores) ...")
            directory.mkdir(parents=True, exist_ok=True)
            module = load(name, [str(s) for s in SOURCES], extra_cflags=CFLAGS,
                          extra_ldflags=LDFLAGS, build_directory=str(directory), verbose=False)
            (directory / "ready").touch()
    except Exception as exc:  # no compiler, no ninja, an unsupported machine, ...
        reason = (str(exc).strip().splitlines() or [repr(exc)])[-1]
        log.warning("the CPU kernels could not be built (%s); the experts and dense "
                    "projections run on torch's matmuls instead", reason)
        return None
    log.info("CPU kernels ready in %.1f s", time.monotonic() - start)
    return module


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
