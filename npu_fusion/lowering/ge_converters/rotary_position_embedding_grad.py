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

from torchair import register_fx_node_ge_converter
from torchair._ge_concrete_graph import ge_apis as ge
from torchair._ge_concrete_graph.supported_declaration import Support

from ..constraints import rope_supported_cases
from ..rope import OP
from .builders import declare_supported, ge_builders, tensor_spec

ROPE_BUILDER, ROPE_BUILDER_WITHOUT_X, _ = ge_builders()

#: (dy, cos, sin, x, mode), each valid on some target (SPEC section 1), from the constraint
#: tables (:func:`~..constraints.rope_supported_cases`)
SUPPORTED = [Support(tensor_spec(dt, dy), tensor_spec(dt, cos), tensor_spec(dt, cos),
                     tensor_spec(dt, dy) if with_x else None, mode=mode)
             for dt, dy, cos, with_x, mode in rope_supported_cases()]


@declare_supported(SUPPORTED)
@register_fx_node_ge_converter(OP.overload)
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
