"""NPU eager kernels: thin calls into torch_npu's fused ops, one per fused op, made from its
:class:`~.fused_op.NpuBinding`.

Registered for the ``npu`` device only when torch_npu imports (an Ascend host
with CANN). The kernels are plain functions (:func:`kernel_for`), so their calls
can be checked on the CPU against stand-in ``torch.ops.npu`` ops defined from a
torch_npu wheel's own schema strings (the contract check, run for every torch_npu
release line by ``scripts/check_npu_contracts.py``).

What torch_npu's eager op cannot express falls back to the reference kernel, which
runs on any device (the binding says which calls):

* RoPE's backward without x: torch_npu's schema has no optional x (``Tensor self``/``input``);
* RoPE modes 2 and 3: in every torch_npu line from 2.6 to 2.14 the eager
  ``npu_rotary_mul`` and ``npu_rotary_mul_backward`` refuse any ``rotary_mode`` but
  ``half`` and ``interleave`` ("The rotary_mode of npu_rotary_mul_backward should be half
  or interleave"), although torchair's graph-mode converters map ``quarter`` and
  ``interleave-half`` to modes 2 and 3 on Ascend 950. Graph mode reaches those modes
  through our GE converters instead.
"""
from __future__ import annotations

import importlib.util
from typing import Callable

import torch

from ..fallback import warn_fallback
from .fused_op import FusedOp
from .ops.rope_grad import TORCH_NPU_ROTARY_MODES  # noqa: F401  (re-exported: the contract tests read it)


def kernel_for(op: FusedOp) -> Callable:
    """``op`` through ``torch.ops.npu.<binding op>``, or its reference kernel where the binding
    says torch_npu cannot compute the call."""
    binding = op.npu

    def kernel(*args, **kwargs):
        arguments = op.bind(args, kwargs)
        op.check_inputs(*arguments.values())
        if binding.fallback_reason(arguments) is not None:
            return op.reference(*arguments.values())
        call_args, call_kwargs = binding.call_arguments(arguments)
        return getattr(torch.ops.npu, binding.op)(*call_args, **call_kwargs)

    kernel.__name__ = f"{op.name}_on_npu"
    kernel.__doc__ = f"``{op.name}`` through ``torch.ops.npu.{binding.op}``."
    return kernel


def register(ops, custom_ops) -> bool:
    """Register the kernels of ``ops`` (their ``torch.library`` custom ops by name in
    ``custom_ops``) for the ``npu`` device; False (nothing changed) without torch_npu.

    With torch_npu installed, a failure (its import, or the registration) leaves the fused
    ops on their reference kernels, which would then run on the NPU: that warns."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401  (registers torch.ops.npu)

        for op in ops:
            custom_ops[op.name].register_kernel("npu")(kernel_for(op))
    except Exception as error:  # CANN missing or broken, or a torch without the npu device key
        warn_fallback("npu_kernels", f"the NPU eager kernels of the fused ops were not registered "
                                     f"({type(error).__name__}: {error}): run eagerly on an NPU, the fused ops "
                                     f"use their reference kernels (slow, decomposed). Fix torch_npu/CANN: "
                                     f"torch_npu must import and provide the npu device")
        return False
    return True
