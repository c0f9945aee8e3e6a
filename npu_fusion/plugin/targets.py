"""Which chip the fused ops will run on, and so which forms the pass may emit.

Detection fails closed: when torch_npu is installed but cannot say which chip this
is (its import or its device query raises), or names a chip npu-fusion does not
know, the pass fuses only what every known chip runs (target ``"common"``) and
warns, naming the error and how to choose the target instead. Only a machine
without torch_npu, or whose torch_npu sees no NPU, gets ``"generic"`` (every form:
the fused ops then run on their reference kernels, which accept them all).
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Optional

from ..fallback import warn_fallback

#: the target taken when the chip cannot be told: only the forms every known chip runs
FALLBACK_TARGET = "common"

#: device name prefixes (``torch.npu.get_device_name()``, upper case, spaces removed) of the known chips
_KNOWN_CHIPS = (("ASCEND950", "950"), ("ASCEND910_93", "a3"), ("ASCEND910B", "a2"))


def known_target(name: str) -> Optional[str]:
    """The target of torch_npu's device name, or None for a chip npu-fusion does not know.

    Ascend 910B* are Atlas A2, Ascend 910_93* are Atlas A3, Ascend 950* the 950PR/DT.
    """
    upper = name.upper().replace(" ", "")
    return next((target for prefix, target in _KNOWN_CHIPS if upper.startswith(prefix)), None)


def target_from_device_name(name: str) -> str:
    """The target for torch_npu's device name; an unknown chip gets :data:`FALLBACK_TARGET`,
    with a warning, so nothing is emitted that it may reject."""
    target = known_target(name)
    if target is None:
        warn_fallback("target", f"NPU device {name!r} is none of the chips npu-fusion knows (Ascend 910B* = a2, "
                                f"910_93* = a3, 950* = 950): fusing only what all of them run (target "
                                f"{FALLBACK_TARGET!r}: A2/A3's RoPE, every chip's RMSNorm). If your chip is one of them, pass target= "
                                f"explicitly; otherwise npu-fusion does not support it")
        return FALLBACK_TARGET
    return target


@functools.lru_cache(maxsize=None)
def detect_target() -> str:
    if importlib.util.find_spec("torch_npu") is None:
        return "generic"
    try:
        import torch
        import torch_npu  # noqa: F401

        if not torch.npu.is_available():
            return "generic"
        name = torch.npu.get_device_name()
    except Exception as error:  # torch_npu is here but cannot tell the chip: assume the narrowest
        warn_fallback("target", f"target='auto' could not ask torch_npu which chip this is "
                                f"({type(error).__name__}: {error}): fusing only what every known chip runs "
                                f"(target {FALLBACK_TARGET!r}: A2/A3's RoPE, every chip's RMSNorm). Fix torch_npu/CANN, or pass "
                                f"target='a2', 'a3' or '950'")
        return FALLBACK_TARGET
    return target_from_device_name(name)
