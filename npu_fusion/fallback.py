"""Warnings for the fallbacks that change what runs.

When something npu-fusion needs on an Ascend host fails (torch_npu's device query,
the NPU eager kernels, torchair's GE converters), npu-fusion takes the safe path and
goes on: it fuses only what every known chip runs, or leaves the fused ops on their
reference kernels. Each such path changes what runs, so each warns, once per process
and kind, with what happened and what to do about it. A :class:`FallbackWarning` is a
``RuntimeWarning``: ``python -W error::npu_fusion.fallback.FallbackWarning`` turns
them into errors.
"""
from __future__ import annotations

import logging
import warnings
from typing import Set

log = logging.getLogger("npu_fusion")


class FallbackWarning(RuntimeWarning):
    """npu-fusion took a fallback that changes what runs (see the message for the remedy)."""


_WARNED: Set[str] = set()


def warn_fallback(kind: str, message: str) -> bool:
    """Warn ``message`` (what happened and what to do) the first time a fallback of ``kind``
    is taken in this process; True if it warned now."""
    if kind in _WARNED:
        log.debug("npu_fusion: fallback %s again: %s", kind, message)
        return False
    _WARNED.add(kind)
    warnings.warn(f"npu_fusion: {message}", FallbackWarning, stacklevel=3)
    return True


def forget_warnings() -> None:
    """Warn again for every kind (for tests that take the same fallback twice)."""
    _WARNED.clear()
