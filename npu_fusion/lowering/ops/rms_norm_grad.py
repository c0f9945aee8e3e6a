"""RMSNorm's backward as the fused op ``npu_fusion::rms_norm_grad``.

``npu_fusion::rms_norm_grad``: the backward of RMSNorm (docs/fused-ops.md#rms_norm_grad;
GE ``RmsNormGrad``, torch_npu ``npu_rms_norm_backward``).

Math. Forward over the normalized axes ``n:`` (``gamma.shape == x.shape[n:]``)::

    y = x * rstd * gamma,   rstd = 1 / sqrt(mean(x**2) + eps)

Backward, with ``N = numel(x.shape[n:])`` and sums over the normalized axes::

    dx     = rstd * (dy * gamma - x * rstd * mean(dy * gamma * x * rstd))
           = rstd * dy * gamma - rstd**3 * x * sum(dy * gamma * x) / N
    dgamma = sum over the leading axes 0..n-1 of (dy * x * rstd)

``rstd`` is the saved reciprocal RMS, float32, shaped ``x.shape[:n]`` or its
keep-dim form ``x.shape[:n] + [1] * (x.dim() - n)``. dx has dy's dtype, dgamma is
float32 with gamma's shape. Empty inputs give empty dx and a zero dgamma.

The facts of RMSNorm (the dtype table, the chips) are stated here once; the
forward op (:mod:`.rms_norm`) reads them too. Note the argument orders: GE's
``RmsNormGrad(dy, x, rstd, gamma)``, torch_npu's ``npu_rms_norm_backward(dy, self, gamma, rstd)``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..checks import require, require_dtype_like, require_float, require_one_device, same_shape, shown
from ..fused_op import CountedSite, FusedOp, GeInput, GeIr, NpuBinding
from ..sizes import decided_under_guards, limit_problem, static_int

#: RmsNormGrad tensors are ND with 1 to 8 axes (docs/fused-ops.md#rms_norm_grad).
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
#: the chips RmsNorm and RmsNormGrad run on, each with the dtype combinations it accepts: Atlas A2
#: and A3, and Ascend 950PR/950DT, whose pages in the public CANN operator sources
#: (docs/fused-ops.md#rms_norm_grad; ``hicann/ops-nn``: ``norm/rms_norm`` and ``norm/rms_norm_grad``, their aclnn and Ascend IR pages
#: and op definitions) give it the same table
RMS_NORM_CHIP_DTYPES = {"a2": RMS_NORM_DTYPES, "a3": RMS_NORM_DTYPES, "950": RMS_NORM_DTYPES}
#: per target: ``generic`` every combination the reference kernels take, ``common`` only what
#: every chip accepts
RMS_NORM_TARGET_DTYPES = {"generic": RMS_NORM_DTYPES, **RMS_NORM_CHIP_DTYPES,
                          "common": frozenset.intersection(*map(frozenset, RMS_NORM_CHIP_DTYPES.values()))}
#: the targets that keep Ascend 950's shape limits (``common`` keeps every chip's):
#: RmsNorm takes no empty x or gamma (every axis > 0, its Ascend IR page); RmsNormGrad takes empty
#: leading axes (empty dx, zero dgamma) but no empty normalized axis, and dy/x with 2 to 8 axes,
#: rstd with 1 to 7 (aclnnRmsNormGrad), so gamma spans fewer axes than x
RMS_NORM_950_LIMITS = ("950", "common")
NORM_KINDS = "DT_FLOAT, DT_FLOAT16, DT_BF16"


# -- input checks (every target) ---------------------------------------------------

def rms_norm_split(x, gamma) -> int:
    """n such that gamma.shape == x.shape[n:]."""
    return x.dim() - gamma.dim()


def require_rms_norm_dtypes(op: str, label: str, x, gamma) -> None:
    """(x's dtype, gamma's) is in the op's dtype table; ``label`` names x's dtype (``dy/x``, ``x``)."""
    require((x.dtype, gamma.dtype) in RMS_NORM_DTYPES,
            lambda: f"{op}: unsupported dtype combination {label}={x.dtype}, gamma={gamma.dtype}; supported "
            f"({label}, gamma): {sorted((str(a), str(b)) for a, b in RMS_NORM_DTYPES)}")


def require_gamma_split(op: str, x, gamma) -> int:
    """``gamma.shape == x.shape[n:]`` for some ``0 <= n < x.dim()``, x with 1 to 8 axes; n."""
    require(1 <= x.dim() <= RMS_NORM_MAX_RANK,
            lambda: f"{op}: x must have 1 to {RMS_NORM_MAX_RANK} dimensions, got {x.dim()}")
    n = rms_norm_split(x, gamma)
    require(0 <= n < x.dim() and same_shape(gamma.shape, x.shape[n:]),
            lambda: f"{op}: gamma shape {shown(gamma.shape)} must equal x.shape[n:] for some "
            f"0 <= n < x.dim(); x shape is {shown(x.shape)}")
    return n


def _require_rstd(op: str, x, rstd, n: int) -> None:
    require(rstd.dtype == torch.float32, lambda: f"{op}: rstd dtype must be float32, got {rstd.dtype}")
    lead = list(x.shape[:n])
    keepdim = lead + [1] * (x.dim() - n)
    require(same_shape(rstd.shape, lead) or same_shape(rstd.shape, keepdim),
            lambda: f"{op}: rstd shape {shown(rstd.shape)} must equal x.shape[:{n}] = {shown(lead)} "
            f"or its keep-dim form {shown(keepdim)} (n = x.dim() - gamma.dim())")
    # The original document gives rstd 1 to 8 axes, so for n = 0 only the keep-dim form.
    require(rstd.dim() >= 1,
            lambda: f"{op}: rstd must have 1 to {RMS_NORM_MAX_RANK} dimensions, got 0 (use the keep-dim "
            f"shape {shown(keepdim)})")


def check_rms_norm_grad_inputs(op: str, dy, x, rstd, gamma) -> None:
    """The op's constraints that hold on every target; ``op`` names the op in messages."""
    require_one_device(op, (("dy", dy), ("x", x), ("rstd", rstd), ("gamma", gamma)))
    require_float(op, "dy", dy)
    require_dtype_like(op, "dy", dy, (("x", x),))
    require_rms_norm_dtypes(op, "dy/x", dy, gamma)
    n = require_gamma_split(op, x, gamma)
    require(same_shape(dy.shape, x.shape),
            lambda: f"{op}: dy shape {shown(dy.shape)} must equal x shape {shown(x.shape)}")
    _require_rstd(op, x, rstd, n)


# -- what each target accepts ---------------------------------------------------------

@decided_under_guards
def rms_norm_target_problem(target: str, compute: torch.dtype, gamma_dtype: torch.dtype, x_shape, k: int,
                            ge_op: str = "RmsNormGrad") -> Optional[str]:
    """Why ``target`` cannot run ``ge_op`` (RmsNormGrad, or the forward RmsNorm: the same chips
    and dtypes) on an x of ``x_shape`` normalized over its last ``k`` axes (gamma's), or None."""
    dtypes = RMS_NORM_TARGET_DTYPES.get(target)
    if dtypes is None:
        return f"{ge_op} is not documented for target {target!r} (docs/fused-ops.md#rms_norm_grad)"
    if (compute, gamma_dtype) not in dtypes:
        return f"dtype combination dy/x={compute}, gamma={gamma_dtype} is not in {ge_op}'s dtype table"
    if target in RMS_NORM_950_LIMITS:
        return _rms_norm_950_problem(target, ge_op, x_shape, k)
    return None


def _rms_norm_950_problem(target: str, ge_op: str, x_shape, k: int) -> Optional[str]:
    """Ascend 950's shape limits (:data:`RMS_NORM_950_LIMITS`); sizes must be provably positive."""
    chip = "Ascend 950" if target == "950" else "Ascend 950 (target 'common' keeps every chip's limits)"
    lead, normalized = list(x_shape[:len(x_shape) - k]), list(x_shape[len(x_shape) - k:])
    if empty := _empty(normalized):
        return f"gamma shape {shown(normalized)} {empty}: {ge_op} on {chip} needs every normalized axis > 0"
    if ge_op == "RmsNorm" and (empty := _empty(lead)):
        return f"x shape {shown(x_shape)} {empty}: RmsNorm on {chip} takes no empty x"
    if ge_op == "RmsNormGrad" and not lead:
        return (f"the norm spans every axis of x (shape {shown(x_shape)}, gamma the same): RmsNormGrad on {chip} "
                f"needs at least one leading axis (dy/x 2 to 8 axes, rstd 1 to 7); keep a batch axis")
    return None


def _empty(sizes) -> Optional[str]:
    """How ``sizes`` may hold no element (a size 0, or one not provably positive), or None."""
    if any(static_int(size) == 0 for size in sizes):
        return "has an empty axis"
    if any(limit_problem(0, size) for size in sizes):
        return "may have an empty axis (a size not provably > 0)"
    return None


def _target_problem(target, dy, x, rstd, gamma):
    return rms_norm_target_problem(target, dy.dtype, gamma.dtype, tuple(x.shape), gamma.dim())


# -- kernels --------------------------------------------------------------------------

def reference_kernel(dy, x, rstd, gamma):
    """Reference kernel: any device, computes in float32, dx cast back to dy's dtype."""
    OP.check_inputs(dy, x, rstd, gamma)
    n = rms_norm_split(x, gamma)
    normalized = tuple(range(n, x.dim()))
    rstd = rstd.float().reshape(list(x.shape[:n]) + [1] * len(normalized))
    dyf, xf, gf = dy.float(), x.float(), gamma.float()
    x_hat = xf * rstd
    dgamma = (dyf * x_hat).sum(dim=tuple(range(n)), keepdim=False) if n else dyf * x_hat
    if x.numel() == 0:
        return torch.empty_like(dy), torch.zeros(gamma.shape, dtype=torch.float32, device=gamma.device)
    dy_g = dyf * gf
    dx = rstd * (dy_g - x_hat * (dy_g * x_hat).mean(dim=normalized, keepdim=True))
    # dx contiguous, as the meta kernel says (elementwise ops pick a layout from dy, x and rstd)
    return dx.to(dy.dtype).contiguous(), dgamma.reshape(gamma.shape).contiguous()


def meta_kernel(dy, x, rstd, gamma):
    OP.check_inputs(dy, x, rstd, gamma)
    return dy.new_empty(dy.shape), gamma.new_empty(gamma.shape, dtype=torch.float32)


def unfused(dy, x, rstd, gamma):
    """The backward autograd writes for ``y = x * rsqrt(mean(x**2) + eps) * gamma`` given the saved
    rstd (``d rsqrt(v)/dv = -rstd**3 / 2``, ``dv/dx = 2x/N``), in the inputs' dtypes."""
    n = rms_norm_split(x, gamma)
    normalized = tuple(range(n, x.dim()))
    r = rstd.reshape(list(x.shape[:n]) + [1] * len(normalized))
    count = x[0:0].new_tensor(x.shape[n:].numel())
    dy_g = dy * gamma
    d_variance = (dy_g * x).sum(normalized, keepdim=True) * (-0.5 * r ** 3)
    dx = dy_g * r + d_variance * 2 * x / count
    dgamma = (dy * (x * r)).sum(tuple(range(n))) if n else dy * (x * r)
    return dx, dgamma


# -- declared cases ---------------------------------------------------------------

def rms_norm_supported_cases():
    """The dtypes and shapes the op declares supported, one tuple per case.

    ``(dy/x dtype, gamma dtype, x shape, rstd shape, gamma shape)``: every dtype combination
    with keep-dim rstd, then plain rstd, then normalizing over the last two axes."""
    x = (4, 16, 64)
    combinations = sorted(RMS_NORM_DTYPES, key=str)
    cases = [(dy, gamma, x, (4, 16, 1), (64,)) for dy, gamma in combinations]
    cases += [(dy, gamma, x, (4, 16), (64,)) for dy, gamma in combinations]
    cases.append((torch.float32, torch.float32, x, (4, 1, 1), (16, 64)))
    return cases


def cases():
    """The declared cases as arguments ``(dy, x, rstd, gamma)``, rstd that of x (eps 1e-6)."""
    generator = torch.Generator().manual_seed(0)
    for dtype, gamma_dtype, x_shape, rstd_shape, gamma_shape in rms_norm_supported_cases():
        dy, x = (torch.randn(x_shape, generator=generator).to(dtype) for _ in range(2))
        dims = tuple(range(len(x_shape) - len(gamma_shape), len(x_shape)))
        rstd = torch.rsqrt(x.double().pow(2).mean(dims) + 1e-6).float().reshape(rstd_shape)
        yield dy, x, rstd, torch.randn(gamma_shape, generator=generator).to(gamma_dtype)


OP = FusedOp(
    name="rms_norm_grad", ge_op="RmsNormGrad", label="RMSNorm", option="rms_norm",
    spec_section="docs/fused-ops.md#rms_norm_grad", outputs=("dx", "dgamma"),
    checks=check_rms_norm_grad_inputs,
    schema="(Tensor dy, Tensor x, Tensor rstd, Tensor gamma) -> (Tensor, Tensor)",
    reference=reference_kernel, meta=meta_kernel, unfused=unfused, target_problem=_target_problem, cases=cases,
    npu=NpuBinding(op="npu_rms_norm_backward", positional=("dy", "x", "gamma", "rstd")),
    ge=GeIr(op="RmsNormGrad",
            inputs=(GeInput("dy", NORM_KINDS), GeInput("x", NORM_KINDS), GeInput("rstd", "DT_FLOAT"),
                    GeInput("gamma", NORM_KINDS)),
            attrs=(), outputs=(("dx", NORM_KINDS), ("dgamma", "DT_FLOAT"))),
    short_label="RMSNorm", counted_site=CountedSite(class_suffix="rmsnorm"),
)
