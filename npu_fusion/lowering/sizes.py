"""Sizes that may be symbolic, compared only where the comparison is provable.

The pass and the per-target limits decide with these: a size that a guard could
still decide either way counts as "not known", so nothing is fused on a hope. (The
fused ops' own input checks, in :mod:`.ops` and :mod:`.checks`, decide the other way round:
they refuse only what is provably wrong.)

A chip's limit on sizes (RoPE's ``B < 1000`` on A2/A3) is decided as Inductor decides what its
kernels need (:func:`limit_problem`): proved from the symbols' ranges, else, where the pass runs
inside :func:`guarding_sizes` and the example sizes keep the limit, kept under a guard, so that
Dynamo recompiles a call beyond it; the guards of one decision are installed only when the
whole decision (:func:`decided_under_guards`) finds no problem.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, List, Optional, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..compat import guard_size_condition, guardable_example, implied_by_guards, marked_dynamic_source, size_hint

#: the size conditions the decision in progress keeps under a guard, or None where no guard may
#: be installed (outside :func:`guarding_sizes`)
_PENDING_GUARDS: contextvars.ContextVar[Optional[List]] = contextvars.ContextVar("npu_fusion_size_guards",
                                                                                 default=None)


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
    """Whether ``a < b`` holds for every size the graph runs with: numbers, the symbols' ranges, or the guards already made."""
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    condition = a < b
    return bool(statically_known_true(condition)) or (isinstance(condition, torch.SymBool)
                                                       and implied_by_guards(condition))


@contextlib.contextmanager
def guarding_sizes(allowed: bool = True):
    """Let the limit checks inside keep a limit on symbolic sizes under a guard (``allowed``), or forbid it.

    The pass manager enters it around the rounds on a graph compiled while Dynamo still makes
    guards (a joint or inference graph); a graph compiled later gets no guard."""
    token = _PENDING_GUARDS.set([] if allowed else None)
    try:
        yield
    finally:
        _PENDING_GUARDS.reset(token)


def limit_problem(a, b) -> Optional[str]:
    """Why ``a < b`` (sizes, either maybe symbolic) cannot be relied on, or None where it holds.

    None where it is proved (numbers, or the symbols' ranges), or where a guard may be installed
    (:func:`guarding_sizes`) and the example sizes keep it: the condition is then kept for the
    guard that :func:`decided_under_guards` installs. Otherwise a short reason: the example
    values break it, or no guard can keep it here."""
    if provably_less(a, b):
        return None
    if isinstance(a, int) and isinstance(b, int):
        return "it does not hold"
    condition = a < b
    example = guardable_example(condition)
    if example is False or (example is None and size_hint(condition) is False):
        return "the example sizes break it"
    pending = _PENDING_GUARDS.get()
    marked = marked_dynamic_source(condition) if example is None and pending is not None else None
    if marked is not None:
        return (f"not provable for symbolic sizes, and {marked} is marked dynamic (mark_dynamic) with a range a "
                f"guard on it would narrow: give mark_dynamic a min and max within the limit, or mark it with "
                f"maybe_mark_dynamic (the pass then keeps the limit under a guard)")
    if example is None or pending is None:
        return "not provable for symbolic sizes, and no guard can keep it in this graph"
    pending.append(condition)
    return None


def decided_under_guards(decision: Callable[..., Optional[str]]) -> Callable[..., Optional[str]]:
    """``decision`` (a function returning a problem or None) installing the guards its limits need only when it returns None.

    One decision's limits are installed together (:func:`~npu_fusion.compat.guard_size_condition`):
    a site refused for any reason adds no guard."""
    @functools.wraps(decision)
    def decide(*args, **kwargs):
        if _PENDING_GUARDS.get() is None:
            return decision(*args, **kwargs)
        token = _PENDING_GUARDS.set([])
        try:
            problem = decision(*args, **kwargs)
            conditions = _PENDING_GUARDS.get()
        finally:
            _PENDING_GUARDS.reset(token)
        if problem is None and not all(guard_size_condition(c) for c in conditions):
            return "a size limit could not be kept under a guard"
        return problem
    return decide
