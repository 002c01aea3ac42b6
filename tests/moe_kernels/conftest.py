"""The compiled CPU kernels, built once for the tests that call them."""

from __future__ import annotations

import pytest

from moe_kernels import cpu_kernels


@pytest.fixture(scope="module")
def kernel() -> object:
    module = cpu_kernels.cpu_kernels()
    if module is None:
        pytest.fail("the CPU kernels did not build on this machine (gcc and ninja are there)")
    return module

