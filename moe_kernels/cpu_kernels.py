"""The CPU's compiled kernels (`csrc/`: float32 experts and linears, W4A4 experts and their
quantizer, decode attention over the paged KV cache, RMSNorm and q/k norm + rotary
embedding, the router and the dispatch layout's sort, a decode step's whole attention
block), built once per machine
with torch's cpp_extension (gcc, ninja) into torch's extension cache, and loaded on first
use. A machine that cannot build them runs
the torch path, and says why once; `SWITCHYARD_CPU_KERNELS=0` chooses the torch path."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger("switchyard.expert")
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("module.cpp", "f32_cpu.cpp", "w4a4_cpu.cpp", "attention_cpu.cpp",
                         "layers_cpu.cpp", "decode_layer_cpu.cpp", "mla_cpu.cpp")]
_lock = threading.Lock()
_loaded: ModuleType | None = None
_failed = False
_built: ModuleType | None = None  # kept across `set_enabled`: switching back costs nothing


def cpu_kernels() -> ModuleType | None:
    """The built extension, or None (disabled, or the build failed: logged once)."""
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
    """Choose the kernel (built on the next use) or the torch path, for this process: what
    `SWITCHYARD_CPU_KERNELS` does at start-up (benchmarks compare the two in one run)."""
    global _loaded, _failed, _built
    with _lock:
        _built = _loaded or _built
        _loaded, _failed = (_built, False) if enabled else (None, True)


def release_threads() -> None:
    """Free the calling thread's OpenMP team, after loading on a thread that will not run
    steps (`common.compute`); nothing where the kernels were not loaded (a GPU, or the
    torch path): this never builds them."""
    if _loaded is not None:
        _loaded.release_threads()


def build_name() -> str:
    """The extension's name, one per torch installation: its build directory in torch's
    cache holds a ninja file with that installation's include paths, so two venvs sharing
    one name would rebuild it for each other in turn (and race while they do)."""
    import torch

    where = hashlib.sha1(f"{torch.__path__[0]} {torch.__version__}".encode()).hexdigest()
    return f"switchyard_cpu_kernels_{where[:12]}"


def _build() -> ModuleType | None:
    from torch.utils.cpp_extension import load

    start = time.monotonic()
    log.info("loading the CPU kernels (built once per machine and torch install: 1-3 min "
             "on 2 cores) ...")
    try:
        module = load(build_name(), [str(s) for s in SOURCES],
                      extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
                      extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, an unsupported machine, ...
        reason = (str(exc).strip().splitlines() or [repr(exc)])[-1]
        log.warning("the CPU kernels could not be built (%s); the experts and dense "
                    "projections run on torch's matmuls instead", reason)
        return None
    log.info("CPU kernels ready in %.1f s", time.monotonic() - start)
    return module
