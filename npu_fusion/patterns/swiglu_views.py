"""Where SwiGLU's x is when the gate is no piece of a leaf: the view or the value the halves are cut from.

The lanes domain (:class:`~.lanes.LaneEvaluator`) reads a projection's last axis, and through the
views, splits and pointwise ops after it: the halves of ``h.chunk(2, -1)`` are pieces of h. Where
they are no pieces of one leaf, the x the fused op reads may still be a node of the graph the
domain read through: a view split along its last axis (``h.view(B, S, N, 2 * I).chunk(2, -1)``),
or a ``[..., 2, H]`` view split into its two rows (``(h + b).view(B, S, 2, H).unbind(-2)``,
``h.reshape(B * S, 2, H).unbind(1)``), read here as a leaf of two tracked axes, its rows the two
halves of its ``2 * H`` elements. Reading a node as a leaf is exact (a leaf is its own value), so a
site found over it is proven as any other; the fused op then reads that node, viewed ``[..., 2 * H]``
where it tracks two axes (:func:`flat_shape`).
"""
from __future__ import annotations

import math
import operator
from typing import Dict, Optional, Tuple

import torch.fx as fx

from . import lane_pieces
from ..lowering.sizes import static_int
from .lane_polys import Lanes
from .lanes import LaneEvaluator
from .nodes import aten, is_float_cast, shape, val


class HalvesEvaluator(LaneEvaluator):
    """The lanes domain with some forced leaves read over more trailing axes than the last one."""

    def __init__(self, leaves=(), axes: Optional[Dict[fx.Node, int]] = None):
        super().__init__(None, forced_leaves=leaves)
        #: forced leaves tracked over their trailing ``axes[node]`` axes (one where absent)
        self.axes: Dict[fx.Node, int] = dict(axes or {})

    def _leaf(self, node: fx.Node) -> Optional[Lanes]:
        k = self.axes.get(node, 1)
        s, v = shape(node), val(node)
        if k == 1 or s is None or len(s) < k or v is None or not v.dtype.is_floating_point:
            return super()._leaf(node)
        inner = tuple(static_int(x) for x in s[len(s) - k:])
        if None in inner:
            return None
        # position p (flat, row-major over the k tracked axes) is the leaf's element p
        return Lanes(inner, pieces=lane_pieces.leaf_pieces(self.leaf_id(node), math.prod(inner)))


def swiglu_evaluator(leaves=(), axes: Optional[Dict[fx.Node, int]] = None) -> LaneEvaluator:
    """The lanes domain over the whole graph: every node read as itself (silu a leaf), ``leaves`` read as leaves
    (over their trailing ``axes[leaf]`` axes where given)."""
    return HalvesEvaluator(leaves, axes)


def leaf_axes(ev: LaneEvaluator, x: fx.Node) -> int:
    """How many trailing axes of x the evaluator tracks as one leaf (the fused op reads them as one axis)."""
    return getattr(ev, "axes", {}).get(x, 1)


def flat_shape(x: fx.Node, axes: int) -> list:
    """x's shape with its ``axes`` trailing axes merged into one: the ``[..., 2H]`` the fused op reads."""
    s = list(shape(x))
    return s[:len(s) - axes] + [math.prod(static_int(d) for d in s[len(s) - axes:])]


def viewable_problem(x: fx.Node, axes: int) -> Optional[str]:
    """Why x cannot be viewed with its ``axes`` trailing axes merged (the fused op's x), or None."""
    if axes == 1:
        return None
    try:
        val(x).view(flat_shape(x, axes))
    except RuntimeError:
        return f"{x.name}'s two trailing axes cannot be viewed as one ({list(shape(x))}): the fused op reads them so"
    return None


def unnamed_size_problem(exc: Exception) -> str:
    """The miss of a site whose rewrite would view a value to a symbolic size no graph input names."""
    return (f"{exc}: the rewrite views x to the [..., 2H] the fused op reads, or its result to the program's "
            f"shape, and an emitted view names each symbolic size by an input (keep the leading axes, "
            f"view(B, S, 2, H), to fuse with them dynamic)")


def through_casts(node: fx.Node) -> fx.Node:
    """The node past the float casts that end at it."""
    while is_float_cast(node):
        node = node.args[0]
    return node


#: the ops that lay a value out in another shape, element for element
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int}
#: the ops that cut a value into pieces along one axis (the ATen spellings of chunk, split, narrow)
SPLITTING = {aten.split.Tensor, aten.split_with_sizes.default, aten.unsafe_split.Tensor,
             aten.unsafe_split_with_sizes.default}


def split_piece(node) -> Optional[Tuple[fx.Node, int, tuple]]:
    """``(source, axis, which)`` when ``node`` (past float casts) is one piece of a split, chunk or slice.

    Read by structure, not by value, so that it answers where the lanes domain cannot (a split
    along another axis than the last, a symbolic width): ``which`` tells two pieces of one
    source apart. An ``as_strided`` view is a piece of its source too, along no axis (-1 then)."""
    if not isinstance(node, fx.Node):
        return None
    node = through_casts(node)
    if node.op != "call_function" or shape(node) is None:
        return None
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].target in SPLITTING:
        split = node.args[0]
        source, axis = split.args[0], split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        which = ("piece", node.args[1])
    elif node.target is operator.getitem and isinstance(node.args[0], fx.Node) and \
            node.args[0].target is aten.unbind.int:  # one index of an axis: h.view(..., 2).unbind(-1)
        unbind = node.args[0]
        source, axis = unbind.args[0], unbind.args[1] if len(unbind.args) > 1 else unbind.kwargs.get("dim", 0)
        which = ("index", str(node.args[1]))
    elif node.target is aten.select.int:
        source, axis, which = node.args[0], node.args[1], ("index", str(node.args[2]))
    elif node.target is aten.slice.Tensor:
        source, axis = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        which = ("slice",) + tuple(str(a) for a in node.args[2:4])
    elif node.target is aten.narrow.default:
        source, axis, which = node.args[0], node.args[1], ("narrow", str(node.args[2]), str(node.args[3]))
    elif node.target is aten.as_strided.default:
        source, axis, which = node.args[0], -1, ("strided",) + tuple(str(a) for a in node.args[1:])
    else:
        return None
    if not isinstance(source, fx.Node) or shape(source) is None or not len(shape(source)):
        return None
    return source, axis % len(shape(source)), which


def view_leaf_evaluator(ev: LaneEvaluator, gate_input) -> Optional[LaneEvaluator]:
    """An evaluator that reads as a leaf the value a gate's split cuts (past float casts), or None.

    ``h.view(B, S, N, 2 * I).chunk(2, -1)`` of a ``[B, S, 2 * N * I]`` projection: the lanes domain
    tracks the projection's last axis, where the gate is N pieces, no half; over the view (a leaf
    here) the gate and the up are its two halves, and ``swiglu(view, -1)`` the same function. So
    for any value split along its last axis that the domain read through (``(h + b).chunk(2, -1)``).
    A ``[..., 2, H]`` value split into its two rows (``unbind(-2)``, ``select(-2)``, ``chunk(2, -2)``)
    whose rows the domain could not read as a projection's halves (a view that merges the leading
    axes, a projection plus a bias): that value is a leaf over its two trailing axes, the rows its
    halves, and the fused op reads it viewed ``[..., 2H]``. None where ``ev`` reads that value as a
    leaf already, or the gate is no such piece."""
    found = split_piece(gate_input)
    if found is None or found[2][0] == "strided":
        return None
    source, axis, _ = found
    node, rank = through_casts(source), len(shape(source))
    if node in ev.forced_leaves or shape(node) is None or len(shape(node)) != rank:
        return None
    if axis == rank - 1:
        return swiglu_evaluator((node,))
    if axis == rank - 2 and static_int(shape(node)[axis]) == 2 and static_int(shape(node)[-1]) is not None:
        return swiglu_evaluator((node,), {node: 2})
    return None


def gate_unread(piece, gate_input) -> bool:
    """Whether the lanes domain read nothing of the gate's split: no piece, or the gate node is its own leaf."""
    return piece is None or piece.x is through_casts(gate_input)
