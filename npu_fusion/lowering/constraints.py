"""The operators' input constraints, stated once and shared by the meta kernels,
the reference kernels and the pattern pass.

Every check raises :class:`FusedOpInputError` whose message names the broken
constraint, so a bad call fails the same way at trace time (fake tensors) and
at run time (real tensors). Sizes may be SymInts; comparisons on them go through
:func:`torch._check` so that dynamic shapes get a guard instead of a crash.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: RotaryPositionEmbeddingGrad ``mode`` attribute values (SPEC section 1).
ROPE_MODES = {0: "half", 1: "interleave", 2: "quarter", 3: "interleave-half"}

#: RmsNormGrad dtype combinations on Atlas A2/A3: (dy/x, gamma) -> dx, dgamma (fp32).
RMS_NORM_DTYPES = {
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
}


class FusedOpInputError(ValueError):
    """An input violates a fused operator's documented constraint."""


def _require(condition, message: str) -> None:
    if isinstance(condition, torch.SymBool):
        torch._check(condition, lambda: message)
        return
    if not condition:
        raise FusedOpInputError(message)


def _known_or_unknown(condition) -> bool:
    """False only when a (possibly symbolic) condition is known to be false."""
    return bool(torch.fx.experimental.symbolic_shapes.guard_or_true(condition))


def _same_shape(a: Sequence, b: Sequence) -> bool:
    if len(a) != len(b):
        return False
    return all(_known_or_unknown(x == y) for x, y in zip(a, b))


def rope_divisor(mode: int) -> int:
    """The last axis is split into 4 chunks in quarter mode, into halves or pairs otherwise."""
    return 4 if mode == 2 else 2


def check_rope_grad_inputs(dy, cos, sin, x: Optional[torch.Tensor], mode: int) -> None:
    op = "rotary_position_embedding_grad"
    _require(mode in ROPE_MODES, f"{op}: mode must be one of {sorted(ROPE_MODES)} "
             f"({', '.join(f'{k}={v}' for k, v in ROPE_MODES.items())}), got {mode}")
    _require(dy.dtype in FLOAT_DTYPES, f"{op}: dy dtype must be float16, bfloat16 or float32, got {dy.dtype}")
    for name, t in (("cos", cos), ("sin", sin), ("x", x)):
        if t is not None:
            _require(t.dtype == dy.dtype, f"{op}: {name} dtype {t.dtype} must equal dy dtype {dy.dtype}")
    _require(dy.dim() >= 1, f"{op}: dy must have at least one dimension")
    _require(cos.dim() >= 1 and cos.dim() <= dy.dim(),
             f"{op}: cos must have between 1 and dy.dim()={dy.dim()} dimensions, got {cos.dim()}")
    _require(_same_shape(cos.shape, sin.shape),
             f"{op}: cos and sin must have the same shape, got {list(cos.shape)} and {list(sin.shape)}")
    d = dy.shape[-1]
    _require(cos.shape[-1] == d,
             f"{op}: cos/sin last dimension {cos.shape[-1]} must equal dy last dimension {d}")
    div = rope_divisor(mode)
    _require(d % div == 0,
             f"{op}: the last dimension D={d} must be divisible by {div} in {ROPE_MODES[mode]} mode")
    # cos/sin broadcast to dy and broadcasting gives dy's shape.
    lead = dy.dim() - cos.dim()
    for i, c in enumerate(cos.shape):
        n = dy.shape[lead + i]
        _require(_known_or_unknown(c == 1) or _known_or_unknown(c == n),
                 f"{op}: cos/sin shape {list(cos.shape)} must broadcast to dy shape {list(dy.shape)}")
    if x is not None:
        _require(_same_shape(x.shape, dy.shape),
                 f"{op}: x shape {list(x.shape)} must equal dy shape {list(dy.shape)}")


def rms_norm_split(x, gamma) -> int:
    """n such that gamma.shape == x.shape[n:]."""
    return x.dim() - gamma.dim()


def check_rms_norm_grad_inputs(dy, x, rstd, gamma) -> None:
    op = "rms_norm_grad"
    _require(dy.dtype in FLOAT_DTYPES, f"{op}: dy dtype must be float16, bfloat16 or float32, got {dy.dtype}")
    _require(x.dtype == dy.dtype, f"{op}: x dtype {x.dtype} must equal dy dtype {dy.dtype}")
    _require(rstd.dtype == torch.float32, f"{op}: rstd dtype must be float32, got {rstd.dtype}")
    _require((dy.dtype, gamma.dtype) in RMS_NORM_DTYPES,
             f"{op}: unsupported dtype combination dy/x={dy.dtype}, gamma={gamma.dtype}; supported "
             f"(dy, gamma): {sorted((str(a), str(b)) for a, b in RMS_NORM_DTYPES)}")
    _require(1 <= x.dim() <= 8, f"{op}: x must have 1 to 8 dimensions, got {x.dim()}")
    _require(_same_shape(dy.shape, x.shape),
             f"{op}: dy shape {list(dy.shape)} must equal x shape {list(x.shape)}")
    n = rms_norm_split(x, gamma)
    _require(gamma.dim() >= 1 and 0 <= n < x.dim(),
             f"{op}: gamma shape {list(gamma.shape)} must equal x.shape[n:] for some 0 <= n < x.dim()")
    _require(_same_shape(gamma.shape, x.shape[n:]),
             f"{op}: gamma shape {list(gamma.shape)} must equal x.shape[{n}:] = {list(x.shape[n:])}")
    lead = list(x.shape[:n])
    keepdim = lead + [1] * (x.dim() - n)
    _require(_same_shape(rstd.shape, lead) or _same_shape(rstd.shape, keepdim),
             f"{op}: rstd shape {list(rstd.shape)} must equal x.shape[:{n}] = {lead} "
             f"or its keep-dim form {keepdim} (n = x.dim() - gamma.dim())")


def numel(shape) -> int:
    return math.prod(shape)
