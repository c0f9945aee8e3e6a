"""Running a fused op in the memory order of the value it replaces.

The fused ops write contiguous outputs, with the normalized or rotated axes innermost. A
decomposed forward's output is often laid out otherwise: HF q/k norms and rotations run on
``q.view(B, S, H, D).transpose(1, 2)``, a value of shape [B, H, S, D] that is BSHD in memory,
and the elementwise ops keep that layout. Later nodes may rely on those strides (a ``view``
valid only for them). So where the output is dense in some order of its leading axes with the
op's trailing axes innermost (:func:`memory_order`), the op runs in that order: its operands
are permuted into it (a free view, contiguous when the operand shares the output's layout; a
broadcast table right-aligned first), and each result is permuted back (:func:`restored`),
which gives it exactly the output's strides. A small output the program lays out otherwise
than that order (a keep-dim rstd, contiguous while y is BSHD) is copied into the program's own
layout (:func:`relaid_like`). Strides are compared as expressions, so symbolic sizes need no
guard. Where no order has the op's axes innermost (Zaya's q, [B, H, S, D] stored BHDS), the op
runs in the shape's order and each result is copied into the program's layout, one copy of the
output; a layout that is dense in no order at all (overlapping, padded) keeps the site as it
is, a recorded miss.
"""
from __future__ import annotations

import itertools
from typing import List, Optional

import torch
import torch.fx as fx

from ..compat import symbolic_expr
from ..lowering.sizes import static_int
from .nodes import aten, shape, val


def expression(size):
    """A size or stride as a value equal ones share without a guard: an int, or its expression."""
    return size if isinstance(size, int) else symbolic_expr(size)


def same_layout(a: fx.Node, b: fx.Node) -> bool:
    """The two values have the same strides (along every axis of size above 1), compared as
    expressions (no guard on a symbolic stride)."""
    va, vb = val(a), val(b)
    return all(static_int(n) == 1 or expression(sa) == expression(sb)
               for n, sa, sb in zip(va.shape, va.stride(), vb.stride()))


def memory_order(node: fx.Node, inner: int = 1) -> Optional[List[int]]:
    """The axes of ``node``'s value from outermost to innermost in memory, or None.

    The axes of ``node``'s value from outermost to innermost in memory, its last ``inner``
    axes innermost and in order: the order of the leading axes whose dense strides equal the
    value's (axes of size 1 excepted), compared as expressions; None when no order does (the
    value is no dense layout of its shape with those axes innermost)."""
    v = val(node)
    if not isinstance(v, torch.Tensor) or inner > v.dim():
        return None
    rank = v.dim()
    size, strides = [expression(s) for s in v.shape], [expression(s) for s in v.stride()]
    for lead in itertools.permutations(range(rank - inner)):
        order, dense, expected = list(lead) + list(range(rank - inner, rank)), 1, [None] * rank
        for axis in reversed(order):
            expected[axis], dense = dense, dense * size[axis]
        if all(static_int(v.shape[d]) == 1 or expected[d] == strides[d] for d in range(rank)):
            return order
    return None


def _identity(order: List[int]) -> bool:
    return order == sorted(order)


def permuted(edit, node: fx.Node, order: List[int]) -> fx.Node:
    """``node`` (right-aligned to ``len(order)`` axes, as broadcasting reads it) with its axes
    in ``order``."""
    for _ in range(len(order) - len(shape(node))):
        node = edit.call(aten.unsqueeze.default, (node, 0))
    if node.op == "call_function" and node.target is aten.permute.default:  # a result permuted back: undone
        order, node = [node.args[1][axis] for axis in order], node.args[0]
    return node if _identity(order) else edit.call(aten.permute.default, (node, list(order)))


def restored(edit, node: fx.Node, order: List[int]) -> fx.Node:
    """A result computed on operands :func:`permuted` into ``order``, with its axes back in
    the program's order."""
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return node if _identity(order) else edit.call(aten.permute.default, (node, inverse))


def relaid_like(edit, node: fx.Node, like: fx.Node, inner: int = 0) -> Optional[fx.Node]:
    """A copy of ``node`` with ``like``'s strides (both of one shape), ``like`` being a dense
    layout (with its last ``inner`` axes innermost); None when it is none."""
    order = memory_order(like, inner)
    if order is None:
        return None
    copied = edit.call(aten.clone.default, (permuted(edit, node, order),), {"memory_format": torch.contiguous_format})
    return restored(edit, copied, order)
