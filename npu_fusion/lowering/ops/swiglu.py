"""SwiGLU's forward as the fused op ``npu_fusion::swiglu``.

``npu_fusion::swiglu``: the gated linear unit with a SiLU gate (GE ``SwiGlu``, torch_npu
``npu_swiglu``).

Math (docs/fused-ops.md#swiglu), with ``A`` the first half and ``B`` the second half of x along
``dim``::

    y = silu(A) * B = A * sigmoid(A) * B        (computed in float32, rounded once to x's dtype)

y has x's shape with ``dim`` halved, and x's dtype. The contract is torch_npu's
``npu_swiglu(Tensor input, int dim=-1) -> Tensor`` and ``REG_OP(SwiGlu)``: input x, output y
(both float32/float16/bfloat16, one dtype), attribute ``dim`` (Int, -1).

Constraints (aclnnSwiGlu, torch_npu's docs): x has 1 to 8 axes, ``-x.dim() <= dim < x.dim()``,
``x.shape[dim]`` even. The operator is built for Atlas A2 and A3 and for Ascend 950PR/950DT in
all three dtypes; torch_npu documents no empty x, which every chip target here refuses.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..checks import require, require_float, require_one_device, shown
from ..fused_op import FusedOp, GeAttr, GeInput, GeIr, NpuBinding
from ..sizes import static_int

#: the GE dtypes of SwiGlu's and SwiGluGrad's tensors (one dtype throughout)
SWIGLU_KINDS = "DT_BF16, DT_FLOAT16, DT_FLOAT"
#: the targets whose chips run SwiGlu and SwiGluGrad (``generic``: any device, the reference kernel)
SWIGLU_TARGETS = ("generic", "a2", "a3", "950", "common")


def require_swiglu_split(op: str, x, dim) -> int:
    """``dim`` as a non-negative axis of x, whose size is even; raises otherwise."""
    require(isinstance(dim, int) and not isinstance(dim, bool), lambda: f"{op}: dim must be an int, got {dim!r}")
    require(1 <= x.dim() <= 8, lambda: f"{op}: x must have 1 to 8 axes, got {x.dim()}")
    require(-x.dim() <= dim < x.dim(), lambda: f"{op}: dim {dim} is out of range for x of {x.dim()} axes")
    axis = dim % x.dim()
    require(x.shape[axis] % 2 == 0,
            lambda: f"{op}: x's size along dim {dim} must be even (two halves), got {shown(x.shape)}")
    return axis


def check_swiglu_inputs(op: str, x, dim) -> None:
    """The constraints that hold on every target; ``op`` names the op in messages."""
    require_one_device(op, (("x", x),))
    require_float(op, "x", x)
    require_swiglu_split(op, x, dim)


def swiglu_target_problem(target: str, ge_op: str, x_shape) -> Optional[str]:
    """Why ``target`` cannot run ``ge_op`` (SwiGlu or SwiGluGrad) on an x of ``x_shape``, or None."""
    if target not in SWIGLU_TARGETS:
        return f"{ge_op} is not documented for target {target!r} (docs/fused-ops.md#swiglu)"
    if target != "generic" and any(static_int(s) == 0 for s in x_shape):
        return f"x shape {shown(x_shape)} has an empty axis: torch_npu documents no empty x for {ge_op}"
    return None


def _target_problem(target, x, dim):
    return swiglu_target_problem(target, "SwiGlu", tuple(x.shape))


def halved(x, dim) -> list:
    """x's shape with ``dim`` halved: y's and dy's shape."""
    axis = dim % x.dim()
    return [s // 2 if i == axis else s for i, s in enumerate(x.shape)]


def reference_kernel(x, dim):
    """Reference kernel: any device, computes in float32; y in x's dtype."""
    OP.check_inputs(x, dim)
    gate, up = x.float().chunk(2, dim=dim)
    return (gate * torch.sigmoid(gate) * up).to(x.dtype).contiguous()


def meta_kernel(x, dim):
    OP.check_inputs(x, dim)
    return x.new_empty(halved(x, dim))


def unfused(x, dim):
    """The forward as Phi-3's and GLM-4's MLP write it, in x's dtype."""
    gate, up = x.chunk(2, dim=dim)
    return torch.nn.functional.silu(gate) * up


def swiglu_case_inputs():
    """``(dtype, x shape, dim)`` of the declared cases: every dtype, the last axis and an inner one."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        yield dtype, (2, 16, 128), -1
        yield dtype, (4, 6, 32), 1


def cases():
    """The declared cases as arguments ``(x, dim)``."""
    generator = torch.Generator().manual_seed(0)
    for dtype, shape, dim in swiglu_case_inputs():
        yield torch.randn(shape, generator=generator).to(dtype), dim


OP = FusedOp(
    name="swiglu", ge_op="SwiGlu", label="SwiGLU forward", option="swiglu_forward",
    spec_section="docs/fused-ops.md#swiglu", short_label="SwiGLU fw",
    outputs=("y",), checks=check_swiglu_inputs,
    schema="(Tensor x, int dim) -> Tensor",
    reference=reference_kernel, meta=meta_kernel, unfused=unfused, target_problem=_target_problem, cases=cases,
    npu=NpuBinding(op="npu_swiglu", positional=("x",), keywords=(("dim", "dim"),)),
    ge=GeIr(op="SwiGlu", inputs=(GeInput("x", SWIGLU_KINDS),), attrs=(GeAttr("dim", "Int", -1, "dim"),),
            outputs=(("y", SWIGLU_KINDS),)),
)
