"""The routing of ``F.rms_norm`` on a device with its own RMSNorm kernel, simulated on the CPU.

torch 2.13 routes ``rms_norm`` (``nn.RMSNorm``, ``F.rms_norm``) to ``aten._fused_rms_norm``
(except for channels-last or complex input, or a weight of another dtype than the input, which
take the composite directly). ``_fused_rms_norm`` has kernels for CUDA, MPS and XPU and a
CompositeImplicitAutograd one for every other device: there it decomposes, before autograd, and
the backward is decomposed too. Where the device has its own kernel, autograd records the op's
own derivative instead, whose backward is ``aten._fused_rms_norm_backward`` (when no double
backward is asked for), and AOTAutograd keeps both ops whole.

:func:`device_rms_norm_kernels` registers CPU kernels for the two ops (torch's own
decompositions of them, run below autograd), so that the CPU routes as such a device does.
"""
from __future__ import annotations

import contextlib

import torch


def unavailable() -> str:
    """Why this torch cannot simulate the routing ('' when it can): it needs both ops and
    torch's decompositions of them (the CPU kernels)."""
    from torch._decomp import decompositions

    for name in ("_fused_rms_norm", "_fused_rms_norm_backward"):
        if not hasattr(torch.ops.aten, name) or not hasattr(decompositions, name):
            return f"this torch has no aten.{name} or no decomposition of it"
    return ""


def routes_whole(probe_shape=(2, 4)) -> bool:
    """Whether ``F.rms_norm`` on the CPU records the whole op's derivative right now."""
    probe = torch.ones(probe_shape, requires_grad=True)
    return type(torch.nn.functional.rms_norm(probe, probe_shape[-1:]).grad_fn).__name__ == "FusedRmsNormBackward0"


@contextlib.contextmanager
def device_rms_norm_kernels():
    """CPU kernels for ``aten::_fused_rms_norm`` and ``aten::_fused_rms_norm_backward`` while the
    context is open (dynamo's caches reset on entry and exit); the CPU decomposes again after."""
    from torch._decomp import decompositions

    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("_fused_rms_norm", decompositions._fused_rms_norm, "CPU")
        library.impl("_fused_rms_norm_backward", decompositions._fused_rms_norm_backward, "CPU")
        _forget_dispatch()
        yield
    finally:
        library._destroy()
        _forget_dispatch()


def _forget_dispatch() -> None:
    """Reset dynamo, and the Python dispatch caches of the ops whose routing the kernels change:
    an ``rms_norm`` traced before (a compiled ``nn.RMSNorm``) cached its decomposition there."""
    torch._dynamo.reset()
    for name in ("rms_norm", "_fused_rms_norm", "_fused_rms_norm_backward"):
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            getattr(packet, overload)._dispatch_cache.clear()


def forward_decomposition() -> dict:
    """The decomposition of the whole forward alone: it lowers as ordinary ops, and the
    backward stays ``_fused_rms_norm_backward`` (for torchair's ``custom_decompositions``)."""
    from torch._decomp import get_decompositions

    return get_decompositions([torch.ops.aten._fused_rms_norm])
