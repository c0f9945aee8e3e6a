"""Single-path RoPE's forward as the fused op ``npu_fusion::rotary_position_embedding``.

``npu_fusion::rotary_position_embedding``: single-path RoPE's forward (GE
``RotaryPositionEmbedding``, torch_npu ``npu_rotary_mul``).

Math (docs/fused-ops.md#rotary_position_embedding; modes as for the backward)::

    y = x * cos + rotate(x) * sin        (cos/sin broadcast to x's shape)

* mode 0, half: ``rotate(x) = cat(-x2, x1)``; mode 1, interleave: pairs
  ``(x[2j], x[2j+1]) -> (-x[2j+1], x[2j])``; mode 2, quarter: ``cat(-x2, x1, -x4, x3)``;
  mode 3, interleave-half: ``xd = cat(x[::2], x[1::2])``, ``y = xd*cos + rotate_half(xd)*sin``.

y has x's shape and dtype. Contracts: torch_npu's ``npu_rotary_mul(Tensor self, Tensor r1,
Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor`` (eagerly ``half`` and
``interleave`` only: "The rotary_mode of npu_rotary_mul should be half or interleave"),
and ``REG_OP(RotaryPositionEmbedding)``: inputs x, cos, sin, optional rotate (never fed),
output y, attribute ``mode`` (Int, 0); torchair's own converter maps all four modes to it
on Ascend 950 and half/interleave elsewhere.

Constraints are the backward's (:mod:`.rope_grad`, x in dy's place): torch_npu's docs give
the same A2/A3 layouts and limits for ``npu_rotary_mul`` (B*N <= 1024 only when cos/sin
gradients are computed, which the forward does not), modes 2 and 3 on Ascend 950 only.
"""
from __future__ import annotations

import torch

from ..checks import require_dtype_like, require_float, require_one_device
from ..fused_op import FusedOp, GeAttr, GeInput, GeIr, NpuBinding
from .rope_grad import (ROPE_KINDS, TORCH_NPU_ROTARY_MODES, check_rope_tables, rope_mode,
                        rope_supported_cases, rope_target_problem, rope_unfused)


def check_rope_inputs(op: str, x, cos, sin, mode: int) -> None:
    """The constraints that hold on every target; ``op`` names the op in messages."""
    mode = rope_mode(op, mode)
    require_one_device(op, (("x", x), ("cos", cos), ("sin", sin)))
    require_float(op, "x", x)
    require_dtype_like(op, "x", x, (("cos", cos), ("sin", sin)))
    check_rope_tables(op, "x", x, cos, sin, mode)


def _target_problem(target, x, cos, sin, mode):
    return rope_target_problem(target, mode, tuple(x.shape), tuple(cos.shape), False, x.dtype)


def _rotate(x, mode: int):
    """``rotate`` of the module docstring by chunks and even/odd views (mode 3 after de-interleaving)."""
    if mode == 2:
        x1, x2, x3, x4 = x.chunk(4, dim=-1)
        return torch.cat((-x2, x1, -x4, x3), dim=-1)
    if mode == 1:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def reference_kernel(x, cos, sin, mode):
    """Reference kernel: any device, computes in float32 and casts back to x's dtype."""
    OP.check_inputs(x, cos, sin, mode)
    xf = x.float()
    if mode == 3:  # de-interleave x, then rotate_half
        xf = torch.cat((xf[..., ::2], xf[..., 1::2]), dim=-1)
    # contiguous, as the meta kernel says (elementwise ops would keep a transposed x's layout)
    return (xf * cos.float() + _rotate(xf, mode) * sin.float()).to(x.dtype).contiguous()


def meta_kernel(x, cos, sin, mode):
    OP.check_inputs(x, cos, sin, mode)
    return x.new_empty(x.shape)


def unfused(x, cos, sin, mode):
    """The forward as a model writes it, in the inputs' dtype."""
    return rope_unfused(x, cos, sin, mode)


def cases():
    """The declared cases as arguments ``(x, cos, sin, mode)``.

    ``(x, cos, sin, mode)``: the backward's declared cases with x (every mode and dtype, every
    A2/A3 table layout)."""
    generator = torch.Generator().manual_seed(0)
    for dt, x, cos, with_x, mode in rope_supported_cases():
        if with_x:
            def t(shape):
                return torch.randn(shape, generator=generator).to(dt)
            yield t(x), t(cos), t(cos), mode


OP = FusedOp(
    name="rotary_position_embedding", ge_op="RotaryPositionEmbedding", label="RoPE forward",
    option="rope_forward", spec_section="docs/fused-ops.md#rotary_position_embedding",
    outputs=("y",), checks=check_rope_inputs,
    schema="(Tensor x, Tensor cos, Tensor sin, int mode) -> Tensor",
    reference=reference_kernel, meta=meta_kernel, unfused=unfused, target_problem=_target_problem, cases=cases,
    npu=NpuBinding(op="npu_rotary_mul", positional=("x", "cos", "sin"), keywords=(("rotary_mode", "mode"),),
                   values={"mode": TORCH_NPU_ROTARY_MODES}),
    ge=GeIr(op="RotaryPositionEmbedding",
            inputs=(GeInput("x", ROPE_KINDS), GeInput("cos", ROPE_KINDS), GeInput("sin", ROPE_KINDS),
                    GeInput("rotate", ROPE_KINDS, optional=True)),
            attrs=(GeAttr("mode", "Int", 0, "mode"),), outputs=(("y", ROPE_KINDS),)),
    # the tables are functions of the positions only: min-cut may recompute them rather than save
    recomputable=("cos", "sin"), short_label="RoPE fw",
)
