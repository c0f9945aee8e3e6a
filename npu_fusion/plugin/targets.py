"""Which chip the fused ops will run on, and so which forms the pass may emit."""
from __future__ import annotations

import functools
import importlib.util


def target_from_device_name(name: str) -> str:
    """Map torch_npu's device name (``torch.npu.get_device_name()``) to a target.

    Ascend 910B* are Atlas A2, Ascend 910_93* are Atlas A3, Ascend 950* the 950PR/DT.
    Anything else gets the narrowest supported target, ``"a2"``, so nothing is
    emitted that an unknown chip may reject.
    """
    upper = name.upper().replace(" ", "")
    if "950" in upper:
        return "950"
    if "910_93" in upper:
        return "a3"
    return "a2"


@functools.lru_cache(maxsize=None)
def detect_target() -> str:
    if importlib.util.find_spec("torch_npu") is None:
        return "generic"
    try:
        import torch
        import torch_npu  # noqa: F401

        if not torch.npu.is_available():
            return "generic"
        return target_from_device_name(torch.npu.get_device_name())
    except Exception:
        return "generic"
