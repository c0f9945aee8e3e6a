"""``npu_fusion::rotary_position_embedding_grad``: the backward of single-path RoPE.

Math (SPEC section 1). The forward is ``y = x * cos + rotate(x) * sin`` with
cos/sin broadcast to x's shape; ``rotate`` depends on the mode:

* mode 0, half (HF/NeoX ``rotate_half``): ``rotate(x) = cat(-x2, x1)``, halves.
* mode 1, interleave (GPT-J): pairs ``(x[2j], x[2j+1]) -> (-x[2j+1], x[2j])``.
* mode 2, quarter: ``rotate_half`` applied to each half: ``cat(-x2, x1, -x4, x3)``, quarters.
* mode 3, interleave-half (DeepSeek-V3): x is first de-interleaved,
  ``xd = cat(x[::2], x[1::2])``, then ``y = xd * cos + rotate_half(xd) * sin``.

The backward is the transpose of that linear map in x, and two reductions::

    dx   = rotate^T(dy * sin) + dy * cos        (mode 3: re-interleaved)
    dcos = sum(dy * xd, dims)                   (xd = x except in mode 3)
    dsin = sum(dy * rotate_half(xd), dims)

where ``dims`` are the axes along which cos/sin were broadcast to dy, so dcos
and dsin have cos's shape.

When ``x`` is None, dcos and dsin are not computed (as in aclnn, where the
optional x being null means they are not written): the op returns empty
one-dimensional tensors of shape ``[0]`` in dy's dtype for them. The meta
kernel, the reference kernel and the GE converter all follow that.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .constraints import check_rope_grad_inputs
from .fused_op import FusedOp

OP = FusedOp(name="rotary_position_embedding_grad", ge_op="RotaryPositionEmbeddingGrad", label="RoPE",
             option="rope", spec_section="SPEC section 1", outputs=("dx", "dcos", "dsin"),
             checks=check_rope_grad_inputs)
OP_NAME = f"npu_fusion::{OP.name}"


def _halves(t, parts):
    return t.chunk(parts, dim=-1)


def _evens_odds(t):
    return t[..., ::2], t[..., 1::2]


def _interleave(a, b):
    return torch.stack((a, b), dim=-1).flatten(-2)


def rope_grad_dx(dy, cos, sin, mode: int):
    """dx of SPEC section 1, in dy's (already widened) dtype, broadcasting cos/sin."""
    cos, sin = cos.expand_as(dy), sin.expand_as(dy)
    if mode == 2:
        y, c, s = _halves(dy, 4), _halves(cos, 4), _halves(sin, 4)
        return torch.cat((c[0] * y[0] + s[1] * y[1], c[1] * y[1] - s[0] * y[0],
                          c[2] * y[2] + s[3] * y[3], c[3] * y[3] - s[2] * y[2]), dim=-1)
    split = _evens_odds if mode == 1 else (lambda t: _halves(t, 2))
    (y1, y2), (c1, c2), (s1, s2) = split(dy), split(cos), split(sin)
    first, second = c1 * y1 + s2 * y2, c2 * y2 - s1 * y1
    if mode == 0:
        return torch.cat((first, second), dim=-1)
    return _interleave(first, second)  # modes 1 and 3


def rope_grad_tables(dy, x, mode: int):
    """The per-element factors of dcos and dsin before the broadcast reduction:
    ``(dy * xd, dy * rotate_half(xd))`` with xd as in the module docstring."""
    if mode == 2:
        x1, x2, x3, x4 = _halves(x, 4)
        rotated = torch.cat((-x2, x1, -x4, x3), dim=-1)
        return dy * x, dy * rotated
    if mode == 1:
        x1, x2 = _evens_odds(x)
        return dy * x, dy * _interleave(-x2, x1)
    if mode == 3:
        x1, x2 = _evens_odds(x)
        return dy * torch.cat((x1, x2), dim=-1), dy * torch.cat((-x2, x1), dim=-1)
    x1, x2 = _halves(x, 2)
    return dy * x, dy * torch.cat((-x2, x1), dim=-1)


def reference_kernel(dy, cos, sin, x=None, mode=0):
    """Reference kernel: any device, computes in float32 and casts back to dy's dtype."""
    OP.check_inputs(dy, cos, sin, x, mode)
    dyf, cosf, sinf = dy.float(), cos.float(), sin.float()
    dx = rope_grad_dx(dyf, cosf, sinf, mode).to(dy.dtype)
    if x is None:
        return dx, dy.new_empty((0,)), dy.new_empty((0,))
    dcos, dsin = rope_grad_tables(dyf, x.float(), mode)
    return (dx, dcos.sum_to_size(cos.shape).to(dy.dtype).contiguous(),
            dsin.sum_to_size(cos.shape).to(dy.dtype).contiguous())


# The schema is stated, not inferred: torch 2.6 cannot resolve the typing names of
# postponed (``from __future__ import annotations``) signatures.
@torch.library.custom_op(OP_NAME, mutates_args=(), schema="(Tensor dy, Tensor cos, Tensor sin, Tensor? x=None, "
                         "SymInt mode=0) -> (Tensor, Tensor, Tensor)")
def rotary_position_embedding_grad(
    dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    x: Optional[torch.Tensor] = None, mode: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference_kernel(dy, cos, sin, x, mode)


@rotary_position_embedding_grad.register_fake
def _(dy, cos, sin, x=None, mode=0):
    OP.check_inputs(dy, cos, sin, x, mode)
    dx = dy.new_empty(dy.shape)
    if x is None:
        return dx, dy.new_empty((0,)), dy.new_empty((0,))
    return dx, cos.new_empty(cos.shape), cos.new_empty(cos.shape)
