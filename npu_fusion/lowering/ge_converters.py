"""torchair GE converters: how the fused ops reach the Ascend graph engine.

With torchair's ``max-autotune`` mode every FX node becomes GE operators through
a converter registered with ``torchair.register_fx_node_ge_converter``:

* ``npu_fusion.rotary_position_embedding_grad(dy, cos, sin, x, mode)`` becomes
  GE ``RotaryPositionEmbeddingGrad(dy, cos, sin, x?, mode=mode)``. ``x`` is the
  IR's optional input and is left unfed when the op's ``x`` is None; then GE
  does not compute dcos/dsin, and the converter returns, as the meta kernel
  does, empty ``[0]``-shaped tensors in dy's dtype for them (``Fill([0], 0)``)
  instead of GE's unwritten outputs. torchair omits an attribute equal to the
  IR default, so ``mode=0`` appears in the GE graph as no ``mode`` attribute.
* ``npu_fusion.rms_norm_grad(dy, x, rstd, gamma)`` becomes GE
  ``RmsNormGrad(dy, x, rstd, gamma)``: note GE's input order, rstd before
  gamma. GE's dx has dy's dtype and its dgamma is float32, which is what the
  op declares; a Cast is added only where a GE output dtype would differ from
  the op's declared one (never for inputs that pass the op's checks), and rstd
  is cast to float32 should it not be.

Shapes are passed through untouched, so symbolic (dynamic) shapes work: GE
infers the outputs' shapes, and torchair stamps the FX meta on them.

The GE op builders come from torchair's generated ``ge_apis``; where those are
missing or reject the call, :func:`_make_ir_builders` builds the same
operators from their IR (see :func:`ge_builders`).

:func:`register` is called when :mod:`npu_fusion.lowering` is imported. It
returns False, and changes nothing, when torchair cannot be imported (a machine
without torch_npu/CANN); calling it again after torchair became importable
registers then.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
import types

import torch

from . import rms_norm, rope  # noqa: F401  (the ops must exist before their converters)

log = logging.getLogger(__name__)

_REGISTERED = False

#: the IR of the two GE operators, as CANN registers them (``REG_OP``).
ROPE_GRAD_IR = "RotaryPositionEmbeddingGrad"
RMS_NORM_GRAD_IR = "RmsNormGrad"


def _torchair_available() -> bool:
    """Whether a real torchair package is importable (a bare ``torchair/``
    directory on sys.path, a namespace package, does not count)."""
    module = sys.modules.get("torchair")
    if module is not None:
        if isinstance(module, types.ModuleType):
            return getattr(module, "__file__", None) is not None
        return True  # torch_npu's lazy proxy: importing from it loads torchair
    try:
        spec = importlib.util.find_spec("torchair")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")


def _make_ir_builders():
    """GE op builders for the two operators, written from their IR the way
    torchair's generated builders (``auto_generated_ge_raw_ops``) are::

        REG_OP(RotaryPositionEmbeddingGrad)
            .INPUT(dy, cos, sin) .OPTIONAL_INPUT(x)      // fp16, fp32, bf16
            .OUTPUT(dx, dcos, dsin) .ATTR(mode, Int, 0)
        REG_OP(RmsNormGrad)
            .INPUT(dy, x) .INPUT(rstd) .INPUT(gamma)     // rstd fp32, others fp32/fp16/bf16
            .OUTPUT(dx)                                  // like dy
            .OUTPUT(dgamma)                              // fp32

    They are used where torchair's own are missing or unusable: torch_npu
    2.13.0's generated ``RotaryPositionEmbeddingGrad`` declares ``x`` optional
    in its signature and IR but not in its ``auto_convert_to_tensor`` flags, so
    it rejects ``x=None``.
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


def ge_builders():
    """``(rope_with_x, rope_without_x, rms_norm)``: torchair's generated builders
    where they exist and accept the call, ours (:func:`_make_ir_builders`) otherwise."""
    from torchair._ge_concrete_graph import ge_apis as ge

    own_rope, own_rms = _make_ir_builders()
    rope = getattr(ge, ROPE_GRAD_IR, None) or own_rope
    return rope, own_rope, getattr(ge, RMS_NORM_GRAD_IR, None) or own_rms


def _as_dtype(tensor, produced, wanted):
    """``tensor`` is a GE output known to be of GE dtype ``produced``; Cast it to
    ``wanted`` (the op's declared output dtype, a GE dtype) where they differ."""
    from torchair.ge import Cast
    from torchair.ge._ge_graph import ge_type_to_torch_type

    if wanted is None or wanted == produced:
        return tensor
    tensor.set_torch_dtype(ge_type_to_torch_type(produced))
    return Cast(tensor, dst_type=wanted)


def _declare(converter, cases):
    """Attach torchair-style ``Support`` cases, where this torchair has the API."""
    try:
        from torchair._ge_concrete_graph.fx2ge_converter import declare_supported
    except ImportError:
        return converter
    return declare_supported(cases)(converter)


def _support_cases():
    from torchair._ge_concrete_graph.supported_declaration import BF16, F16, F32, Support

    # Every case is valid on some target (SPEC section 1): modes 2 and 3 and the
    # interleave case with B1SD cos/sin only on Ascend 950, the others on A2/A3 too.
    rope_cases = [
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
    rms_cases = [
        # (dy, x, rstd, gamma): the five A2/A3 dtype combinations, keep-dim and plain rstd.
        Support(F32(4, 16, 64), F32(4, 16, 64), F32(4, 16, 1), F32(64)),
        Support(F16(4, 16, 64), F16(4, 16, 64), F32(4, 16, 1), F32(64)),
        Support(BF16(4, 16, 64), BF16(4, 16, 64), F32(4, 16, 1), F32(64)),
        Support(F16(4, 16, 64), F16(4, 16, 64), F32(4, 16), F16(64)),
        Support(BF16(2, 8, 32), BF16(2, 8, 32), F32(2, 8), BF16(32)),
        # normalizing over the last two axes.
        Support(F32(4, 8, 32), F32(4, 8, 32), F32(4, 1, 1), F32(8, 32)),
    ]
    return rope_cases, rms_cases


def _register_with_torchair() -> None:
    from torchair import register_fx_node_ge_converter
    from torchair.ge import DataType

    rope_builder, rope_builder_without_x, rms_builder = ge_builders()

    def convert_rotary_position_embedding_grad(dy, cos, sin, x=None, mode: int = 0, meta_outputs=None):
        """NB: npu_fusion::rotary_position_embedding_grad(Tensor dy, Tensor cos, Tensor sin,
        Tensor? x=None, int mode=0) -> (Tensor, Tensor, Tensor)"""
        from torchair._ge_concrete_graph import ge_apis as ge

        if x is not None:
            return rope_builder(dy, cos, sin, x, mode=int(mode))
        dx, _, _ = rope_builder_without_x(dy, cos, sin, None, mode=int(mode))
        # GE leaves dcos/dsin unwritten without x; the op returns [0]-shaped tensors.
        dcos = ge.Fill([0], ge.Cast(0.0, dst_type=dy.dtype))
        dsin = ge.Fill([0], ge.Cast(0.0, dst_type=dy.dtype))
        return dx, dcos, dsin

    def convert_rms_norm_grad(dy, x, rstd, gamma, meta_outputs=None):
        """NB: npu_fusion::rms_norm_grad(Tensor dy, Tensor x, Tensor rstd, Tensor gamma)
        -> (Tensor dx, Tensor dgamma)"""
        from torchair.ge import Cast

        if rstd.dtype != DataType.DT_FLOAT:
            rstd = Cast(rstd, dst_type=DataType.DT_FLOAT)
        dx, dgamma = rms_builder(dy, x, rstd, gamma)  # GE's order: rstd before gamma
        if meta_outputs is not None:  # GE: dx in dy's dtype (as declared), dgamma float32
            dgamma = _as_dtype(dgamma, DataType.DT_FLOAT, meta_outputs[1].dtype)
        return dx, dgamma

    rope_cases, rms_cases = _support_cases()
    _declare(register_fx_node_ge_converter(torch.ops.npu_fusion.rotary_position_embedding_grad.default)(
        convert_rotary_position_embedding_grad), rope_cases)
    _declare(register_fx_node_ge_converter(torch.ops.npu_fusion.rms_norm_grad.default)(
        convert_rms_norm_grad), rms_cases)


def register() -> bool:
    """Register the GE converters with torchair; False when torchair is unavailable."""
    global _REGISTERED
    if _REGISTERED:
        return True
    if not _torchair_available():
        return False
    try:
        _register_with_torchair()
    except Exception as error:  # torchair present but unusable (CANN missing, API drift)
        log.debug("npu_fusion: torchair GE converters not registered: %s", error)
        return False
    _REGISTERED = True
    return True


def registered() -> bool:
    return _REGISTERED


__all__ = ["register", "registered", "ge_builders", "ROPE_GRAD_IR", "RMS_NORM_GRAD_IR"]
