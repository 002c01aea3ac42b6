"""Triton's interpreter (TRITON_INTERPRET=1), taught three things this project's kernels
use and it gets wrong or lacks, so that CPU tests run the kernels as the GPU compiles them:

- inline PTX (`tl.inline_asm_elementwise`, pack 1), run by `tests.support.ptx`;
- bfloat16 `tl.dot`: the interpreter keeps bfloat16 as its uint16 bits and multiplies the
  bits (triton-lang/triton#11584; upstream does not support it yet). Its operands are
  widened to float32 first, which is exact;
- casts between float32 and bfloat16: the interpreter's truncate where the GPU rounds to
  nearest even, and lose subnormals. Here: bfloat16 is float32's top half, and float32
  rounds to it to nearest even (NaN stays NaN).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from tests.support import ptx

if TYPE_CHECKING:
    from triton.runtime.interpreter import TensorHandle


@contextlib.contextmanager
def taught() -> Iterator[None]:
    """The interpreter with both, while inside."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    real_asm, real_dot, real_cast = builder.create_inline_asm, builder.create_dot, \
        builder.cast_impl

    def create_inline_asm(self: object, asm: str, constraints: str, values: list,
                          types: list, is_pure: bool, pack: int) -> _Results:
        if pack != 1:
            raise NotImplementedError(f"tests/ptx.py runs pack=1 asm only, not pack={pack}")
        outs = ptx.run(asm, constraints, [v.data for v in values])
        handles = []
        for o, t in zip(outs, types, strict=True):
            numpy_type = interpreter._get_np_dtype(t)  # bfloat16: uint16 bits
            if o.itemsize != numpy_type.itemsize:
                raise ValueError(f"asm output constraint {o.dtype} for a {t} result")
            handles.append(interpreter.TensorHandle(o.view(numpy_type),
                                                    getattr(t, "element_ty", t)))
        return _Results(handles)

    def create_dot(self: object, a: TensorHandle, b: TensorHandle, *rest: object
                   ) -> TensorHandle:
        return real_dot(self, _widened(a), _widened(b), *rest)

    def cast_impl(self: object, src: TensorHandle, dst_type: object) -> TensorHandle:
        import triton.language as tl

        kinds = (src.get_element_ty(), dst_type.scalar)
        if kinds == (tl.bfloat16, tl.float32):
            return _widened(src)
        if kinds == (tl.float32, tl.bfloat16):
            return interpreter.TensorHandle(_to_bf16_bits(src.data), tl.bfloat16)
        return real_cast(self, src, dst_type)

    builder.create_inline_asm, builder.create_dot, builder.cast_impl = \
        create_inline_asm, create_dot, cast_impl
    try:
        yield
    finally:
        builder.create_inline_asm, builder.create_dot, builder.cast_impl = \
            real_asm, real_dot, real_cast


def _widened(handle: TensorHandle) -> TensorHandle:
    """A bfloat16 operand (uint16 bits) as the float32 it is; others as they are."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    if handle.get_element_ty() != tl.bfloat16:
        return handle
    bits = handle.data.astype(np.uint32) << np.uint32(16)  # bfloat16 is float32's top half
    return TensorHandle(bits.view(np.float32), tl.float32)


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), to nearest, ties to even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(x)
    return np.where(nan, (bits >> 16) | 0x0040, rounded).astype(np.uint16)


class _Results:
    """What the interpreter's asm call returns: results by index."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def get_result(self, i: int) -> object:
        return self.handles[i]
