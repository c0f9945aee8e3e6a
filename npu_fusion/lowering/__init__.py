"""What a fused op is to the compiler and the machine.

Each fused op is one declarative module under :mod:`.ops` (its :class:`FusedOp`:
schema, meta and reference kernels, the unfused program it replaces, input checks,
per-target limits, declared cases, NPU binding, GE IR), listed in
:data:`.ops.FUSED_OPS`. :mod:`.registrar` defines them as ``torch.ops.npu_fusion.*``
and registers their NPU eager kernels (:mod:`.npu`) and torchair GE converters
(:mod:`.ge_converters`) where torch_npu and torchair import.

Importing this package registers ``torch.ops.npu_fusion.*``; nothing here depends on
the order of its imports.
"""
from . import registrar
from .fused_op import CountedSite, FusedOp
from .ops import FUSED_OPS
from .ops import rms_norm as _rms_norm, rms_norm_grad as _rms_norm_grad, rope as _rope, rope_grad as _rope_grad

registrar.define_all(FUSED_OPS)
NPU_KERNELS, GE_CONVERTERS = registrar.register_backends(FUSED_OPS)

ROPE_GRAD, RMS_NORM_GRAD = _rope_grad.OP, _rms_norm_grad.OP
ROPE, RMS_NORM = _rope.OP, _rms_norm.OP

# The backward ops' custom ops under their old names. The forward ops are reached as
# ``torch.ops.npu_fusion.*`` or by their description (``RMS_NORM``, ``ROPE``).
rotary_position_embedding_grad = registrar.CUSTOM_OPS[ROPE_GRAD.name]
rms_norm_grad = registrar.CUSTOM_OPS[RMS_NORM_GRAD.name]

__all__ = ["CountedSite", "FUSED_OPS", "FusedOp", "RMS_NORM", "RMS_NORM_GRAD", "ROPE", "ROPE_GRAD", "rms_norm_grad",
           "rotary_position_embedding_grad"]
