"""What a fused op is to the compiler and the machine: its description
(:mod:`.fused_op`), SPEC's facts (:mod:`.constraints`), schema, meta and reference
kernels (one module per op), NPU eager kernels (:mod:`.npu`) and torchair GE
converters (:mod:`.ge_converters`, one module per op).

Importing this package registers ``torch.ops.npu_fusion.*``.
"""
from . import rms_norm, rope
from . import npu as _npu
from .fused_op import FusedOp

#: every fused op, by its description
FUSED_OPS = (rms_norm.OP, rope.OP)
ROPE_GRAD, RMS_NORM_GRAD = rope.OP, rms_norm.OP

NPU_KERNELS = _npu.register()
from . import ge_converters as _ge  # noqa: E402  (register() never raises: False without torchair)
GE_CONVERTERS = _ge.register()

rotary_position_embedding_grad = rope.rotary_position_embedding_grad
rms_norm_grad = rms_norm.rms_norm_grad

__all__ = ["FUSED_OPS", "FusedOp", "RMS_NORM_GRAD", "ROPE_GRAD", "rms_norm_grad", "rotary_position_embedding_grad"]
