"""NPU eager kernels: thin calls into torch_npu's fused backward ops.

Registered for the ``npu`` device only when torch_npu imports (an Ascend host
with CANN). The kernels themselves are plain functions of this module, so their
calls can be checked on the CPU against stand-in ``torch.ops.npu`` ops defined
from a torch_npu wheel's own schema strings (the test suite's contract check,
run for every torch_npu release line by ``scripts/check_npu_contracts.py``).

What torch_npu's eager ``npu_rotary_mul_backward`` cannot express falls back to
the reference kernel, which runs on any device:

* x absent: torch_npu's schema has no optional x (``Tensor self``/``input``);
* modes 2 and 3: in every torch_npu line from 2.6 to 2.14 the eager kernel
  refuses any ``rotary_mode`` but ``half`` and ``interleave`` ("The rotary_mode
  of npu_rotary_mul_backward should be half or interleave"), although torchair's
  graph-mode converter maps ``quarter`` and ``interleave-half`` to
  RotaryPositionEmbeddingGrad modes 2 and 3 on Ascend 950. Graph mode reaches
  those modes through our GE converter instead.
"""
from __future__ import annotations

import importlib.util

import torch

from ..fallback import warn_fallback
from . import rms_norm, rope

#: RotaryPositionEmbeddingGrad mode -> the ``rotary_mode`` string torch_npu's eager kernel accepts for it.
TORCH_NPU_ROTARY_MODES = {0: "half", 1: "interleave"}


def rope_grad_on_npu(dy, cos, sin, x=None, mode=0):
    """``rotary_position_embedding_grad`` through ``torch.ops.npu.npu_rotary_mul_backward``
    (schema ``(Tensor grad, Tensor self, Tensor r1, Tensor r2, str rotary_mode='half')``)."""
    rope.OP.check_inputs(dy, cos, sin, x, mode)
    if x is None or mode not in TORCH_NPU_ROTARY_MODES:
        return rope.reference_kernel(dy, cos, sin, x, mode)
    dx, dcos, dsin = torch.ops.npu.npu_rotary_mul_backward(
        dy, x, cos, sin, rotary_mode=TORCH_NPU_ROTARY_MODES[mode])
    return dx, dcos, dsin


def rms_norm_grad_on_npu(dy, x, rstd, gamma):
    """``rms_norm_grad`` through ``torch.ops.npu.npu_rms_norm_backward``
    (schema ``(Tensor dy, Tensor self, Tensor gamma, Tensor rstd)``: gamma before rstd)."""
    rms_norm.OP.check_inputs(dy, x, rstd, gamma)
    dx, dgamma = torch.ops.npu.npu_rms_norm_backward(dy, x, gamma, rstd)
    return dx, dgamma


def register() -> bool:
    """Register the kernels for the ``npu`` device; False (nothing changed) without torch_npu.

    With torch_npu installed, a failure (its import, or the registration) leaves the fused
    ops on their reference kernels, which would then run on the NPU: that warns."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401  (registers torch.ops.npu)

        rope.rotary_position_embedding_grad.register_kernel("npu")(rope_grad_on_npu)
        rms_norm.rms_norm_grad.register_kernel("npu")(rms_norm_grad_on_npu)
    except Exception as error:  # CANN missing or broken, or a torch without the npu device key
        warn_fallback("npu_kernels", f"the NPU eager kernels of the fused ops were not registered "
                                     f"({type(error).__name__}: {error}): run eagerly on an NPU, the fused ops "
                                     f"use their reference kernels (slow, decomposed). Fix torch_npu/CANN: "
                                     f"torch_npu must import and provide the npu device")
        return False
    return True
