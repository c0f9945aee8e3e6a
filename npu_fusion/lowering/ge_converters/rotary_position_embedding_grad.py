"""GE converter of ``npu_fusion.rotary_position_embedding_grad``: GE
``RotaryPositionEmbeddingGrad(dy, cos, sin, x?, mode=mode)``.

``x`` is the IR's optional input and is left unfed when the op's ``x`` is None;
then GE does not compute dcos/dsin, and the converter returns, as the meta
kernel does, empty ``[0]``-shaped tensors in dy's dtype for them (``Fill([0],
0)``) instead of GE's unwritten outputs. torchair omits an attribute equal to
the IR default, so ``mode=0`` appears in the GE graph as no ``mode`` attribute.
Shapes pass through untouched (symbolic ones too): GE infers the outputs'.
"""
from __future__ import annotations

import torch
from torchair import register_fx_node_ge_converter
from torchair._ge_concrete_graph import ge_apis as ge
from torchair._ge_concrete_graph.supported_declaration import BF16, F16, F32, Support

from .builders import declare_supported, ge_builders

ROPE_BUILDER, ROPE_BUILDER_WITHOUT_X, _ = ge_builders()

#: Every case is valid on some target (SPEC section 1): modes 2 and 3 and the
#: interleave case with B1SD cos/sin only on Ascend 950, the others on A2/A3 too.
SUPPORTED = [
    # BSND dy with 1S1D cos/sin, every mode, with and without x.
    Support(F32(2, 16, 4, 64), F32(1, 16, 1, 64), F32(1, 16, 1, 64), F32(2, 16, 4, 64), mode=0),
    Support(F16(2, 16, 4, 64), F16(1, 16, 1, 64), F16(1, 16, 1, 64), F16(2, 16, 4, 64), mode=1),
    Support(BF16(2, 16, 4, 64), BF16(1, 16, 1, 64), BF16(1, 16, 1, 64), BF16(2, 16, 4, 64), mode=2),
    Support(F32(2, 16, 4, 64), F32(1, 16, 1, 64), F32(1, 16, 1, 64), F32(2, 16, 4, 64), mode=3),
    Support(F16(2, 16, 4, 64), F16(1, 16, 1, 64), F16(1, 16, 1, 64), None, mode=0),
    # BNSD dy with 11SD and B1SD cos/sin.
    Support(F32(2, 4, 16, 128), F32(1, 1, 16, 128), F32(1, 1, 16, 128), F32(2, 4, 16, 128), mode=0),
    Support(F16(2, 4, 16, 128), F16(2, 1, 16, 128), F16(2, 1, 16, 128), F16(2, 4, 16, 128), mode=1),
]


@declare_supported(SUPPORTED)
@register_fx_node_ge_converter(torch.ops.npu_fusion.rotary_position_embedding_grad.default)
def convert_rotary_position_embedding_grad(dy, cos, sin, x=None, mode: int = 0, meta_outputs=None):
    """NB: npu_fusion::rotary_position_embedding_grad(Tensor dy, Tensor cos, Tensor sin,
    Tensor? x=None, int mode=0) -> (Tensor, Tensor, Tensor)"""
    if x is not None:
        return ROPE_BUILDER(dy, cos, sin, x, mode=int(mode))
    dx, _, _ = ROPE_BUILDER_WITHOUT_X(dy, cos, sin, None, mode=int(mode))
    # GE leaves dcos/dsin unwritten without x; the op returns [0]-shaped tensors.
    dcos = ge.Fill([0], ge.Cast(0.0, dst_type=dy.dtype))
    dsin = ge.Fill([0], ge.Cast(0.0, dst_type=dy.dtype))
    return dx, dcos, dsin
