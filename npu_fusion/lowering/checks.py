"""What every fused op's input checks share: the error they raise, the targets, and
checks that decide on (possibly symbolic) sizes.

Every check raises :class:`FusedOpInputError` whose message names the broken
constraint, so a bad call fails the same way at trace time (fake tensors, static
or symbolic sizes) and at run time (real tensors). A condition on SymInts that
must hold (a size limit) goes through ``torch._check_with``, so dynamic shapes
get a guard or a runtime assertion; a comparison of two shapes refuses what a
guard can decide differs, and passes a data-dependent size that no guard can decide.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence, Union

import torch

from ..compat import check_with, guard_or_true as _guard_or_true

#: the chips the pass can target: ``generic`` (any device: every form of every op, as the
#: reference kernels run them), Atlas A2, Atlas A3, Ascend 950PR/950DT, and ``common``: only
#: what all three run, the target taken when the chip cannot be told.
TARGETS = ("generic", "a2", "a3", "950", "common")

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

Message = Union[str, Callable[[], str]]


class FusedOpInputError(ValueError):
    """An input violates a fused operator's documented constraint."""


def require(condition, message: Message) -> None:
    """Raise FusedOpInputError(message) unless ``condition``; messages may be lazy."""
    lazy = message if callable(message) else (lambda: message)
    if isinstance(condition, torch.SymBool):
        check_with(FusedOpInputError, condition, lazy)
    elif not condition:
        raise FusedOpInputError(lazy())


def shown(sizes) -> list:
    """Sizes for a message: a symbolic size as its value in this trace, where it has one."""
    return [s.node.hint if isinstance(s, torch.SymInt) and s.node.hint is not None else s for s in sizes]


def same_shape(a: Sequence, b: Sequence) -> bool:
    """Not provably different (the input checks refuse only what is provably wrong)."""
    return len(a) == len(b) and all(_guard_or_true(x == y) for x, y in zip(a, b))


def broadcasts_to(small: Sequence, big: Sequence) -> bool:
    """``small`` broadcasts to ``big`` and broadcasting gives ``big`` (not a larger shape)."""
    if len(small) > len(big):
        return False
    lead = len(big) - len(small)
    return all(_guard_or_true(s == 1) or _guard_or_true(s == b) for s, b in zip(small, big[lead:]))


def size_equal(a, b) -> bool:
    return _guard_or_true(a == b)


def require_one_device(op: str, named) -> None:
    devices = {t.device for _, t in named if t is not None}
    require(len(devices) <= 1, lambda: f"{op}: all tensor arguments must be on the same device, got "
            + ", ".join(f"{name} on {t.device}" for name, t in named if t is not None))


def require_dtype_like(op: str, reference: str, ref, named) -> None:
    for name, t in named:
        if t is not None:
            require(t.dtype == ref.dtype, lambda: f"{op}: {name} dtype {t.dtype} must equal {reference} "
                    f"dtype {ref.dtype}")


def require_float(op: str, name: str, t) -> None:
    require(t.dtype in FLOAT_DTYPES,
            lambda: f"{op}: {name} dtype must be float16, bfloat16 or float32, got {t.dtype}")


def numel(shape) -> int:
    return math.prod(shape)


#: B, N, S and D of the declared cases
CASE_SIZES = {"B": 2, "N": 4, "S": 16, "D": 64}


def case_shape(layout: str) -> tuple:
    """A declared case's shape for a layout name (``"BSND"``, ``"1S1D"``)."""
    return tuple(1 if axis == "1" else CASE_SIZES[axis] for axis in layout)
