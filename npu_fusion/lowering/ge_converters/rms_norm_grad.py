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
from torchair._ge_concrete_graph.supported_declaration import Support
from torchair.ge import Cast, DataType

from ..constraints import rms_norm_supported_cases
from ..rms_norm import OP
from .builders import as_dtype, declare_supported, ge_builders, tensor_spec

_, _, RMS_NORM_BUILDER = ge_builders()

#: (dy, x, rstd, gamma), from SPEC's dtype table (:func:`~..constraints.rms_norm_supported_cases`)
SUPPORTED = [Support(tensor_spec(dy, x), tensor_spec(dy, x), tensor_spec(torch.float32, rstd),
                     tensor_spec(gamma_dtype, gamma))
             for dy, gamma_dtype, x, rstd, gamma in rms_norm_supported_cases()]


@declare_supported(SUPPORTED)
@register_fx_node_ge_converter(OP.overload)
def convert_rms_norm_grad(dy, x, rstd, gamma, meta_outputs=None):
    """NB: npu_fusion::rms_norm_grad(Tensor dy, Tensor x, Tensor rstd, Tensor gamma)
    -> (Tensor dx, Tensor dgamma)"""
    if rstd.dtype != DataType.DT_FLOAT:
        rstd = Cast(rstd, dst_type=DataType.DT_FLOAT)
    dx, dgamma = RMS_NORM_BUILDER(dy, x, rstd, gamma)  # GE's order: rstd before gamma
    if meta_outputs is not None:  # GE: dx in dy's dtype (as declared), dgamma float32
        dgamma = as_dtype(dgamma, DataType.DT_FLOAT, meta_outputs[1].dtype)
    return dx, dgamma
