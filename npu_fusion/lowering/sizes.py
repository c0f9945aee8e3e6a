"""Sizes that may be symbolic, compared only where the comparison is provable.

The pass and the per-target limits decide with these: a size that a guard could
still decide either way counts as "not known", so nothing is fused on a hope. (The
fused ops' own input checks, in :mod:`.ops` and :mod:`.checks`, decide the other way round:
they refuse only what is provably wrong.)
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true


def static_int(size) -> Optional[int]:
    """The size as an int when it is one, or a symbol that is a number; else None."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        if expr.is_number:
            return int(expr)
    return None


def same_size(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(statically_known_true(a == b))


def same_shape(a: Sequence, b: Sequence) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def provably_less(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    return bool(statically_known_true(a < b))
