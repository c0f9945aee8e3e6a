"""NPU eager kernels: thin calls into torch_npu's fused backward ops.

Registered only when torch_npu imports (an Ascend host with CANN). Untested
here: no NPU or CANN exists on the development and CI machines. What torch_npu
cannot express (modes 2 and 3, x absent) falls back to the reference kernels,
which run on any device.
"""
from __future__ import annotations

import importlib.util

from . import rms_norm, rope

_TORCH_NPU_MODES = {0: "half", 1: "interleave"}


def register() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401  (registers torch.ops.npu)
    except Exception:  # CANN missing or broken: stay on the reference kernels
        return False
    import torch

    @rope.rotary_position_embedding_grad.register_kernel("npu")
    def _rope_npu(dy, cos, sin, x=None, mode=0):
        if x is None or mode not in _TORCH_NPU_MODES:
            return rope.reference_kernel(dy, cos, sin, x, mode)
        dx, dcos, dsin = torch.ops.npu.npu_rotary_mul_backward(
            dy, x, cos, sin, rotary_mode=_TORCH_NPU_MODES[mode])
        return dx, dcos, dsin

    @rms_norm.rms_norm_grad.register_kernel("npu")
    def _rms_norm_npu(dy, x, rstd, gamma):
        dx, dgamma = torch.ops.npu.npu_rms_norm_backward(dy, x, gamma, rstd)
        return dx, dgamma

    return True
