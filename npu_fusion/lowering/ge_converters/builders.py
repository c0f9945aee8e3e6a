"""The GE op builders the converters call: torchair's generated ones wherever
they accept our inputs, builders written from the same IR otherwise.

torchair's generated ``RotaryPositionEmbeddingGrad`` (every torch_npu line from
2.6 to 2.14) declares x optional in its signature and IR but not in its
``auto_convert_to_tensor`` flags, so it rejects ``x=None``; :func:`ge_builders`
finds that out by trying, and only then uses :func:`ir_builders`' builder.
"""
from __future__ import annotations

from .. import rms_norm, rope

#: the two GE operators, as CANN registers them (``REG_OP``).
ROPE_GRAD_IR = rope.OP.ge_op
RMS_NORM_GRAD_IR = rms_norm.OP.ge_op


def ir_builders():
    """GE op builders for the two operators, written from their IR the way
    torchair's generated builders (``auto_generated_ge_raw_ops``) are::

        REG_OP(RotaryPositionEmbeddingGrad)
            .INPUT(dy, cos, sin) .OPTIONAL_INPUT(x)      // fp16, fp32, bf16
            .OUTPUT(dx, dcos, dsin) .ATTR(mode, Int, 0)
        REG_OP(RmsNormGrad)
            .INPUT(dy, x) .INPUT(rstd) .INPUT(gamma)     // rstd fp32, others fp32/fp16/bf16
            .OUTPUT(dx)                                  // like dy
            .OUTPUT(dgamma)                              // fp32
    """
    from torchair._ge_concrete_graph.compat_ir import IrDef, ge_op
    from torchair.ge import attr
    from torchair.ge._ge_graph import auto_convert_to_tensor

    rope_kinds = "DT_FLOAT16, DT_FLOAT, DT_BFLOAT16"
    rms_kinds = "DT_FLOAT, DT_FLOAT16, DT_BF16"

    @auto_convert_to_tensor([False, False, False, False], [False, False, False, True])
    def RotaryPositionEmbeddingGrad(dy, cos, sin, x, *, mode: int = 0, dependencies=(), node_name=None):  # noqa: N802
        return ge_op(
            op_type=ROPE_GRAD_IR,
            inputs={"dy": dy, "cos": cos, "sin": sin, "x": x},
            attrs={"mode": attr.Int(mode)},
            outputs=["dx", "dcos", "dsin"],
            dependencies=list(dependencies),
            node_name=node_name,
            ir=IrDef(ROPE_GRAD_IR)
            .input("dy", rope_kinds).input("cos", rope_kinds).input("sin", rope_kinds)
            .optional_input("x", rope_kinds)
            .attr("mode", attr.Int(0))
            .output("dx", rope_kinds).output("dcos", rope_kinds).output("dsin", rope_kinds),
        )

    @auto_convert_to_tensor([False, False, False, False], [False, False, False, False])
    def RmsNormGrad(dy, x, rstd, gamma, *, dependencies=(), node_name=None):  # noqa: N802
        return ge_op(
            op_type=RMS_NORM_GRAD_IR,
            inputs={"dy": dy, "x": x, "rstd": rstd, "gamma": gamma},
            attrs={},
            outputs=["dx", "dgamma"],
            dependencies=list(dependencies),
            node_name=node_name,
            ir=IrDef(RMS_NORM_GRAD_IR)
            .input("dy", rms_kinds).input("x", rms_kinds).input("rstd", "DT_FLOAT").input("gamma", rms_kinds)
            .output("dx", rms_kinds).output("dgamma", "DT_FLOAT"),
        )

    return RotaryPositionEmbeddingGrad, RmsNormGrad


def _accepts_absent_x(rope_builder) -> bool:
    """Whether ``rope_builder`` builds a RotaryPositionEmbeddingGrad with x None (in a scratch graph)."""
    from torchair._ge_concrete_graph import ge_apis as ge
    from torchair.ge import DataType
    from torchair.ge._ge_graph import GeGraph

    try:
        with GeGraph(name="npu_fusion_builder_probe"):
            t = [ge.Data(index=i, dtype=DataType.DT_FLOAT, shape=[1, 2, 1, 4], placement="CPU") for i in range(3)]
            rope_builder(t[0], t[1], t[2], None, mode=0)
    except (AssertionError, TypeError, ValueError):
        return False
    return True


def ge_builders():
    """``(rope_with_x, rope_without_x, rms_norm)``: torchair's generated builders
    where they exist and accept the call, :func:`ir_builders`' otherwise."""
    from torchair._ge_concrete_graph import ge_apis as ge

    own_rope, own_rms = ir_builders()
    rope = getattr(ge, ROPE_GRAD_IR, None)
    rope_without_x = rope if rope is not None and _accepts_absent_x(rope) else own_rope
    return rope or own_rope, rope_without_x, getattr(ge, RMS_NORM_GRAD_IR, None) or own_rms


def as_dtype(tensor, produced, wanted):
    """``tensor`` is a GE output known to be of GE dtype ``produced``; Cast it to
    ``wanted`` (the op's declared output dtype, a GE dtype) where they differ."""
    from torchair.ge import Cast
    from torchair.ge._ge_graph import ge_type_to_torch_type

    if wanted is None or wanted == produced:
        return tensor
    tensor.set_torch_dtype(ge_type_to_torch_type(produced))
    return Cast(tensor, dst_type=wanted)


def tensor_spec(dtype, shape):
    """torchair's ``F32(*shape)``-style supported-shape spec of a torch dtype and shape."""
    import torch
    from torchair._ge_concrete_graph.supported_declaration import BF16, F16, F32

    return {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}[dtype](*shape)


def declare_supported(cases):
    """torchair's ``declare_supported(cases)`` where this torchair has the API, else no decorator."""
    try:
        from torchair._ge_concrete_graph.fx2ge_converter import declare_supported as declare
    except ImportError:
        return lambda converter: converter
    return declare(cases)
