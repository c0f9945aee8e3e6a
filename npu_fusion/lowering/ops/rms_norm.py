"""RMSNorm's forward as the fused op ``npu_fusion::rms_norm``.

``npu_fusion::rms_norm``: RMSNorm's forward (GE ``RmsNorm``, torch_npu ``npu_rms_norm``).

Math, over the normalized axes ``n:`` (``gamma.shape == x.shape[n:]``)::

    rstd = 1 / sqrt(mean(x**2) + eps)      (float32, keep-dim: x.shape[:n] + [1] * (x.dim() - n))
    y    = x * rstd * gamma                (in x's dtype, rounded once)

rstd is what :mod:`.rms_norm_grad` takes, so the backward reads the forward's
statistic instead of recomputing it. The contract is the one of torch_npu's
``npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)``
(its meta kernel: y like x, rstd float32 with the normalized axes kept as 1) and of
``REG_OP(RmsNorm)``: inputs x, gamma (float32/float16/bfloat16), outputs y (x's
dtypes) and rstd (float32 only), attribute ``epsilon`` (Float, 1e-6).

Constraints (aclnnRmsNorm; torch_npu's docs): x has 1 to 8 axes, ``gamma.shape ==
x.shape[n:]`` with ``n < x.dim()``, the dtype combinations of RmsNormGrad's table
(docs/fused-ops.md#rms_norm_grad: gamma float32 beside float16/bfloat16 x), and the same
products: Atlas A2, A3, the inference series and Ascend 950PR/950DT, where x and gamma have
no empty axis (:data:`.rms_norm_grad.RMS_NORM_950_LIMITS`).
"""
from __future__ import annotations

import math

import torch

from ..checks import require, require_float, require_one_device
from ..fused_op import FusedOp, GeAttr, GeInput, GeIr, NpuBinding
from .rms_norm_grad import NORM_KINDS, rms_norm_split, rms_norm_supported_cases, rms_norm_target_problem
from .rms_norm_grad import require_gamma_split, require_rms_norm_dtypes


def check_rms_norm_inputs(op: str, x, gamma, eps) -> None:
    """The constraints that hold on every target; ``op`` names the op in messages."""
    require_one_device(op, (("x", x), ("gamma", gamma)))
    require_float(op, "x", x)
    require_rms_norm_dtypes(op, "x", x, gamma)
    require_gamma_split(op, x, gamma)
    require(isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0,
            lambda: f"{op}: eps must be a finite float >= 0, got {eps!r}")


def _target_problem(target, x, gamma, eps):
    return rms_norm_target_problem(target, x.dtype, gamma.dtype, tuple(x.shape), gamma.dim(), ge_op="RmsNorm")


def rstd_shape(x, gamma) -> list:
    n = rms_norm_split(x, gamma)
    return list(x.shape[:n]) + [1] * (x.dim() - n)


def reference_kernel(x, gamma, eps):
    """Reference kernel: any device, computes in float32; y in x's dtype, rstd float32."""
    OP.check_inputs(x, gamma, eps)
    normalized = tuple(range(rms_norm_split(x, gamma), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=normalized, keepdim=True) + eps)
    # contiguous, as the meta kernel says (elementwise ops would keep a permuted x's layout)
    return (xf * rstd * gamma.float()).to(x.dtype).contiguous(), rstd.reshape(rstd_shape(x, gamma)).contiguous()


def meta_kernel(x, gamma, eps):
    OP.check_inputs(x, gamma, eps)
    return x.new_empty(x.shape), x.new_empty(rstd_shape(x, gamma), dtype=torch.float32)


def unfused(x, gamma, eps):
    """Hugging Face's ``LlamaRMSNorm`` (statistic in float32 or wider, weight after the cast back)."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    variance = wide.pow(2).mean(tuple(range(x.dim() - gamma.dim(), x.dim())), keepdim=True)
    rstd = torch.rsqrt(variance + eps)
    return gamma * (wide * rstd).to(x.dtype), rstd


def cases():
    """The declared cases as arguments ``(x, gamma, eps)``.

    ``(x, gamma, eps)``: the op's dtype combinations, normalizing the last axis or the last two."""
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for dtype, gamma_dtype, x_shape, _, gamma_shape in rms_norm_supported_cases():
        if (dtype, gamma_dtype, gamma_shape) in seen:  # the backward's cases differ in rstd's form too
            continue
        seen.add((dtype, gamma_dtype, gamma_shape))
        x = torch.randn(x_shape, generator=generator).to(dtype)
        yield x, torch.randn(gamma_shape, generator=generator).to(gamma_dtype), 1e-6


OP = FusedOp(
    name="rms_norm", ge_op="RmsNorm", label="RMSNorm forward", option="rms_norm_forward",
    spec_section="docs/fused-ops.md#rms_norm",
    outputs=("y", "rstd"), checks=check_rms_norm_inputs,
    schema="(Tensor x, Tensor gamma, float eps) -> (Tensor y, Tensor rstd)",
    reference=reference_kernel, meta=meta_kernel, unfused=unfused, target_problem=_target_problem, cases=cases,
    npu=NpuBinding(op="npu_rms_norm", positional=("x", "gamma"), keywords=(("epsilon", "eps"),)),
    ge=GeIr(op="RmsNorm", inputs=(GeInput("x", NORM_KINDS), GeInput("gamma", NORM_KINDS)),
            attrs=(GeAttr("epsilon", "Float", 1e-6, "eps"),),
            outputs=(("y", NORM_KINDS), ("rstd", "DT_FLOAT"))),
    short_label="RMSNorm fw",
)
