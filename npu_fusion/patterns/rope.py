"""Fuse RoPE backward subgraphs into ``npu_fusion.rotary_position_embedding_grad``.

Unfused, as AOTAutograd writes the backward of ``q_embed = q * cos + rotate_half(q) * sin``
(HF ``apply_rotary_pos_emb``), for each of q and k::

    t     = mul(dy, sin)
    a, b  = slice(t, -1, 0, D/2), slice(t, -1, D/2, D)
    r     = slice_backward(neg(a), .., D/2, D) + slice_backward(b, .., 0, D/2)
    dx    = add(r, mul(dy, cos))                       # also full + slice_scatter forms
    dcos  = sum(mul(dy, x), broadcast dims)            # when cos/sin require grad
    dsin  = sum(mul(dy, rotate_half(x)), broadcast dims)

Fused::

    dx, dcos, dsin = npu_fusion.rotary_position_embedding_grad(dy, cos, sin, x?, mode)

How a match is found: every node is evaluated by :class:`~.lanes.LaneEvaluator`
into exact per-position polynomials of its leaves. A node is a ``dx`` when its
polynomials equal the op's formula (docs/fused-ops.md#rotary_position_embedding_grad) for some
mode and some leaves playing dy, cos and sin; a node is a ``dcos``/``dsin`` of that site when it equals the
broadcast-reduced ``dy * x`` / ``dy * rotate(x)`` with the same dy. Equality of
those polynomials is equality of the functions, so near misses (a wrong sign, a
wrong split point, a swapped table) simply do not match.

Where x is also read outside the rotation (``rope(q) * q``) or rotated twice, autograd sums
dx with x's other gradients and dx is no node of its own: at the root of such a tree of adds,
the summands but one are summed in the same algebra and matched as dx; the one left out
is added back to the fused dx (as the RMSNorm rule does with the residual gradient).
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Dict, List, Optional, Tuple

import torch.fx as fx

from ..lowering import ROPE_GRAD as OP
from ..lowering.ops.rope_grad import ROPE_MAX_D, ROPE_MODES, rope_divisor, rope_target_problem
from ..lowering.sizes import same_shape, static_int
from .evaluator import Provenance, Unsupported, kept_precision, rounding_problem
from . import lane_pieces
from .lanes import Lanes, LaneEvaluator, add_polys, position_forms
from .nodes import (CAST_TARGETS, VIEWS, aten, axis_order, downstream, dtype, gradient_dependent, gradient_product,
                    is_float_cast, last_of, outermost, region_of, shape)
from .rewrite import (Edit, Insertion, Miss, RuleContext, add_back_accumulated, commit, emit_fused_op,
                      exact_common_dtype, gradient_accumulation)
from .layout import permuted
from .pairing import ROTATION_SITE, site_key, source
from .rule import Form, FusionRule, RoundReport, SiteProbe

#: the widest last axis the lane evaluator tracks: no target accepts a RoPE head dim D above it
MAX_LANES = ROPE_MAX_D


def lane_evaluator(provenance: Optional[Provenance], forced_leaves=()) -> LaneEvaluator:
    """The lanes domain's evaluator with RoPE's bound."""
    return LaneEvaluator(provenance, forced_leaves, max_lanes=MAX_LANES)


#: (leaf id, the leaf position that plays each position of the fused op's operand)
Role = Tuple[int, Tuple[int, ...]]


def contiguous(lid: int, offset: int, d: int) -> Role:
    return lid, tuple(range(offset, offset + d))


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


def _mono(a, b):
    return tuple(sorted((a, b)))


def expected_dx(mode: int, d: int, dy: Role, cos: Role, sin: Role, signs=(1, 1)):
    """dx's polynomials with the tables' leaf positions (each table times its sign)."""
    roles, sign = {"cos": cos, "sin": sin}, {"cos": signs[0], "sin": signs[1]}
    return [{_mono((dy[0], dy[1][yp]), (roles[t][0], roles[t][1][tp])): c * sign[t] for c, yp, t, tp in lane}
            for lane in dx_terms(mode, d)]


#: a table may be a leaf or its negation: nanochat rotates by ``cat(x2, -x1)``, which is
#: mode 0 with sin negated
TABLE_SIGNS = ((1, 1), (1, -1), (-1, 1), (-1, -1))


def expected_table(mode: int, d: int, which: str, dy: Role, x: Role):
    return [{_mono((dy[0], dy[1][i]), (x[0], x[1][xp])): c}
            for i, (c, xp) in enumerate(table_terms(mode, d, which))]


def _polys_equal(a, b) -> bool:
    """Exact equality: the coefficients are rationals, never compared with a tolerance."""
    return len(a) == len(b) and all(pa == pb for pa, pb in zip(a, b))


def _equals_expected_dx(v: Lanes, mode: int, d: int, dy: Role, cos: Role, sin: Role, signs) -> bool:
    """``_polys_equal(v.polys, expected_dx(...))``, once a run of positions where the value and the
    formula have runs, else position by position, stopping at the first difference."""
    if v.inner != (d,):
        return False
    roles, sign = {"cos": cos, "sin": sin}, {"cos": signs[0], "sin": signs[1]}
    runs = dx_runs(mode, d) if v.pieces is not None else None
    if runs is not None:
        equal = lane_pieces.equals_formula(v.pieces, runs, dy, roles, lambda c, t: c * sign[t])
        if equal is not None:
            return equal
    dy_lid, dy_pos = dy
    for poly, lane in zip(v.polys, dx_terms(mode, d)):
        if poly != {_mono((dy_lid, dy_pos[yp]), (roles[t][0], roles[t][1][tp])): c * sign[t] for c, yp, t, tp in lane}:
            return False
    return True


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
    return rope_target_problem(target, mode, tuple(rotated_shape[d] for d in order), tuple(table[d] for d in order),
                               with_x, compute)


# -- matching -----------------------------------------------------------------

@dataclasses.dataclass
class RopeMatch:
    mode: int
    dx: fx.Node
    dy: Role
    cos: Role
    sin: Role
    dcos: Optional[fx.Node] = None
    dsin: Optional[fx.Node] = None
    x: Optional[Role] = None
    #: (cos, sin): -1 where the fused op's table is the leaf negated
    signs: Tuple[int, int] = (1, 1)
    #: the evaluator whose leaf numbering the roles use
    ev: Optional[LaneEvaluator] = None
    #: other gradients of x summed with dx in ``dx``'s node (x also read outside the rotation,
    #: or rotated twice): added back to the fused dx
    rest: List[fx.Node] = dataclasses.field(default_factory=list)

    @property
    def key(self):
        return (self.mode, self.dy, self.cos, self.sin, self.signs)


def _offsets(v: Lanes, lid: int) -> int:
    return v.lowest_position(lid)


@functools.lru_cache(maxsize=256)
def dx_runs(mode: int, d: int):
    """:func:`dx_terms` as runs of positions (:func:`~.lane_pieces.term_runs`), or None (interleaved modes)."""
    return lane_pieces.term_runs(dx_terms(mode, d))


def _read_tables(v: Lanes, mode: int, dy: Role) -> Optional[Tuple[Role, Role]]:
    """Which leaf position plays cos[i] and sin[i], read off the observed products with dy.

    Tables may be any leaf positions: half-width tables repeated, or the real and
    imaginary parts of a complex ``freqs_cis`` (Llama 4) both come out of one leaf.
    The caller still compares the whole polynomial, so this only proposes.
    """
    d = v.inner[0] if len(v.inner) == 1 else len(v.polys)
    runs = dx_runs(mode, d) if v.pieces is not None else None
    if runs is not None:  # read once a run of positions: the same proposal
        read = lane_pieces.read_partners(v.pieces, runs, dy, ("cos", "sin"), d)
        return None if read is None else (read[0]["cos"], read[0]["sin"])
    found = {"cos": [None] * d, "sin": [None] * d}
    lids = {"cos": set(), "sin": set()}
    for poly, lane in zip(v.polys, dx_terms(mode, d)):
        for coef, yp, table, tp in lane:
            y = (dy[0], dy[1][yp])
            others = [m for m in poly if y in m]
            if len(others) != 1:
                return None
            (other,) = [var for var in others[0] if var != y] or [y]
            if found[table][tp] not in (None, other):
                return None
            found[table][tp] = other
            lids[table].add(other[0])
    if any(len(l) != 1 for l in lids.values()) or any(p is None for t in found.values() for p in t):
        return None
    return tuple((next(iter(lids[t])), tuple(p for _, p in found[t])) for t in ("cos", "sin"))


def match_dx(ev: LaneEvaluator, node: fx.Node, v: Optional[Lanes] = None) -> Optional[RopeMatch]:
    """A match when ``node``'s value (or ``v``, a part of it) is a RoPE dx."""
    v = ev.memo.get(node) if v is None else v
    if v is None or v.reduction is not None or len(v.inner) != 1:
        return None
    d = v.inner[0]
    if d < 2 or d % 2:
        return None
    if any(len(p) != 2 or any(len(m) != 2 for m in p) for p in position_forms(v)):
        return None
    common = set.intersection(*({l for l, _ in m} for poly in (v.poly_at(0), v.poly_at(d - 1)) for m in poly))
    # dy and the tables enter a product symmetrically (a complex product most of all): try
    # first the leaves that carry the gradient in dx's own shape, the only ones dy can be
    for dy_lid in sorted(common, key=lambda lid: (not _can_be_dy(ev, ev.leaves[lid], node), lid)):
        dy = contiguous(dy_lid, _offsets(v, dy_lid), d)
        for mode in ROPE_MODES:
            if d % rope_divisor(mode):
                continue
            tables = _read_tables(v, mode, dy)
            if tables is None or dy_lid in (tables[0][0], tables[1][0]):
                continue
            cos, sin = tables
            for signs in TABLE_SIGNS:
                if _equals_expected_dx(v, mode, d, dy, cos, sin, signs):
                    return RopeMatch(mode, node, dy, cos, sin, signs=signs)
    return None


def _can_be_dy(ev: LaneEvaluator, leaf: fx.Node, dx: fx.Node) -> bool:
    return ev.depends_on_gradient(leaf) and same_shape(shape(leaf)[:-1], shape(dx)[:-1])


def match_table(ev: LaneEvaluator, node: fx.Node, site: RopeMatch, which: str) -> Optional[Role]:
    """x's role when ``node`` is the site's dcos (``which="cos"``) or dsin, else None."""
    v = ev.memo.get(node)
    d = site_width(ev, site)
    if v is None or v.inner != (d,) or any(len(p) != 1 for p in position_forms(v)):
        return None
    mono = next(iter(v.poly_at(0)))
    if len(mono) != 2:
        return None
    others = [var for var in mono if var != (site.dy[0], site.dy[1][0])]
    if len(others) != 1:
        return None
    x_lid = others[0][0]
    if x_lid in (site.cos[0], site.sin[0]):  # dy * cos is part of dx, not dcos
        return None
    runs = table_runs(site.mode, d, which) if v.pieces is not None else None
    if runs is not None:  # read and compared once a run of positions: the same x, the same verdict
        read = lane_pieces.read_partners(v.pieces, runs, site.dy, ("x",), d, squares=False)
        if read is None or read[0]["x"][0] != x_lid:
            return None
        x = read[0]["x"]
        equal = lane_pieces.equals_formula(v.pieces, runs, site.dy, {"x": x}, lambda c, _: c)
        if equal is None:  # x not read along runs: compared position by position
            equal = _polys_equal(v.polys, expected_table(site.mode, d, which, site.dy, x))
        return x if equal and _is_reduced_table(ev, node, v, site, which) else None
    # which x position each lane reads (mode 3's tables read x de-interleaved, and a
    # partitioner may save that de-interleaved copy instead of x)
    positions = [None] * d
    for poly, (_, xp), i in zip(v.polys, table_terms(site.mode, d, which), range(d)):
        (mono,) = poly
        other = [var for var in mono if var != (site.dy[0], site.dy[1][i])]
        if len(other) != 1 or other[0][0] != x_lid or positions[xp] not in (None, other[0][1]):
            return None
        positions[xp] = other[0][1]
    if None in positions:
        return None
    x = (x_lid, tuple(positions))
    if not _polys_equal(v.polys, expected_table(site.mode, d, which, site.dy, x)):
        return None
    return x if _is_reduced_table(ev, node, v, site, which) else None


def _is_reduced_table(ev: LaneEvaluator, node: fx.Node, v: Lanes, site: RopeMatch, which: str) -> bool:
    table = ev.leaves[(site.cos if which == "cos" else site.sin)[0]]
    return _reduces_to(node, v, ev.leaves[site.dy[0]], table)


@functools.lru_cache(maxsize=256)
def table_runs(mode: int, d: int, which: str):
    """:func:`table_terms` as runs of positions: position i pairs dy's index i with x's, or None."""
    return lane_pieces.term_runs(tuple(((c, i, "x", xp),) for i, (c, xp) in enumerate(table_terms(mode, d, which))))


def site_width(ev: LaneEvaluator, site: RopeMatch) -> int:
    return ev.memo[site.dx].inner[0]


def _reduces_to(node: fx.Node, v: Lanes, dy_node: fx.Node, table: fx.Node) -> bool:
    """The node's shape is the table's, and it sums exactly over the axes the table was broadcast on."""
    out, table_shape, dy_shape = shape(node), shape(table), shape(dy_node)
    if not same_shape(out, table_shape):
        return False
    if v.reduction is None:
        return same_shape(out, dy_shape)
    summand, dims, keepdim = v.reduction
    s = shape(summand)
    if not same_shape(s, dy_shape):
        return False
    kept = [1 if i in dims else size for i, size in enumerate(s)]
    padded = (1,) * (len(s) - len(table_shape)) + tuple(table_shape)
    return same_shape(kept, padded)


# -- the pass -----------------------------------------------------------------

def _candidates(graph: fx.Graph):
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        s, dt = shape(node), dtype(node)
        if not s or dt is None or not dt.is_floating_point:
            continue
        d = static_int(s[-1])
        if d is not None and 2 <= d <= MAX_LANES:
            yield node


def _symbolic_last_axis(ev: LaneEvaluator, seeds) -> List[Miss]:
    """Record the RoPE sites that a symbolic head dim keeps from fusing.

    Gradients moved along a symbolic last axis and summed with a rotation's terms, as a RoPE dx
    is (``dy * cos`` plus a move of ``dy * sin``), or multiplied as complex pairs (``freqs_cis``):
    the match is proved position by position, which needs a static head dim, so such a site
    cannot fuse; say so rather than leave it unexplained. A difference or a shift of a gradient
    (its moves summed with no product) is no RoPE."""
    sums = rotation_sums([s for s in seeds if ev.depends_on_gradient(s)], _sums_dx_terms)
    return [Miss(OP.name, n.name, "gradients moved along a symbolic last axis, as a RoPE dx does: the pass "
                             "proves RoPE per position of a static head dim, and this one was marked dynamic "
                             "(mark_dynamic) or compiled where no guard can fix it: keep the head dim static")
            for n in sums]


#: uses from an element move to the sum of a rotation (slice, neg, stack, flatten view, multiply, add)
ROTATION_SUM_REACH = 4


def rotation_sums(seeds, is_rotation_sum, symbolic_only: bool = True) -> List[fx.Node]:
    """The outermost rotation-shaped sums near an element move along a symbolic last axis.

    Each is a node ``is_rotation_sum`` accepts within :data:`ROTATION_SUM_REACH` uses of a seed
    (an element move): rotations no rule can prove, forward (:mod:`.rope_forward`) or backward.
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


def symbolic_head_dims(graph: fx.Graph, gradient: bool, is_rotation_sum) -> list:
    """The symbolic last-axis sizes of the element moves (of gradients, or of forward values)
    that a rotation-shaped sum reads: the head dims a RoPE rule needs static."""
    moved = gradient_dependent(graph) or set()
    seeds = [n for n in graph.nodes if _moves_elements(n) and (n in moved) == gradient]
    return [shape(seed)[-1] for seed in rotation_seeds(seeds, is_rotation_sum).values()]


def _sums_dx_terms(node: fx.Node) -> bool:
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
    """Whether an element move (:func:`_moves_elements`) moves along its input's last axis."""
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


def _looks_like_dx(v: Optional[Lanes]) -> bool:
    """Two products of two leaf elements per position, one leaf read at two positions
    (a rotation): the shape of a RoPE dx. Softmax's backward has two products but no
    rotation."""
    if not (v is not None and v.reduction is None and len(v.inner) == 1 and v.inner[0] >= 2 and v.inner[0] % 2 == 0):
        return False
    for p in position_forms(v):
        if len(p) != 2:
            return False
        for m in p:
            if len(m) != 2:
                return False
    a, b = v.poly_at(0)
    return any(l1 == l2 and p1 != p2 for l1, p1 in a for l2, p2 in b)


def _looks_like_table(v: Optional[Lanes]) -> bool:
    """One product of two leaf elements per position: a dcos/dsin summand."""
    if v is None or len(v.inner) != 1 or v.inner[0] < 2:
        return False
    for p in position_forms(v):
        if len(p) != 1:
            return False
        for m in p:
            if len(m) != 2:
                return False
    return True


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


def _moves_elements(node: fx.Node) -> bool:
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


def find_sites(graph: fx.Graph, rewrites: RuleContext) -> RoundReport:
    """This round's RoPE backward sites of the graph (each match with its evaluator), near
    misses and pending candidates; an internal error while examining one candidate is a miss
    in ``rewrites``."""
    ev = lane_evaluator(rewrites.provenance)
    ev.gradient_nodes = gradient_dependent(graph)
    seeds = [n for n in graph.nodes if _moves_elements(n)]
    near = set(downstream(graph, seeds, DX_DEPTH))
    nodes = [n for n in _candidates(graph) if n in near]
    for node in nodes:
        ev.value(node)
    # a forward value recomputed in the backward (checkpointing) can look like a dx: it is none
    looks = [n for n in nodes if ev.depends_on_gradient(n) and _looks_like_dx(ev.memo.get(n))]
    matches, inside = _dx_matches(rewrites, ev, looks)
    matches += _accumulated_matches(rewrites, ev, nodes, {m.dx for m in matches} | inside, inside)
    _match_table_gradients(rewrites.examine, ev, graph, matches)
    misses, pending = _near_misses(rewrites, ev, looks, matches, inside)
    rewrites.evaluated(ev)
    return RoundReport(matches, misses + _symbolic_last_axis(ev, seeds), pending)


def _dx_matches(rewrites: RuleContext, ev: LaneEvaluator, looks: List[fx.Node]):
    """The outermost dx matches among the dx-shaped nodes, and the nodes inside them."""
    matches = [m for m in (rewrites.examine(n, match_dx, ev, n) for n in looks) if m is not None]
    matches = outermost(matches, node=lambda m: m.dx, same=lambda a, b: a.key == b.key)
    # a match inside another's subgraph (mode 0 on DeepSeek's de-interleaved q, under
    # the mode 3 match of the whole) is part of the larger rewrite
    inside = set()
    for m in matches:
        roles = {ev.leaves[r[0]] for r in (m.dy, m.cos, m.sin)}
        inside.update(n for n in region_of([m.dx], lambda n: n in ev.interpreted and n not in roles)
                      if n is not m.dx)
    matches = [m for m in matches if m.dx not in inside]
    for m in matches:
        m.ev = ev
    return matches, inside


def _accumulated_matches(rewrites: RuleContext, ev: LaneEvaluator, nodes, matched: set, inside: set):
    """The sites whose dx autograd sums with other gradients of x in one accumulation.

    Sites whose dx autograd sums with other gradients of x in one accumulation (``rope(q) * q``:
    dx plus ``dy * rope(q)``; two rotations of one q: one dx plus the other): the root of a
    tree of single-use adds whose summands, all but one, sum to a RoPE dx. The one left out is
    added back to the fused dx (:attr:`RopeMatch.rest`); each is its own site."""
    found = []
    for root in nodes:
        if root in matched or root.target is not aten.add.Tensor or not ev.depends_on_gradient(root) or any(
                u.target is aten.add.Tensor and len(root.users) == 1 for u in root.users):
            continue
        summands, _ = gradient_accumulation(root, matched)
        values = [ev.memo.get(n) if isinstance(n, fx.Node) else None for n in summands]
        if len(summands) < 3 or ev.memo.get(root) is None or any(
                v is None or v.reduction is not None or v.complex or v.inner != ev.memo[root].inner for v in values):
            continue
        # a dx matched this round is summed here too (two rotations of one x): it is the rest
        done = [n for n in summands if n in matched]
        for rest in done if len(done) == 1 else () if done else summands:
            site = rewrites.examine(root, _match_without, ev, root, summands, values, rest)
            if site is not None:
                site.ev, site.rest = ev, [rest]
                inside.update(n for n in _region(site, {"dx": root}) if n is not root)
                found.append(site)
                break
    return found


def _match_without(ev: LaneEvaluator, root: fx.Node, summands, values, rest) -> Optional[RopeMatch]:
    """A match at ``root`` when its summands but ``rest`` sum to a RoPE dx."""
    polys = [{} for _ in values[0].polys]
    try:
        for part, v in zip(summands, values):
            if part is not rest:
                polys = [add_polys(a, b) for a, b in zip(polys, v.polys)]
    except Unsupported:  # more terms than any dx has
        return None
    return match_dx(ev, root, Lanes(values[0].inner, polys))


def _match_table_gradients(examine, ev: LaneEvaluator, graph: fx.Graph, matches) -> None:
    """Set each match's dcos, dsin and x where the graph computes them: products with its dy,
    reduced, a few uses after dy."""
    dys = [ev.leaves[m.dy[0]] for m in matches]
    table_nodes = [n for n in downstream(graph, dys, 4) if n.op == "call_function"] if dys else []
    tables_by_leaf: Dict[int, List[fx.Node]] = {}
    for node in table_nodes:
        ev.value(node)
        v = ev.memo.get(node)
        if _looks_like_table(v):
            for lid in {var[0] for var in next(iter(v.poly_at(0)))}:
                tables_by_leaf.setdefault(lid, []).append(node)
    for site in matches:
        if not all(r[1] == tuple(range(static_int(shape(ev.leaves[r[0]])[-1]))) for r in (site.cos, site.sin)):
            continue  # dcos/dsin are grads of whole tables; rebuilt tables have none in the graph
        if site.signs != (1, 1):
            continue  # the graph's table gradients are of the leaves, not of the negated tables
        _choose_table_gradients(examine, ev, site, tables_by_leaf.get(site.dy[0], ()))


def _choose_table_gradients(examine, ev: LaneEvaluator, site: RopeMatch, candidates) -> None:
    """``examine(node, fn, *args)`` runs ``fn(*args)`` for the candidate ``node``."""
    tables: Dict[str, List[Tuple[fx.Node, Role]]] = {"cos": [], "sin": []}
    for node in candidates:
        for which in ("cos", "sin"):
            x = examine(node, match_table, ev, node, site, which)
            if x is not None:
                tables[which].append((node, x))
    for which, found in tables.items():
        tables[which] = outermost(found, node=lambda f: f[0])
    # Any product dy * T matches dcos for *some* x (all signs are +1), so dcos and dsin
    # are chosen together: the pair that reads the same x.
    pairs = [(c, s) for c in tables["cos"] for s in tables["sin"] if c[1] == s[1]]
    if len(pairs) == 1:
        (site.dcos, site.x), (site.dsin, _) = pairs[0]
    elif not pairs and len(tables["cos"]) + len(tables["sin"]) == 1:
        (node, site.x), which = (tables["cos"] or tables["sin"])[0], "cos" if tables["cos"] else "sin"
        setattr(site, "d" + which, node)


def _near_misses(rewrites: RuleContext, ev: LaneEvaluator, looks, matches, inside) -> Tuple[List[Miss], int]:
    """dx-shaped nodes that are neither a match, inside one, nor built on one (misses), and how
    many are built on one (pending: decided next round, once the site below is fused). A
    failure while reading one node is a miss at that node."""
    matched = {m.dx for m in matches} | inside
    outputs = {n for m in matches for n in (m.dx, m.dcos, m.dsin) if n is not None}

    def built_on_match(n):  # e.g. q's dsin plus k's dsin: two products per element, legitimately
        region = region_of([n], lambda r: r is n or (r in ev.interpreted and r not in outputs))
        return any(a in outputs for r in region for a in r.all_input_nodes)

    verdicts = {n: rewrites.examine(n, built_on_match, n) for n in looks if n not in matched}
    built_on = [n for n, built in verdicts.items() if built is True]
    unmatched = [n for n, built in verdicts.items() if built is False]
    misses = []
    for n in outermost(unmatched):
        misses.append(Miss(OP.name, n.name, "two products per element like a RoPE dx, but no mode's formula "
                                            "(signs, split points or tables differ)"))
        rewrites.context.judgements.defer(misses[-1], _table_keys(ev, n))
    return misses, len(built_on)


def _table_keys(ev: LaneEvaluator, node: fx.Node) -> List[tuple]:
    """The site keys of the rotations ``node`` may be the backward of: each pair of the forward values
    (no gradient) its products read, as :func:`~.pairing.site_key` names a rotation's cos and sin."""
    v = ev.memo.get(node)
    tables = {source(ev.leaves[lid]) for poly in (v.polys if v is not None else ()) for mono in poly
              for lid, _ in mono if not ev.depends_on_gradient(ev.leaves[lid])}
    return [(ROTATION_SITE, a, b) for a in tables for b in tables]


def find_again(rewrites: RuleContext, site: RopeMatch, leaves: List[fx.Node]) -> Optional[RopeMatch]:
    """``site`` matched again with ``leaves`` as leaves, in the same mode and with every table
    gradient it had (the new evaluator and its leaf numbering belong to this site only); None
    when it no longer matches so. Reads only the site's dx and the products near its dy."""
    ev = lane_evaluator(rewrites.provenance, leaves)
    ev.gradient_nodes = gradient_dependent(rewrites.graph)
    ev.value(site.dx)
    again = match_dx(ev, site.dx)
    if again is None or again.mode != site.mode:
        return None
    again.ev = ev
    _match_table_gradients(lambda node, fn, *args: fn(*args), ev, rewrites.graph, [again])
    rewrites.raise_if_strict(ev)
    return again if _keeps_tables(site, again) else None


#: forward ops a rotary table comes from
ROTARY_SOURCES = {aten.cos.default, aten.sin.default, aten.polar.default}
#: ops that only shape a table on its way to a product (select positions, broadcast, cast,
#: repeat, concatenate, negate, scale): a value reached from cos/sin through other ops (the
#: residual stream after a RoPE'd attention) is an activation, not a table
TABLE_SHAPING = VIEWS | CAST_TARGETS | {
    aten.reshape.default, aten.index.Tensor, aten.index_select.default, aten.embedding.default,
    aten.cat.default, aten.stack.default, aten.repeat_interleave.self_int, aten.repeat.default,
    aten.neg.default, aten.mul.Scalar, aten.view_as_complex.default, aten.view_as_real.default,
    aten._conj.default, aten.resolve_conj.default, aten.flatten.using_ints, aten.unflatten.int,
}
#: how far above a product to look for them (through saved tensors' forward definitions)
TABLE_SEARCH_DEPTH = 12


def _table_inputs(node: fx.Node) -> List[fx.Node]:
    """The inputs a table-shaping op passes its table on from; none for any other op. A product
    by a constant (``cos * attention_scaling``) shapes; a product of two tensors does not."""
    if node.target is aten.mul.Tensor:
        tensors = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        return tensors if len(tensors) == 1 else []
    if node.target not in TABLE_SHAPING:
        return []
    first = node.args[0] if node.args else None
    if isinstance(first, (list, tuple)):  # cat, stack
        return [a for a in first if isinstance(a, fx.Node)]
    return [first] if isinstance(first, fx.Node) else []


def _is_rotary_table(node: fx.Node, provenance: Optional[Provenance]) -> bool:
    frontier, seen = [node], {node}
    for _ in range(TABLE_SEARCH_DEPTH):
        above = []
        for n in frontier:
            if n.op == "placeholder":
                n = provenance.forward_definition(n) if provenance is not None else None
                if n is None:
                    continue
            if n.op != "call_function":
                continue
            if n.target in ROTARY_SOURCES:
                return True
            above += [a for a in _table_inputs(n) if a not in seen]
        seen.update(above)
        frontier = above
    return False


def unexplained(graph: fx.Graph, provenance: Optional[Provenance], misses: List[Miss]) -> List[Miss]:
    """Record each RoPE the pass left in the graph that no form matched and no miss explains.

    No silent misses: a gradient multiplied by a rotary table (a forward value shaped from
    cos, sin or a complex polar by views, casts, repeats and concatenation) that is left in the
    graph after the pass, and that no recorded miss accounts for, is a RoPE application no form
    matched. Each connected group of such products becomes a miss naming where the lane
    evaluator stopped, the nearest difference."""
    gradient = gradient_dependent(graph)
    if gradient is None:
        return []
    anchors = [n for n in graph.nodes if _table_product(n, gradient, provenance)]
    missed = {m.node for m in misses}
    groups: List[Tuple[fx.Node, set]] = []
    for anchor in anchors:
        reach = set(downstream(graph, [anchor], DX_DEPTH))
        # a recorded miss's dx may end a few views further (mode 3's re-interleave)
        if any(n.name in missed for n in downstream(graph, [anchor], 2 * DX_DEPTH)):
            continue
        group = next((g for g in groups if g[1] & reach), None)
        if group is None:
            groups.append((anchor, reach))
        else:
            group[1].update(reach)
    ev = lane_evaluator(provenance)
    ev.gradient_nodes = gradient
    return [Miss(OP.name, anchor.name, "a gradient multiplied by a rotary table (cos/sin/polar in the forward) "
                                  "that no RoPE form matched; " + _nearest_difference(ev, graph, anchor))
            for anchor, _ in groups]


def _table_product(node: fx.Node, gradient: set, provenance) -> bool:
    product = gradient_product(node, gradient)
    return product is not None and _is_rotary_table(product[1], provenance) \
        and not _is_fused_table_gradient(product[0])


def _is_fused_table_gradient(node: fx.Node) -> bool:
    """A fused op's dcos or dsin (through casts and views): times a table it is the chain rule
    into the angles the tables were computed from (``cos(freqs)``), not a RoPE application."""
    while node.op == "call_function" and (is_float_cast(node) or node.target in VIEWS):
        node = node.args[0]
    return (node.op == "call_function" and node.target is operator.getitem and node.args[1] in (1, 2)
            and getattr(node.args[0], "target", None) is OP.overload)


def _nearest_difference(ev: LaneEvaluator, graph: fx.Graph, anchor: fx.Node) -> str:
    nodes = downstream(graph, [anchor], DX_DEPTH)
    for node in nodes:
        ev.value(node)
    for node in nodes:
        if node in ev.unsupported:
            return f"the lane evaluator stopped at {node.name} ({node.target}): {ev.unsupported[node]}"
    return f"the products after {anchor.name} read as no mode's formula"


def _role_node(edit: Edit, leaf: fx.Node, positions: Tuple[int, ...]) -> fx.Node:
    """A tensor holding the role's positions, built from its leaf.

    Contiguous positions are a slice (partial rotary); ``a + s*(i//2)`` is a strided
    slice repeated element-wise (the real or imaginary parts of a complex table);
    ``a + i % (D/2)`` is a half-width table concatenated with itself.
    """
    base = leaf
    if dtype(leaf).is_complex:  # positions index the real view, (re, im) interleaved
        # a saved ``freqs.conj()`` is a lazily conjugated view, which view_as_real refuses
        base = edit.call(aten.resolve_conj.default, (leaf,))
        base = edit.call(aten.view_as_real.default, (base,))
        base = edit.call(aten.flatten.using_ints, (base, -2, -1))
    full, width, first = static_int(shape(base)[-1]), len(positions), positions[0]
    half = width // 2
    if positions == tuple(range(first, first + width)):
        if first == 0 and width == full:
            return base
        return edit.call(aten.slice.Tensor, (base, -1, first, first + width))
    for step in (1, 2):
        if positions == tuple(first + step * (i // 2) for i in range(width)):
            part = edit.call(aten.slice.Tensor, (base, -1, first, first + step * half, step))
            return edit.call(aten.repeat_interleave.self_int, (part, 2, -1))
    if sorted(positions) == list(range(min(positions), min(positions) + width)) and positions == tuple(
            min(positions) + i // 2 + (i % 2) * half for i in range(width)):
        # x re-interleaved from a de-interleaved copy: pairs (xd[j], xd[j + D/2])
        lo = min(positions)
        first_half = edit.call(aten.slice.Tensor, (base, -1, lo, lo + half))
        second_half = edit.call(aten.slice.Tensor, (base, -1, lo + half, lo + width))
        pairs = edit.call(aten.stack.default, ([first_half, second_half], -1))
        return edit.call(aten.flatten.using_ints, (pairs, -2, -1))
    if positions == tuple(first + i % half for i in range(width)):
        part = edit.call(aten.slice.Tensor, (base, -1, first, first + half))
        return edit.call(aten.cat.default, ([part, part], -1))
    raise TableLayoutError(f"table {leaf.name} is read in an order the pass cannot rebuild")


class TableLayoutError(Exception):
    pass


def _region(site: RopeMatch, outputs) -> List[fx.Node]:
    """The interpreted nodes between the site's outputs and its role leaves (not the other
    gradients summed with dx)."""
    ev = site.ev
    roles = {ev.leaves[r[0]] for r in (site.dy, site.cos, site.sin, site.x) if r is not None} | set(site.rest)
    return region_of(outputs.values(), lambda n: n in ev.interpreted and n not in roles
                     and ev.depends_on_gradient(n))


def _outputs(site: RopeMatch) -> Dict[str, fx.Node]:
    return {k: n for k, n in (("dx", site.dx), ("dcos", site.dcos), ("dsin", site.dsin)) if n is not None}


def _keeps_tables(first: RopeMatch, again: RopeMatch) -> bool:
    """The match found again keeps every table gradient the first one had."""
    return all(getattr(first, t) is None or getattr(first, t) is getattr(again, t) for t in ("dcos", "dsin"))


def emit(rewrites: RuleContext, site: RopeMatch, outputs, region):
    """The site rewritten into one fused call (a :class:`Site`), or a :class:`Miss` saying why not."""
    graph, edit, ev, target = rewrites.graph, rewrites.edit, site.ev, rewrites.target
    dy_leaf, cos_leaf, sin_leaf = (rewrites.current(ev.leaves[r[0]]) for r in (site.dy, site.cos, site.sin))
    x_leaf = rewrites.current(ev.leaves[site.x[0]]) if site.x is not None else None
    leaves = [dy_leaf, cos_leaf, sin_leaf, x_leaf]
    if not same_shape(shape(dy_leaf)[:-1], shape(site.dx)[:-1]):
        return Miss(OP.name, site.dx.name, f"dy {dy_leaf.name} is broadcast to dx's shape")
    if not same_shape(shape(cos_leaf)[:-1], shape(sin_leaf)[:-1]):
        return Miss(OP.name, site.dx.name, f"cos {list(shape(cos_leaf))} and sin {list(shape(sin_leaf))} "
                                           f"have different shapes")
    with Insertion(graph, last_of(graph, [n for n in leaves if n is not None])) as inserted:
        try:
            operands = _operands(edit, site, leaves, outputs)
        except TableLayoutError as exc:
            return Miss(OP.name, site.dx.name, str(exc))
        dy, cos, sin, x = operands
        rounding = rounding_problem(ev, outputs, leaves)
        layout = rope_layout_problem(target, site.mode, shape(dy), shape(cos), x is not None, dtype(dy))
        # the rotation's verdict binds its forward: its roundings, and what the target refuses of the
        # rotation itself (not the limits A2/A3 add for the table gradients, which no forward computes)
        rotation = layout if x is None or layout is None else rope_layout_problem(
            target, site.mode, shape(dy), shape(cos), False, dtype(dy))
        rewrites.context.judgements.record(site_key(ROTATION_SITE, cos_leaf, sin_leaf), rounding or rotation)
        problem = rounding or layout  # in the forward rule's order: one reason for the rotation
        if problem is None and x is not None and not same_shape(shape(x), shape(dy)):
            problem = f"x {list(shape(x))} and dy {list(shape(dy))} have different shapes"
        if problem is not None:
            return Miss(OP.name, site.dx.name, problem)
        emitted = emit_fused_op(rewrites, OP, site.dx, (dy, cos, sin, x, site.mode), outputs)
        if isinstance(emitted, Miss):
            return emitted
    fused, replacements = emitted
    added = inserted.nodes()
    if site.rest:
        added += add_back_accumulated(edit, site, replacements)
    return commit(edit, OP.name, ROPE_MODES[site.mode], region, outputs, replacements,
                  {"dy": dy_leaf, "cos": cos_leaf, "sin": sin_leaf, "x": x_leaf}, added, fused)


def _operands(edit: Edit, site: RopeMatch, leaves, outputs) -> list:
    """Build dy, cos, sin and x for the fused op from the site's role leaves.

    Tables are negated where the site's table is the leaf negated and widened to dy's number of
    axes (as the forward rule widens them); all four are cast to the narrowest dtype that holds
    them exactly and every output's :func:`kept_precision` (the op returns its outputs in dy's dtype, which must
    not round them more coarsely than the program does before its own next rounding)."""
    roles = (site.dy, site.cos, site.sin, site.x)
    operands = [_role_node(edit, leaf, role[1]) if role is not None else None
                for leaf, role in zip(leaves, roles)]
    for i, sign in ((1, site.signs[0]), (2, site.signs[1])):
        if sign < 0:
            operands[i] = edit.call(aten.neg.default, (operands[i],))
    compute = exact_common_dtype([*(dtype(n) for n in operands if n is not None),
                                  *(kept_precision(o) for o in outputs.values())])
    # the tables right-aligned to dy's rank, as the forward rule calls its op (A2/A3 take 4-D tables
    # only: a [S, D] table is 11SD to both rules); dcos and dsin come back in the program's shapes
    rank = len(shape(operands[0]))
    operands[1:3] = [permuted(edit, n, list(range(rank))) for n in operands[1:3]]
    return [edit.cast(n, compute) if n is not None else None for n in operands]


class RopeGradRule(FusionRule):
    """RoPE's backward, matched by value in per-position polynomials (:mod:`.lanes`), rewritten
    into ``rotary_position_embedding_grad`` with the table gradients the graph computes."""

    stage = "backward"
    domain = "lanes"
    ops = (OP,)
    site_probe = SiteProbe(kind=OP.option, per_output=True,
                           functions=r"^_?apply_.*rot|^_?apply_.*rope|rotary_pos_emb$|^rotary_emb$",
                           excluded=r"vision|_2d|multidimensional|time_emb", module_classes=r"(?i)Rotary|RoPE")
    forms = tuple(Form(*row) for row in (
        ("mode 0 half: `rotate_half`", "HF `apply_rotary_pos_emb` (Llama, Qwen2/3, Mistral, Gemma, ...)"),
        ("mode 1 interleave: strided slices + stack + flatten", "GPT-J `rotate_every_two`, Cohere"),
        ("mode 1 interleave: complex `view_as_complex(x) * freqs_cis`", "Llama 4, DeepSeek-V2"),
        ("mode 2 quarter: four chunks", "targets `950`, `generic`"),
        ("mode 3 interleave-half: de-interleave then `rotate_half`", "DeepSeek-V3 (`view`/`transpose` or even/odd slices)"),
        ("partial rotary (`rotary_dim < head_dim`)", "GPT-NeoX `rotary_pct`, GPT-J `rotary_dim`, `partial_rotary_factor`"),
        ("half-width or complex tables rebuilt to full width", "`x1*cos - x2*sin` spellings, `freqs_cis`"),
        ("layouts BNSD, BSND, SBND, TND; cos/sin 11SD, B1SD, BNSD, 1S1D, BS1D, BSND, S11D, SB1D, T1D, TND, [S, D]", "`unsqueeze_dim=1/2`, packed sequences"),
        ("cos/sin requiring grad: x passed, dcos/dsin wired", "learned or scaled tables; q and k sharing them"),
        ("output scaled by a constant before use", "`q * scale`, SDPA's math path"),
        ("a dy that is itself computed: output used elementwise, scaled per position, also when the rotation's backward reads it in pieces (halves, pair lanes)", "`q_rot . k_rot`, `q.square()`, Llama 4's L2 qk-norm, Ministral 3's q scaling, torchtune RoPE then `exp`"),
        ("dx summed in one accumulation with other gradients of x (x read again after the rotation, `rope(q) * q`, `rope(q) + q`; two rotations of one x), those added back", "adversarial programs (`tests/test_no_silent_misses.py`)"),
        ("a table negated as a whole (`cat(x2, -x1)`: mode 0 with sin negated)", "nanochat"),
        ("`[S, D]` and `[S, D/2]` tables on A2/A3, widened to 11SD as the forward widens them", "GPT-J-style interleave with half-width tables"),
        ("RoPE applied twice (the outer rotation built on the inner fused one)", "adversarial programs (`tests/test_spellings.py`)"),
        ("mode 1 interleave: `stack` of `x[..., 0]`/`x[..., 1]` products with a `[S, D/2, 2]` cache (`select_backward`)", "torchtune `RotaryPositionalEmbeddings`, `Llama3ScaledRoPE`"),
        ("`[S, B, H, D]` with tables computed from `freqs` in the graph, half or interleaved (`stack((-x2, x1), -1)`)", "Megatron-core `_apply_rotary_pos_emb_bshd`"),
        ("one rotated head expanded over the heads, or GQA's k expanded after RoPE (dy a sum over the copies)", "torchtitan DeepSeek-V3 MLA `k_pe`, torchtune GQA, DeepSeek-V2"),
        ("one table saved several times (copies of one forward expression are one value)", "torchtune's `cache[..., 0]` in two products"),
        ("complex tables broadcast head-first (`freqs_cis[None, None, :T]` on `[B, H, T, D]`), under either partitioner", "torchtitan `ComplexRoPE`"),
        ("autocast: a bf16 or fp16 x with float32 tables, GQA's k expanded while float32 (each term rounded to dk's dtype)", "Hugging Face Trainer `bf16=True`, `torch.autocast` training"),
        ("inside training graphs: activation checkpointing (full, selective), compiled autograd, DDP, FSDP2", "torchtitan, transformers' `gradient_checkpointing_enable`"),
    ))

    def find(self, graph: fx.Graph, ctx: RuleContext) -> RoundReport:
        return find_sites(graph, ctx)

    def static_sizes(self, graph: fx.Graph) -> list:
        return symbolic_head_dims(graph, True, _sums_dx_terms)

    def outputs(self, match: RopeMatch) -> Dict[str, fx.Node]:
        return _outputs(match)

    def region(self, match: RopeMatch, outputs) -> List[fx.Node]:
        return _region(match, outputs)

    def find_again(self, ctx: RuleContext, match: RopeMatch, leaves) -> Optional[RopeMatch]:
        return find_again(ctx, match, leaves)

    def emit(self, ctx: RuleContext, match: RopeMatch):
        match.rest = [ctx.current(n) for n in match.rest]
        # the shared value may be a role now (a slice of a wide dy that dcos and dsin read
        # too): the match found again may see table gradients the first could not
        resolved = self.resolve_shared(ctx, match, _outputs(match), refreshed_outputs=True)
        return resolved if isinstance(resolved, Miss) else emit(ctx, *resolved)

    def unexplained(self, graph: fx.Graph, ctx: RuleContext, misses) -> List[Miss]:
        return unexplained(graph, ctx.provenance, misses)
