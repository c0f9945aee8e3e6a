"""SwiGLU's backward as the fused op ``npu_fusion::swiglu_grad``.

``npu_fusion::swiglu_grad``: the gradient of :mod:`.swiglu` with respect to x (GE
``SwiGluGrad``, torch_npu ``npu_swiglu_backward``).

Math (docs/fused-ops.md#swiglu_grad), with ``A``, ``B`` the halves of x along ``dim`` and
``s = sigmoid(A)``::

    dA = dy * B * s * (1 + A * (1 - s))       (silu's derivative times dy * B)
    dB = dy * A * s                           (dy * silu(A))
    dx = cat(dA, dB, dim)                     (computed in float32, rounded once to x's dtype)

dx has x's shape and dtype; the schema names dy ``y_grad``, as the IR's input it feeds. The contract is torch_npu's ``npu_swiglu_backward(Tensor grad_output,
Tensor input, int dim=-1) -> Tensor`` and ``REG_OP(SwiGluGrad)``: inputs y_grad, x, output
y (float32/float16/bfloat16, one dtype; CANN's newer sources name it x_grad, the IR torchair
generates in torch_npu's wheels ``y``), attribute ``dim`` (Int, -1); dy is x's shape with
``dim`` halved. Constraints and chips are the forward's (:mod:`.swiglu`).
"""
from __future__ import annotations

import torch

from ..checks import require, require_dtype_like, require_float, require_one_device, same_shape, shown
from ..fused_op import CountedSite, FusedOp, GeAttr, GeInput, GeIr, NpuBinding
from .swiglu import SWIGLU_KINDS, halved, require_swiglu_split, swiglu_case_inputs, swiglu_target_problem


def check_swiglu_grad_inputs(op: str, dy, x, dim) -> None:
    """The constraints that hold on every target; ``op`` names the op in messages."""
    require_one_device(op, (("dy", dy), ("x", x)))
    require_float(op, "x", x)
    require_dtype_like(op, "x", x, (("dy", dy),))
    require_swiglu_split(op, x, dim)
    require(same_shape(list(dy.shape), halved(x, dim)),
            lambda: f"{op}: dy shape {shown(dy.shape)} must be x's {shown(x.shape)} with dim {dim} halved")


def _target_problem(target, dy, x, dim):
    return swiglu_target_problem(target, "SwiGluGrad", tuple(x.shape))


def reference_kernel(dy, x, dim):
    """Reference kernel: any device, computes in float32; dx in x's dtype."""
    OP.check_inputs(dy, x, dim)
    gate, up = x.float().chunk(2, dim=dim)
    grad = dy.float()
    s = torch.sigmoid(gate)
    d_gate = grad * up * s * (1 + gate * (1 - s))
    d_up = grad * gate * s
    return torch.cat((d_gate, d_up), dim=dim).to(x.dtype).contiguous()


def meta_kernel(dy, x, dim):
    OP.check_inputs(dy, x, dim)
    return x.new_empty(x.shape)


def unfused(dy, x, dim):
    """The backward AOTAutograd writes for ``silu(gate) * up`` of ``x.chunk(2, dim)``, in x's dtype."""
    gate, up = x.chunk(2, dim=dim)
    return torch.cat((torch.ops.aten.silu_backward(dy * up, gate), dy * torch.nn.functional.silu(gate)), dim=dim)


def cases():
    """The declared cases as arguments ``(dy, x, dim)``: the forward's, with a dy of y's shape."""
    generator = torch.Generator().manual_seed(1)
    for dtype, shape, dim in swiglu_case_inputs():
        x = torch.randn(shape, generator=generator).to(dtype)
        yield torch.randn(halved(x, dim), generator=generator).to(dtype), x, dim


OP = FusedOp(
    name="swiglu_grad", ge_op="SwiGluGrad", label="SwiGLU backward", option="swiglu",
    spec_section="docs/fused-ops.md#swiglu_grad", short_label="SwiGLU",
    counted_site=CountedSite(gated_source=r"self\.gate_up_proj\b", gate_activation=r"(?i)silu|swish"),
    outputs=("dx",), checks=check_swiglu_grad_inputs,
    schema="(Tensor y_grad, Tensor x, int dim) -> Tensor",
    reference=reference_kernel, meta=meta_kernel, unfused=unfused, target_problem=_target_problem, cases=cases,
    npu=NpuBinding(op="npu_swiglu_backward", positional=("y_grad", "x"), keywords=(("dim", "dim"),)),
    ge=GeIr(op="SwiGluGrad", inputs=(GeInput("y_grad", SWIGLU_KINDS), GeInput("x", SWIGLU_KINDS)),
            attrs=(GeAttr("dim", "Int", -1, "dim"),), outputs=(("y", SWIGLU_KINDS),)),
)
