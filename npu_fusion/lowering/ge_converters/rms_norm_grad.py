"""GE converter of ``npu_fusion.rms_norm_grad``: GE ``RmsNormGrad(dy, x, rstd, gamma)``.

Note GE's input order, rstd before gamma (torch_npu's eager
``npu_rms_norm_backward`` takes gamma before rstd). GE's dx has dy's dtype and
its dgamma is float32, which is what the op declares; a Cast is added only
where a GE output dtype would differ from the op's declared one (never for
inputs that pass the op's checks), and rstd is cast to float32 should it not be.
"""
from __future__ import annotations

import torch
from torchair import register_fx_node_ge_converter
from torchair._ge_concrete_graph.supported_declaration import BF16, F16, F32, Support
from torchair.ge import Cast, DataType

from .builders import as_dtype, declare_supported, ge_builders

_, _, RMS_NORM_BUILDER = ge_builders()

SUPPORTED = [
    # (dy, x, rstd, gamma): the five A2/A3 dtype combinations, keep-dim and plain rstd.
    Support(F32(4, 16, 64), F32(4, 16, 64), F32(4, 16, 1), F32(64)),
    Support(F16(4, 16, 64), F16(4, 16, 64), F32(4, 16, 1), F32(64)),
    Support(BF16(4, 16, 64), BF16(4, 16, 64), F32(4, 16, 1), F32(64)),
    Support(F16(4, 16, 64), F16(4, 16, 64), F32(4, 16), F16(64)),
    Support(BF16(2, 8, 32), BF16(2, 8, 32), F32(2, 8), BF16(32)),
    # normalizing over the last two axes.
    Support(F32(4, 8, 32), F32(4, 8, 32), F32(4, 1, 1), F32(8, 32)),
]


@declare_supported(SUPPORTED)
@register_fx_node_ge_converter(torch.ops.npu_fusion.rms_norm_grad.default)
def convert_rms_norm_grad(dy, x, rstd, gamma, meta_outputs=None):
    """NB: npu_fusion::rms_norm_grad(Tensor dy, Tensor x, Tensor rstd, Tensor gamma)
    -> (Tensor dx, Tensor dgamma)"""
    if rstd.dtype != DataType.DT_FLOAT:
        rstd = Cast(rstd, dst_type=DataType.DT_FLOAT)
    dx, dgamma = RMS_NORM_BUILDER(dy, x, rstd, gamma)  # GE's order: rstd before gamma
    if meta_outputs is not None:  # GE: dx in dy's dtype (as declared), dgamma float32
        dgamma = as_dtype(dgamma, DataType.DT_FLOAT, meta_outputs[1].dtype)
    return dx, dgamma
