"""The operators' input constraints, stated once and shared by the meta kernels,
the reference kernels and the pattern pass.

Only the constraints that hold on every target are here (SPEC sections 1 and 2:
the union of what Ascend 950, Atlas A2/A3 and the inference series accept); the
stricter per-target limits are the pass's ``target_problem``.

Every check raises :class:`FusedOpInputError` whose message names the broken
constraint, so a bad call fails the same way at trace time (fake tensors, static
or symbolic sizes) and at run time (real tensors). A condition on SymInts that
must hold (a size limit) goes through ``torch._check_with``, so dynamic shapes
get a guard or a runtime assertion; a comparison of two shapes refuses what a
guard can decide differs, and passes a data-dependent size that no guard can decide.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import torch
from torch.fx.experimental import symbolic_shapes

from ..compat import guard_or_true as _guard_or_true

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: RotaryPositionEmbeddingGrad ``mode`` attribute values (SPEC section 1).
ROPE_MODES = {0: "half", 1: "interleave", 2: "quarter", 3: "interleave-half"}

#: The largest last axis D that any target accepts (950: D <= 1024; A2/A3: D < 896).
ROPE_MAX_D = 1024

#: dy layouts: BNSD, BSND, SBND (4 axes) on every target, TND (3 axes) on Ascend 950.
ROPE_DY_RANKS = (3, 4)

#: RmsNormGrad tensors are ND with 1 to 8 axes (SPEC section 2).
RMS_NORM_MAX_RANK = 8

#: RmsNormGrad dtype combinations on Atlas A2/A3, a superset of the inference series':
#: (dy/x, gamma) -> dx, dgamma (fp32).
RMS_NORM_DTYPES = {
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
}

Message = Union[str, Callable[[], str]]


class FusedOpInputError(ValueError):
    """An input violates a fused operator's documented constraint."""


# -- symbolic-size helpers -------------------------------------------------------

def _require(condition, message: Message) -> None:
    """Raise FusedOpInputError(message) unless ``condition``; messages may be lazy."""
    lazy = message if callable(message) else (lambda: message)
    if isinstance(condition, torch.SymBool):
        torch._check_with(FusedOpInputError, condition, lazy)
    elif not condition:
        raise FusedOpInputError(lazy())


def _shown(sizes) -> list:
    """Sizes for a message: a symbolic size as its value in this trace, where it has one."""
    return [s.node.hint if isinstance(s, torch.SymInt) and s.node.hint is not None else s for s in sizes]


def _same_shape(a: Sequence, b: Sequence) -> bool:
    return len(a) == len(b) and all(_guard_or_true(x == y) for x, y in zip(a, b))


def _broadcasts_to(small: Sequence, big: Sequence) -> bool:
    """``small`` broadcasts to ``big`` and broadcasting gives ``big`` (not a larger shape)."""
    if len(small) > len(big):
        return False
    lead = len(big) - len(small)
    return all(_guard_or_true(s == 1) or _guard_or_true(s == b) for s, b in zip(small, big[lead:]))


def _require_one_device(op: str, named) -> None:
    devices = {t.device for _, t in named if t is not None}
    _require(len(devices) <= 1, lambda: f"{op}: all tensor arguments must be on the same device, got "
             + ", ".join(f"{name} on {t.device}" for name, t in named if t is not None))


def _require_dtype_like(op: str, reference: str, ref, named) -> None:
    for name, t in named:
        if t is not None:
            _require(t.dtype == ref.dtype, lambda: f"{op}: {name} dtype {t.dtype} must equal {reference} "
                     f"dtype {ref.dtype}")


def _require_float(op: str, name: str, t) -> None:
    _require(t.dtype in FLOAT_DTYPES,
             lambda: f"{op}: {name} dtype must be float16, bfloat16 or float32, got {t.dtype}")


# -- RotaryPositionEmbeddingGrad ------------------------------------------------

def rope_divisor(mode: int) -> int:
    """The last axis is split into 4 chunks in quarter mode, into halves or pairs otherwise."""
    return 4 if mode == 2 else 2


def _rope_mode(op: str, mode):
    if isinstance(mode, torch.SymInt):  # an attribute: the kernel is chosen by it, so specialise
        mode = symbolic_shapes.guard_int(mode)
    _require(type(mode) is int and mode in ROPE_MODES,
             lambda: f"{op}: mode must be an int, one of {sorted(ROPE_MODES)} "
             f"({', '.join(f'{k}={v}' for k, v in ROPE_MODES.items())}), got {mode!r}")
    return mode


def _require_rope_ranks(op: str, dy, cos) -> None:
    _require(dy.dim() in ROPE_DY_RANKS,
             lambda: f"{op}: dy must have 3 or 4 dimensions (layouts BNSD, BSND, SBND, TND), got {dy.dim()}")
    _require(1 <= cos.dim() <= dy.dim(),
             lambda: f"{op}: cos/sin must have between 1 and dy.dim()={dy.dim()} dimensions, got {cos.dim()}")


def _require_rope_last_axis(op: str, dy, cos, mode: int) -> None:
    d, (shown_d,) = dy.shape[-1], _shown(dy.shape[-1:])
    _require(_guard_or_true(cos.shape[-1] == d), lambda: f"{op}: cos/sin last dimension "
             f"{_shown(cos.shape[-1:])[0]} must equal dy last dimension D={shown_d}")
    _require(d <= ROPE_MAX_D, lambda: f"{op}: the last dimension D={shown_d} must be <= {ROPE_MAX_D}")
    div = rope_divisor(mode)
    _require(d % div == 0, lambda: f"{op}: the last dimension D={shown_d} must be divisible by {div} "
             f"in {ROPE_MODES[mode]} mode")


def _require_rope_tables(op: str, dy, cos, sin) -> None:
    _require(_same_shape(cos.shape, sin.shape),
             lambda: f"{op}: cos and sin must have the same shape, got {_shown(cos.shape)} and "
             f"{_shown(sin.shape)}")
    _require(_broadcasts_to(cos.shape, dy.shape),
             lambda: f"{op}: cos/sin shape {_shown(cos.shape)} must broadcast to dy shape {_shown(dy.shape)} "
             f"without enlarging it")
    if dy.dim() == 3:
        _require(cos.dim() == 3 and _guard_or_true(cos.shape[0] == dy.shape[0]),
                 lambda: f"{op}: with TND dy {_shown(dy.shape)}, cos/sin must be T1D or TND, "
                 f"got {_shown(cos.shape)}")


def check_rope_grad_inputs(dy, cos, sin, x: Optional[torch.Tensor], mode: int) -> None:
    op = "rotary_position_embedding_grad"
    mode = _rope_mode(op, mode)
    _require_one_device(op, (("dy", dy), ("cos", cos), ("sin", sin), ("x", x)))
    _require_float(op, "dy", dy)
    _require_dtype_like(op, "dy", dy, (("cos", cos), ("sin", sin), ("x", x)))
    _require_rope_ranks(op, dy, cos)
    _require_rope_last_axis(op, dy, cos, mode)
    _require_rope_tables(op, dy, cos, sin)
    if x is not None:
        _require(_same_shape(x.shape, dy.shape),
                 lambda: f"{op}: x shape {_shown(x.shape)} must equal dy shape {_shown(dy.shape)}")


# -- RmsNormGrad ----------------------------------------------------------------

def rms_norm_split(x, gamma) -> int:
    """n such that gamma.shape == x.shape[n:]."""
    return x.dim() - gamma.dim()


def _require_rms_norm_dtypes(op: str, dy, x, rstd, gamma) -> None:
    _require_float(op, "dy", dy)
    _require_dtype_like(op, "dy", dy, (("x", x),))
    _require(rstd.dtype == torch.float32, lambda: f"{op}: rstd dtype must be float32, got {rstd.dtype}")
    _require((dy.dtype, gamma.dtype) in RMS_NORM_DTYPES,
             lambda: f"{op}: unsupported dtype combination dy/x={dy.dtype}, gamma={gamma.dtype}; supported "
             f"(dy, gamma): {sorted((str(a), str(b)) for a, b in RMS_NORM_DTYPES)}")


def _require_rms_norm_shapes(op: str, dy, x, rstd, gamma) -> None:
    _require(1 <= x.dim() <= RMS_NORM_MAX_RANK,
             lambda: f"{op}: x must have 1 to {RMS_NORM_MAX_RANK} dimensions, got {x.dim()}")
    _require(_same_shape(dy.shape, x.shape),
             lambda: f"{op}: dy shape {_shown(dy.shape)} must equal x shape {_shown(x.shape)}")
    n = rms_norm_split(x, gamma)
    _require(0 <= n < x.dim() and _same_shape(gamma.shape, x.shape[n:]),
             lambda: f"{op}: gamma shape {_shown(gamma.shape)} must equal x.shape[n:] for some "
             f"0 <= n < x.dim(); x shape is {_shown(x.shape)}")
    lead = list(x.shape[:n])
    keepdim = lead + [1] * (x.dim() - n)
    _require(_same_shape(rstd.shape, lead) or _same_shape(rstd.shape, keepdim),
             lambda: f"{op}: rstd shape {_shown(rstd.shape)} must equal x.shape[:{n}] = {_shown(lead)} "
             f"or its keep-dim form {_shown(keepdim)} (n = x.dim() - gamma.dim())")
    # The original document gives rstd 1 to 8 axes, so for n = 0 only the keep-dim form.
    _require(rstd.dim() >= 1,
             lambda: f"{op}: rstd must have 1 to {RMS_NORM_MAX_RANK} dimensions, got 0 (use the keep-dim "
             f"shape {_shown(keepdim)})")


def check_rms_norm_grad_inputs(dy, x, rstd, gamma) -> None:
    op = "rms_norm_grad"
    _require_one_device(op, (("dy", dy), ("x", x), ("rstd", rstd), ("gamma", gamma)))
    _require_rms_norm_dtypes(op, dy, x, rstd, gamma)
    _require_rms_norm_shapes(op, dy, x, rstd, gamma)


def numel(shape) -> int:
    return math.prod(shape)
