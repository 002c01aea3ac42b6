"""A PTX interpreter for the instructions the project's inline asm uses, so that CPU tests run
the asm text itself, not a restatement of it.

Semantics follow NVIDIA's PTX ISA reference, instruction by instruction:
- `mov.b32 d, a`: a copy; `mov.b32 {lo, hi}, a`: the unpack, lo = a[15:0], hi = a[31:16].
- `and.b32`, `or.b32 d, a, b`: bitwise.
- `shf.{l,r}.{wrap,clamp}.b32 d, a, b, c`: the funnel shift of the 64-bit b:a (b the high
  word) by n = c & 31 (wrap) or min(c, 32) (clamp); shf.r keeps the low 32 bits,
  shf.l the high 32.
- `fma.rn.bf16x2 d, a, b, c`: per 16-bit half, a * b + c rounded once to the nearest
  bfloat16, ties to even; no flush of subnormals (the bf16 forms have no .ftz).

Anything else is refused with an error naming it, rather than guessed: other instructions,
NaNs, and fma results that this model cannot round exactly once (a * b + c not exact in
float32 before the rounding to bfloat16; the kernel's fma adds -0, so its products always
are). Values are numpy arrays, elementwise, taken by their bits (uint32 for `r`, uint16
for `h` operands).
"""

from __future__ import annotations

import re

import numpy as np

_MASK32 = np.uint64(0xFFFFFFFF)


def run(asm: str, constraints: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Run `asm` (the text given to `tl.inline_asm_elementwise`, one element per call) on
    `inputs`, bound in order to the constraints' input operands ("r": 32-bit, "h": 16-bit).

    Returns the outputs ("=r" as uint32, "=h" as uint16 arrays), in constraint order.
    """
    kinds = [c.strip() for c in constraints.split(",")]
    outs = [k[1:] for k in kinds if k.startswith("=")]
    ins = [k for k in kinds if not k.startswith("=")]
    if len(ins) != len(inputs) or set(outs + ins) - {"r", "h"}:
        raise ValueError(f"constraints {constraints!r} for {len(inputs)} inputs")
    shape = np.broadcast_shapes(*(np.shape(x) for x in inputs))
    regs: dict[str, np.ndarray | None] = {f"${i}": None for i in range(len(outs))}
    widths = {f"${i}": 16 if k == "h" else 32 for i, k in enumerate(outs + ins)}
    for i, (kind, x) in enumerate(zip(ins, inputs, strict=True)):
        x = np.asarray(x)
        if x.itemsize != (2 if kind == "h" else 4):
            raise ValueError(f"input {i} is {x.dtype}, not a {kind!r} operand's width")
        value = x.view(f"u{x.itemsize}").astype(np.uint64)  # its bits, not its value
        regs[f"${len(outs) + i}"] = np.broadcast_to(value, shape)
    for statement in _statements(asm):
        _execute(statement, regs, widths)
    missing = [f"${i}" for i in range(len(outs)) if regs[f"${i}"] is None]
    if missing:
        raise ValueError(f"the asm never writes outputs {missing}")
    return [regs[f"${i}"].astype(np.uint16 if k == "h" else np.uint32)
            for i, k in enumerate(outs)]


def _statements(asm: str) -> list[str]:
    body = re.sub(r"//[^\n]*", "", asm).strip()
    if body.startswith("{") and body.endswith("}"):  # the block that scopes .reg names
        body = body[1:-1]
    return [s.strip() for s in body.split(";") if s.strip()]


def _execute(statement: str, regs: dict, widths: dict[str, int]) -> None:
    op, _, rest = statement.partition(" ")
    if op == ".reg":
        kind, _, names = rest.strip().partition(" ")
        for name in names.split(","):
            regs[name.strip()], widths[name.strip()] = None, int(kind.lstrip(".b"))
        return
    args = [a.strip() for a in re.split(r",(?![^{]*})", rest)]  # commas outside {...}

    def value(a: str) -> np.ndarray:
        if a in regs:
            if regs[a] is None:
                raise ValueError(f"{statement!r} reads {a} before it is written")
            return regs[a]
        return np.uint64(int(a, 0))

    def write(d: str, v: np.ndarray) -> None:
        if d not in regs:
            raise ValueError(f"{statement!r} writes undeclared register {d}")
        if widths[d] != 32:
            raise ValueError(f"{statement!r} writes 32 bits to {d}, a {widths[d]}-bit operand")
        regs[d] = v & _MASK32

    if op == "mov.b32" and args[0].startswith("{"):
        lo, hi = (s.strip() for s in args[0].strip("{}").split(","))
        for name, part in ((lo, value(args[1]) & np.uint64(0xFFFF)),
                           (hi, value(args[1]) >> np.uint64(16))):
            if widths.get(name) != 16:
                raise ValueError(f"{statement!r} unpacks into {name}, not a 16-bit operand")
            regs[name] = part
    elif op == "mov.b32":
        write(args[0], value(args[1]))
    elif op == "and.b32":
        write(args[0], value(args[1]) & value(args[2]))
    elif op == "or.b32":
        write(args[0], value(args[1]) | value(args[2]))
    elif re.fullmatch(r"shf\.[lr]\.(wrap|clamp)\.b32", op):
        a, b, c = (value(x) for x in args[1:])
        n = c & np.uint64(31) if ".wrap" in op else np.minimum(c, np.uint64(32))
        wide = (b << np.uint64(32)) | a  # [63:32] = b, [31:0] = a
        write(args[0], wide >> n if op.startswith("shf.r") else (wide << n) >> np.uint64(32))
    elif op == "fma.rn.bf16x2":
        a, b, c = (value(x) for x in args[1:])
        halves = [_fma_bf16(*((v >> np.uint64(s)) & np.uint64(0xFFFF) for v in (a, b, c)),
                            statement) for s in (0, 16)]
        write(args[0], halves[0] | (halves[1] << np.uint64(16)))
    else:
        raise NotImplementedError(f"tests/ptx.py does not model {op!r} (in {statement!r})")


def _fma_bf16(a: np.ndarray, b: np.ndarray, c: np.ndarray, statement: str) -> np.ndarray:
    """bfloat16 bits a * b + c, each an array of uint64 holding 16-bit patterns."""
    def f64(bits: np.ndarray) -> np.ndarray:  # bfloat16 is float32's top half
        return (np.asarray(bits, np.uint64) << np.uint64(16)).astype(np.uint32).view(
            np.float32).astype(np.float64)
    product, addend = f64(a) * f64(b), f64(c)  # a product of 8-bit significands: exact
    exact = product + addend
    t = exact - product  # TwoSum: what the float64 sum lost
    lost = (product - (exact - t)) + (addend - t)
    with np.errstate(over="ignore", invalid="ignore"):
        single = exact.astype(np.float32)
        unmodelled = np.isnan(exact) | (np.isfinite(exact) & (lost != 0)) | (
            single.astype(np.float64) != exact)
    if unmodelled.any():
        raise NotImplementedError(f"{statement!r}: a NaN, or an fma result not exact in "
                                  f"float32, which this model cannot round once")
    bits = single.view(np.uint32).astype(np.uint64)
    # round float32 to bfloat16, to nearest, ties to even (infinities pass through)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    return rounded & np.uint64(0xFFFF)
