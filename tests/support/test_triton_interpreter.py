"""The tools that teach Triton's interpreter what the kernels need (tests/triton_interpreter.py):
tests/ptx.py, the PTX interpreter the bf16x2 kernel's asm runs by, against the PTX ISA's
stated semantics and torch's own bfloat16 rounding, and its refusals; and the float32 to
bfloat16 rounding, against torch's. test_triton_mxfp4.py runs the kernels with them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support import ptx, triton_interpreter

RNG = np.random.default_rng(0)
WORDS = RNG.integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32)
OTHER = RNG.integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32)


def one(asm_lines: str, *inputs: np.ndarray, outs: str = "=r") -> list[np.ndarray]:
    ins = ",".join("r" for _ in inputs)
    return ptx.run("{ .reg .b32 t; " + asm_lines + " }", f"{outs},{ins}", list(inputs))


@pytest.mark.parametrize("n", [0, 1, 6, 31, 32, 37])
def test_funnel_shifts_follow_the_isa(n: int) -> None:
    """shf: the 64-bit b:a shifted; wrap takes n mod 32, clamp min(n, 32)."""
    a, b = WORDS.astype(object), OTHER.astype(object)  # Python ints: no overflow
    wide = [(int(hi) << 32) | int(lo) for lo, hi in zip(a, b, strict=True)]
    for mode, k in (("wrap", n % 32), ("clamp", min(n, 32))):
        right = one(f"shf.r.{mode}.b32 $0, $1, $2, {n};", WORDS, OTHER)[0]
        left = one(f"shf.l.{mode}.b32 $0, $1, $2, {n};", WORDS, OTHER)[0]
        assert right.tolist() == [(x >> k) & 0xFFFFFFFF for x in wide]
        assert left.tolist() == [((x << k) >> 32) & 0xFFFFFFFF for x in wide]


def test_bitwise_mov_and_the_unpack_order() -> None:
    got = one("and.b32 t, $2, $3; or.b32 t, t, 0x10; mov.b32 {$0, $1}, t;", WORDS, OTHER,
              outs="=h,=h")
    both = (WORDS & OTHER) | 0x10
    assert np.array_equal(got[0], both & 0xFFFF) and np.array_equal(got[1], both >> 16)


def bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).astype(np.uint32)


def bf16_values(g: torch.Generator, low: int, high: int) -> torch.Tensor:
    """[2, 4000] bfloat16 values as float32: random signs and significands, exponents
    in [low, high)."""
    sign = torch.where(torch.rand(2, 4000, generator=g) < 0.5, -1.0, 1.0)
    exponent = torch.randint(low, high, (2, 4000), generator=g).float()
    return (sign * (1 + torch.rand(2, 4000, generator=g)) * torch.exp2(exponent)).to(
        torch.bfloat16).float()


def test_bf16x2_fma_rounds_once_to_nearest_even_as_torch_does() -> None:
    """Products of bfloat16 pairs (exact in float32, down to 2**-130: subnormal bfloat16
    results) that need rounding to bfloat16; c = -0 in one half, about a * b in the other."""
    g = torch.Generator().manual_seed(1)
    a, b = bf16_values(g, -4, 4), bf16_values(g, -126, 8)
    c = torch.stack([torch.full((4000,), -0.0), (a[1] * b[1]).to(torch.bfloat16).float()])
    exact = a * b + c  # float32, exact here: torch's conversion then rounds once
    assert (exact != exact.to(torch.bfloat16).float()).sum() > 3000  # most need rounding
    word = [bf16_bits(v[0]) | (bf16_bits(v[1]) << 16) for v in (a, b, c)]
    lo, hi = one("fma.rn.bf16x2 t, $2, $3, $4; mov.b32 {$0, $1}, t;", *word, outs="=h,=h")
    assert np.array_equal(lo, bf16_bits(exact[0])) and np.array_equal(hi, bf16_bits(exact[1]))


@pytest.mark.parametrize(("asm", "error"), [
    ("xor.b32 $0, $1, $1;", "does not model 'xor.b32'"),
    ("mov.b32 u, $1; mov.b32 $0, u;", "writes undeclared register u"),
    ("mov.b32 $0, t;", "reads t before it is written"),
    ("mov.b32 t, $1;", r"never writes outputs \['\$0'\]"),
    ("fma.rn.bf16x2 $0, $1, $1, $1;", "not exact in float32"),  # squares overflow
    # 1.0625**2 is a bfloat16 tie; 2**-100 added decides it, and float64 would drop it
    ("mov.b32 t, 0x0D800D80; fma.rn.bf16x2 $0, $2, $2, t;", "not exact in float32"),
])
def test_what_it_does_not_model_is_refused(asm: str, error: str) -> None:
    with pytest.raises((NotImplementedError, ValueError), match=error):
        one(asm, np.array([0x7F7F7F7F], np.uint32), np.array([0x3F883F88], np.uint32))


def test_inputs_are_taken_by_their_bits() -> None:
    ones = np.ones(3, np.float32)
    assert (one("mov.b32 $0, $1;", ones)[0] == 0x3F800000).all()
    with pytest.raises(ValueError, match="input 0 is float64"):
        one("mov.b32 $0, $1;", ones.astype(np.float64))


def test_float32_to_bfloat16_rounds_as_torch_does() -> None:
    """Ties both ways, subnormals, the largest finites (to inf), infinities and NaN."""
    g = torch.Generator().manual_seed(2)
    bits = torch.randint(-2**31, 2**31, (20000,), generator=g, dtype=torch.int64)
    ties = (bits & ~0xFFFF) | 0x8000  # exactly halfway: to even
    x = torch.cat([bits, ties, torch.tensor([0x7F7FFFFF, 0x00000001, 0x807F8000])]).to(
        torch.int32).view(torch.float32)
    x = torch.cat([x, torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0])])
    got = triton_interpreter._to_bf16_bits(x.numpy())
    want = x.to(torch.bfloat16)
    assert x.isnan().sum() > 10 and (x.abs() < 2**-126).sum() > 10
    nan = want.isnan().numpy()
    assert np.array_equal(got[~nan], want.view(torch.int16).numpy().view(np.uint16)[~nan])
    assert torch.from_numpy(got[nan].astype(np.int16)).view(torch.bfloat16).isnan().all()
