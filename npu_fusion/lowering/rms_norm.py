"""``npu_fusion::rms_norm_grad``: the backward of RMSNorm (SPEC section 2).

Forward over the normalized axes ``n:`` (``gamma.shape == x.shape[n:]``)::

    y = x * rstd * gamma,   rstd = 1 / sqrt(mean(x**2) + eps)

Backward, with ``N = numel(x.shape[n:])`` and sums over the normalized axes::

    dx     = rstd * (dy * gamma - x * rstd * mean(dy * gamma * x * rstd))
           = rstd * dy * gamma - rstd**3 * x * sum(dy * gamma * x) / N
    dgamma = sum over the leading axes 0..n-1 of (dy * x * rstd)

``rstd`` is the saved reciprocal RMS, float32, shaped ``x.shape[:n]`` or its
keep-dim form ``x.shape[:n] + [1] * (x.dim() - n)``. dx has dy's dtype, dgamma is
float32 with gamma's shape. Empty inputs give empty dx and a zero dgamma.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .constraints import check_rms_norm_grad_inputs, rms_norm_split
from .fused_op import FusedOp

OP = FusedOp(name="rms_norm_grad", ge_op="RmsNormGrad", label="RMSNorm", option="rms_norm",
             spec_section="SPEC section 2", outputs=("dx", "dgamma"), checks=check_rms_norm_grad_inputs)
OP_NAME = f"npu_fusion::{OP.name}"


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
    return dx.to(dy.dtype), dgamma.reshape(gamma.shape).contiguous()


# The schema is stated, not inferred: torch 2.6 cannot resolve the typing names of
# postponed (``from __future__ import annotations``) signatures.
@torch.library.custom_op(OP_NAME, mutates_args=(),
                         schema="(Tensor dy, Tensor x, Tensor rstd, Tensor gamma) -> (Tensor, Tensor)")
def rms_norm_grad(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    return reference_kernel(dy, x, rstd, gamma)


@rms_norm_grad.register_fake
def _(dy, x, rstd, gamma):
    OP.check_inputs(dy, x, rstd, gamma)
    return dy.new_empty(dy.shape), gamma.new_empty(gamma.shape, dtype=torch.float32)
