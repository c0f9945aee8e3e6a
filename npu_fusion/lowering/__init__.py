"""What a fused op is to the compiler and the machine: schemas, meta kernels,
reference kernels, NPU eager kernels and torchair GE converters.

Importing this package registers ``torch.ops.npu_fusion.*``.
"""
from . import rms_norm, rope  # noqa: F401  (registers the custom ops)
from . import npu as _npu

NPU_KERNELS = _npu.register()
from . import ge_converters as _ge  # noqa: E402  (register() never raises: False without torchair)
GE_CONVERTERS = _ge.register()

rotary_position_embedding_grad = rope.rotary_position_embedding_grad
rms_norm_grad = rms_norm.rms_norm_grad
