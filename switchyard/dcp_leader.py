"""Run this process as the leader (rank 0) of a DCP group whose peers are real processes:
for tests, benchmarks and tools that drive an `Engine` directly."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common.ports import free_port
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.engine import Engine
from switchyard.children import Children


@contextmanager
def leader_engine(model: Path, size: int, interleave: int = 1, peer_threads: int = 1,
                  timeout: float = 300.0, **settings: object) -> Iterator[Engine]:
    """An `Engine` with `dcp_size` = size. Its peers are started as `switchyard attention
    --dcp-rank r` with the same `settings` (AttentionConfig fields), and stopped
    afterwards."""
    port = free_port()
    flags = ["--model", str(model), "--dcp-size", str(size), "--dcp-interleave",
             str(interleave), "--dcp-init", f"127.0.0.1:{port}", "--num-threads",
             str(peer_threads),
             *(f for k, v in settings.items() for f in (f"--{k.replace('_', '-')}", str(v)))]
    children = Children()
    pending = [children.spawn(f"DCP rank {r}", ["attention", *flags, "--dcp-rank", str(r)])
               for r in range(1, size)]
    try:
        engine = build_engine(AttentionConfig(model=model, dcp_size=size, dcp_interleave=interleave,
                                        dcp_init=("127.0.0.1", port), **settings))  # type: ignore[arg-type]
        try:
            deadline = time.monotonic() + timeout
            for p in pending:
                children.wait_ports(p, deadline)
            yield engine
        finally:
            engine.close()
    finally:
        children.stop()
