"""`switchyard serve` of the bundled demo model, one per server configuration that several
test files start with the same flags and do not change (no service killed, no rebalance, no
restart, no flags of their own): started once in a pytest process (under pytest-xdist, once
per worker that runs a test needing it), stopped at the session's end.

A test that kills services, rebalances, needs its own flags or environment, or reads
counters as though the server were fresh starts its own `Served`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from switchyard.serve_process import Served


@pytest.fixture(scope="session")
def served_demo() -> Iterator[Served]:
    """No flags: the default model (with its tokenizer and chat template) and topology,
    gateway, attention, 2 expert services over rpc."""
    with Served([]) as served:
        yield served


@pytest.fixture(scope="session")
def served_demo_local() -> Iterator[Served]:
    """The demo model in one process: `--dispatch-backend local`."""
    with Served(["--dispatch-backend", "local"]) as served:
        yield served


@pytest.fixture(scope="session")
def served_demo_w4a4() -> Iterator[Served]:
    """The demo model with W4A4 experts: `--quantization w4a4`."""
    with Served(["--quantization", "w4a4"]) as served:
        yield served
