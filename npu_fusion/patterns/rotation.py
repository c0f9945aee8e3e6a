"""The RoPE rules' shared reading of rotations: the lanes evaluator's bounds, the terms and layouts of a rotation, and rotation-shaped sums."""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Tuple

import torch.fx as fx

from ..compat import marked_dynamic_source
from ..lowering.ops.rope_grad import ROPE_MAX_D, rope_target_problem
from ..lowering.sizes import static_int
from . import lane_pieces
from .evaluator import Provenance
from .lanes import LaneEvaluator
from .nodes import CAST_TARGETS, VIEWS, aten, axis_order, calls_to, downstream, dtype, gradient_dependent, outermost, shape
from .pairing import source


#: the widest last axis the lane evaluator tracks: no target accepts a RoPE head dim D above it
MAX_LANES = ROPE_MAX_D


def lane_evaluator(provenance: Optional[Provenance], forced_leaves=()) -> LaneEvaluator:
    """The lanes domain's evaluator with RoPE's bound."""
    return LaneEvaluator(provenance, forced_leaves, max_lanes=MAX_LANES)


#: (leaf id, the leaf position that plays each position of the fused op's operand)
Role = Tuple[int, Tuple[int, ...]]


def contiguous(lid: int, offset: int, d: int) -> Role:
    return lid, lane_pieces.consecutive(offset, d)


# -- docs/fused-ops.md#rotary_position_embedding_grad, position by position -------

@functools.lru_cache(maxsize=256)
def dx_terms(mode: int, d: int):
    """For each position i of dx: ((coef, dy position, table, table position), ...), cached per (mode, d)."""
    h, q = d // 2, d // 4
    out = []
    for i in range(d):
        if mode == 0:
            other = (1, i + h) if i < h else (-1, i - h)
        elif mode == 1:
            other = (1, i + 1) if i % 2 == 0 else (-1, i - 1)
        elif mode == 2:
            other = (1, i + q) if (i // q) % 2 == 0 else (-1, i - q)
        else:
            j = i // 2
            if i % 2 == 0:
                out.append(((1, j, "cos", j), (1, j + h, "sin", j + h)))
            else:
                out.append(((1, j + h, "cos", j + h), (-1, j, "sin", j)))
            continue
        out.append(((1, i, "cos", i), (other[0], other[1], "sin", other[1])))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def table_terms(mode: int, d: int, which: str):
    """For each position i of dcos's (``which="cos"``) or dsin's summand: (coef, x position), cached."""
    h, q = d // 2, d // 4
    out = []
    for i in range(d):
        if which == "cos":
            out.append((1, i) if mode != 3 else ((1, 2 * i) if i < h else (1, 2 * (i - h) + 1)))
        elif mode == 0:
            out.append((-1, i + h) if i < h else (1, i - h))
        elif mode == 1:
            out.append((-1, i + 1) if i % 2 == 0 else (1, i - 1))
        elif mode == 2:
            out.append((-1, i + q) if (i // q) % 2 == 0 else (1, i - q))
        else:
            out.append((-1, 2 * i + 1) if i < h else (1, 2 * (i - h)))
    return tuple(out)


# -- the same formulas as runs of positions (:func:`~.lane_pieces.term_runs`; None: interleaved) --

@functools.lru_cache(maxsize=256)
def dx_runs(mode: int, d: int):
    """:func:`dx_terms` as runs of positions: position i pairs dy's index with a table's."""
    return lane_pieces.term_runs(dx_terms(mode, d))


@functools.lru_cache(maxsize=256)
def table_runs(mode: int, d: int, which: str):
    """:func:`table_terms` as runs of positions: position i pairs dy's index i with x's."""
    return lane_pieces.term_runs(tuple(((c, i, "x", xp),) for i, (c, xp) in enumerate(table_terms(mode, d, which))))


@functools.lru_cache(maxsize=256)
def y_runs(mode: int, d: int):
    """The forward's y as runs of positions: position i pairs x's index a(i) with cos[i] and, times
    s(i), x's index b(i) with sin[i]."""
    return lane_pieces.term_runs(tuple(((1, a, "cos", i), (s, b, "sin", i)) for i, ((_, a), (s, b)) in
                                       enumerate(zip(table_terms(mode, d, "cos"), table_terms(mode, d, "sin")))))


def monomial(a, b):
    return tuple(sorted((a, b)))


#: a table may be a leaf or its negation: nanochat rotates by ``cat(x2, -x1)``, which is
#: mode 0 with sin negated
TABLE_SIGNS = ((1, 1), (1, -1), (-1, 1), (-1, -1))


# -- per-target constraints (docs/fused-ops.md#rotary_position_embedding_grad) --

def rope_layout_problem(target: str, mode: int, rotated_shape, table_shape, with_x: bool, compute,
                        order=None) -> Optional[str]:
    """Why the target cannot run the rotation on the shapes the fused op is called with, or None.

    :func:`rope_target_problem` on those shapes, forward or backward (one
    verdict for both rules of a rotation): the tables right-aligned to the rotated tensor's rank, as
    broadcasting reads them and as both rules unsqueeze them (:func:`~.layout.permuted`), both with
    their axes in ``order`` (the output's memory order; None: as they are)."""
    rank = len(rotated_shape)
    table = (1,) * (rank - len(table_shape)) + tuple(table_shape)
    order = list(order) if order is not None else list(range(rank))
    rotated, table = tuple(rotated_shape[d] for d in order), tuple(table[d] for d in order)
    if heads_folded(rotated, table):
        rotated, table = (rotated[0], 1, *rotated[1:]), (table[0], 1, *table[1:])
    return rope_target_problem(target, mode, rotated, table, with_x, compute)


def heads_folded(rotated_shape, table_shape) -> bool:
    """Whether a 3-D rotation runs as the fused op's 4-D BNSD layout, an axis of size 1 inserted at 1.

    A 3-D tensor is the op's TND layout, whose tables vary along its first axis (T1D, TND). A q
    ``[B*H, S, D]`` or ``[B, S, D]`` (heads folded into the batch, or one head) rotated by ``[S, D]``
    or ``[1, S, D]`` tables, right-aligned ``[1, S, D]`` and so broadcast over the first axis, is
    no TND rotation. Viewed ``[A, 1, S, D]`` with tables ``[1, 1, S, D]`` (both unsqueezed at 1),
    it is BNSD with B = A, N = 1 and 11SD tables: element ``(a, 0, s, d)`` reads the tables at
    ``(0, 0, s, d)``, which is ``(0, s, d)`` of the 3-D tables, the element ``(a, s, d)`` read,
    for every a; so the 4-D op computes the 3-D rotation, and its results viewed back (the axis
    of size 1 dropped; table gradients summed over the same axes, in the tables' shape) are the
    same values. ``table_shape`` right-aligned to the rotated tensor's. Where the rotated tensor's
    first axis is 1 too (one sequence of one head, ``[1, S, D]``), TND (T = 1) reads it as well, but
    A2/A3 take only 4-D tensors: BNSD with B = N = 1 runs everywhere."""
    if len(rotated_shape) != 3:
        return False
    table = (1,) * (3 - len(table_shape)) + tuple(table_shape)
    return static_int(table[0]) == 1


def fold_heads(edit, node: Optional[fx.Node]) -> Optional[fx.Node]:
    """``node`` (a 3-D rotated tensor or a table right-aligned to it) with an axis of size 1
    inserted at 1, as :func:`heads_folded` views it; None stays None."""
    return None if node is None else edit.call(aten.unsqueeze.default, (node, 1))


def unfold_heads(edit, result: fx.Node, rank: int) -> fx.Node:
    """A result of a call :func:`fold_heads` prepared, with the inserted axis dropped and as many
    leading axes of size 1 as make it ``rank``-D (a table gradient in the table's own shape).

    Squeezes, not views: they name no size, so a symbolic one needs no node of its own."""
    result = edit.call(aten.squeeze.dim, (result, 1))
    extra = len(shape(result)) - rank
    return edit.call(aten.squeeze.dims, (result, list(range(extra)))) if extra > 0 else result


#: uses from an element move to the sum of a rotation (slice, neg, stack, flatten view, multiply, add)
ROTATION_SUM_REACH = 4


def rotation_sums(seeds, is_rotation_sum, symbolic_only: bool = True) -> List[fx.Node]:
    """The outermost rotation-shaped sums near an element move along a symbolic last axis.

    Each is a node ``is_rotation_sum`` accepts within :data:`ROTATION_SUM_REACH` uses of a seed
    (an element move): rotations no rule can prove, forward (:mod:`.rope`) or backward.
    Without ``symbolic_only``, along any last axis: what looks like a rotation in a graph with no
    backward to pair it with (an inference graph's leftovers)."""
    return outermost(list(rotation_seeds(seeds, is_rotation_sum, symbolic_only)))


def rotation_seeds(seeds, is_rotation_sum, symbolic_only: bool = True) -> Dict[fx.Node, fx.Node]:
    """Each rotation-shaped sum :func:`rotation_sums` finds, with the element move it was found from.

    Returned as ``{sum: seed}``, every sum, not only the outermost."""
    sums = {}
    for seed in seeds:
        symbolic = bool(shape(seed)) and static_int(shape(seed)[-1]) is None
        if shape(seed) and (symbolic or not symbolic_only) and along_last_axis(seed):
            user = next((u for u in downstream(seed.graph, [seed], ROTATION_SUM_REACH)
                         if u is not seed and is_rotation_sum(u)), None)
            if user is not None:
                sums.setdefault(user, seed)
    return sums


def symbolic_head_dim_reason(what: str, marked: Optional[str] = None) -> str:
    """Why a rotation-shaped sum over a symbolic head dim stays: ``what`` was found, and why the head dim is not static.

    ``marked``: the input axis the user marked dynamic with ``mark_dynamic``
    (:func:`~npu_fusion.compat.marked_dynamic_source`), whose constraint forbids the guard that
    would keep the head dim static; None: the graph was compiled where no guard reaches Dynamo
    (after Dynamo made its guards)."""
    proof = "the pass proves RoPE per position of a static head dim"
    if marked is not None:
        return (f"{what}: {proof}, and the head dim {marked} is marked dynamic (mark_dynamic), which forbids "
                f"the guard that would keep it static: drop mark_dynamic on that axis, or mark it with "
                f"maybe_mark_dynamic (the pass then guards it to its value)")
    return (f"{what}: {proof}, and this one was compiled after Dynamo made its guards, where no guard can "
            f"keep it static: keep the head dim static")


def head_dim_mark(node: fx.Node) -> Optional[str]:
    """The input axis marked dynamic (``mark_dynamic``) that a node's symbolic last axis stands for, or None."""
    size = shape(node)[-1] if shape(node) else None
    return marked_dynamic_source(size)


def symbolic_head_dims(graph: fx.Graph, gradient: bool, is_rotation_sum) -> list:
    """The symbolic last-axis sizes of the element moves (of gradients, or of forward values)
    that a rotation-shaped sum reads: the head dims a RoPE rule needs static.

    With each size come the graph inputs' sizes that are its symbols: a guard on the move's own
    size alone may leave the head dim symbolic (HF's ``rotate_half`` slices ``x[..., :d // 2]``,
    whose size ``d // 2`` keeps its example value for two head dims; ``chunk`` splits at ``(d + 1) // 2``)."""
    moved = gradient_dependent(graph) or set()
    seeds = [n for n in element_moves(graph) if (n in moved) == gradient]
    sizes = {}
    for seed in rotation_seeds(seeds, is_rotation_sum).values():
        # the moved tensor's own last axis too: an interleaved rotation's seed is a strided slice
        # x[..., ::2], whose size (s + 1) // 2 a guard fixes without fixing x's head dim s
        for node in [seed, *seed.all_input_nodes]:
            size = shape(node)[-1] if shape(node) else None
            if size is not None and static_int(size) is None:
                sizes.setdefault(str(size), size)
    if not sizes:
        return []
    by_symbol = {}  # each graph input's size that is a single symbol, by that symbol
    for node in graph.nodes:
        if node.op == "placeholder":
            for size in shape(node) or ():
                if static_int(size) is None and getattr(size.node.expr, "is_Symbol", False):
                    by_symbol.setdefault(size.node.expr, size)
    for size in list(sizes.values()):
        for symbol in sorted(size.node.expr.free_symbols, key=str):
            if symbol in by_symbol:
                sizes.setdefault(str(by_symbol[symbol]), by_symbol[symbol])
    return list(sizes.values())


def sums_dx_terms(node: fx.Node) -> bool:
    """A complex product, or a sum one of whose operands is a rotation's term: a product of two
    tensors varying along the last axis, possibly negated, cast, reshaped or moved."""
    if node.target is aten.mul.Tensor:
        return dtype(node) is not None and dtype(node).is_complex
    return node.target in (aten.add.Tensor, aten.sub.Tensor) and any(_rotation_term(a) for a in node.args[:2])


def _rotation_term(node, depth: int = 6) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function" or depth == 0:
        return False
    if varying_product(node):
        return True
    if node.target in (aten.cat.default, aten.stack.default):
        return any(_rotation_term(a, depth - 1) for a in node.args[0])
    if node.target in (aten.slice_scatter.default, aten.select_scatter.default):
        return any(_rotation_term(a, depth - 1) for a in node.args[:2])
    if node.target in MOVES_ELEMENTS | CAST_TARGETS | VIEWS | {aten.neg.default}:
        return _rotation_term(node.args[0], depth - 1)
    return False


#: where an element move's axis is among its arguments (the others move along the last axis)
_AXIS_ARGUMENT = {aten.slice.Tensor: 1, aten.select.int: 1, aten.cat.default: 1, aten.stack.default: 1,
                  aten.unbind.int: 1, aten.split.Tensor: 2, aten.split_with_sizes.default: 2,
                  aten.slice_backward.default: 2, aten.select_backward.default: 2, aten.slice_scatter.default: 2}


def along_last_axis(node: fx.Node) -> bool:
    """Whether an element move (:func:`moves_elements`) moves along its input's last axis."""
    position = _AXIS_ARGUMENT.get(node.target)
    if position is None:
        return True  # view_as_complex/real, a transpose of the last axis
    source = node.args[0][0] if node.target in (aten.cat.default, aten.stack.default) else node.args[0]
    if node.target is aten.select_backward.default:  # its input lacks the selected axis; the output has it
        source = node
    axis = node.args[position] if len(node.args) > position else node.kwargs.get("dim", 0)
    rank = len(shape(source)) if shape(source) is not None else None
    if rank is None or not isinstance(axis, int):
        return True  # unknown: keep the scan's record rather than risk a silent miss
    if node.target is aten.stack.default:  # stacking inserts an axis: the last or the one before
        return axis % (rank + 1) >= rank - 1
    return axis % rank == rank - 1


def varying_product(node) -> bool:
    """A product, through casts, reshapes and scalings by constants, of two tensors that vary
    along the last axis: a term of a rotation, not a constant or a weight per channel."""
    passed_on = CAST_TARGETS | {aten.view.default, aten._unsafe_view.default, aten.expand.default}
    while isinstance(node, fx.Node) and (node.target in passed_on or unscaled(node) is not node):
        node = node.args[0] if node.target in passed_on else unscaled(node)
    return isinstance(node, fx.Node) and node.target is aten.mul.Tensor and all(
        isinstance(a, fx.Node) and shape(a) and static_int(shape(a)[-1]) != 1 for a in node.args[:2])


def unscaled(node: fx.Node) -> fx.Node:
    """``node`` without the products and quotients by constants it is (``2 * q`` is q)."""
    while node.op == "call_function" and node.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor,
                                                         aten.div.Scalar):
        tensors = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        if len(tensors) != 1 or (node.target in (aten.div.Tensor, aten.div.Scalar) and node.args[0] is not tensors[0]):
            break
        node = tensors[0]
    return node


#: ops that move elements along trailing axes: every RoPE dx is a few uses after one
MOVES_ELEMENTS = {
    aten.slice.Tensor, aten.slice_backward.default, aten.slice_scatter.default, aten.cat.default,
    aten.stack.default, aten.select.int, aten.select_backward.default, aten.unbind.int, aten.split.Tensor,
    aten.split_with_sizes.default, aten.view_as_complex.default, aten.view_as_real.default,
}
#: ops that move elements along trailing axes when they reorder the last axis
#: (DeepSeek's ``view(..., D/2, 2).transpose(-1, -2)``), not when they swap heads
#: and sequence, as attention does on every q, k and v
REORDERS_AXES = {aten.transpose.int, aten.permute.default}


def element_moves(graph: fx.Graph) -> List[fx.Node]:
    """The graph's calls that move elements along trailing axes (:func:`moves_elements`), in graph order.

    Read off the graph's index of nodes by target (a few hundred of a model's thousands of nodes),
    not by asking every node."""
    return [n for n in calls_to(graph, *MOVES_ELEMENTS, *REORDERS_AXES) if moves_elements(n)]


def moves_elements(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in MOVES_ELEMENTS:
        return True
    if node.target not in REORDERS_AXES or shape(node) is None:
        return False
    rank = len(shape(node))
    return axis_order(node.target, node.args[1:], rank)[rank - 1] != rank - 1


#: uses between such an op and the outermost node of a dx (add, cast, view, ...)
DX_DEPTH = 6
