"""RoPE forward sites on the joint graph: candidates, the rotations no site covers, and near misses."""
from __future__ import annotations

import weakref
from typing import List, Optional

import torch.fx as fx

from ...compat import is_erased
from ...lowering import ROPE as OP
from ...lowering.sizes import static_int
from ..evaluator import JointProvenance
from ..lanes import COMPLEX_VIEWS, CONJ_TARGETS, LaneEvaluator
from ..lane_polys import position_forms
from ..nodes import (CAST_TARGETS, VIEWS, GradientNodes, aten, downstream, dtype, gradient_dependent, is_float_cast,
                     outermost, region_of, shape)
from ..rewrite import Miss, RuleContext
from ..pairing import source
from ..rotation import (DX_DEPTH, MAX_LANES, head_dim_mark, element_moves, lane_evaluator, moves_elements, rotation_sums,
                        symbolic_head_dim_reason, unscaled, varying_product)
from ..rule import RoundReport
from .match import ForwardRopeMatch, looks_like_y, site_region, match_y


#: the lane evaluator's views: a view that reshapes the tracked axes
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int,
            aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims}


#: the ops whose outputs the lane evaluator reads through their ``getitem`` (Megatron's
#: ``torch.split(mixed_qkv, ...)``): the views before them are near the rotation too
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}


def _axis_makers(ev: LaneEvaluator, looks, covering: bool = True) -> set:
    """The views that give a rotation a second tracked axis, to be read as leaves.

    The views that give a rotation a second tracked axis, from a value tracked over one:
    BSND's tables ``cos[:, None]`` ([S, 1, D], tracked as (1, D); the product with an x of
    [B, S, N, D] is then no value at all) and, for a rotation-shaped value over several axes,
    ``proj.view(B, S, N, D)`` of a projection N*D wide (tracked as (N, D)). Read as leaves
    (always sound: a leaf is its own value), the rotation is one of the last axis again. A
    view the formula reads through (DeepSeek's interleave-half ``view(..., D/2, 2)``) is none
    of these and stays read, as does a value over several axes that a rotation-shaped value of
    one axis reads (the complex product's ``view_as_real``, torchtune's ``stack``, before their
    ``flatten``): that one is the candidate, matched or a near miss as it is. Without ``covering``
    such a value is read as leaves too (the rule tries it where the value over one axis matched no
    mode, and keeps it where more rotations match: a rotation of N heads flattened after it)."""
    flat = [y for y in looks if len(ev.memo[y].inner) == 1 and covering]
    covered = set(region_of(flat, lambda r: r in ev.interpreted))
    spanning = [y for y in looks if len(ev.memo[y].inner) > 1 and y not in covered]
    near = {n for y in spanning for n in region_of([y], lambda r: r in ev.interpreted or r.target in SPLITS)}
    makers = set()
    for n in (n for n in ev.interpreted if n.target in RESHAPES and isinstance(n.args[0], fx.Node)):
        v, source = ev.memo.get(n), ev.memo.get(n.args[0])
        if v is None or len(v.inner) < 2 or (source is not None and len(source.inner) > 1):
            continue
        if n in near or static_int(shape(n)[-2]) == 1:
            makers.add(n)
    return makers | _complex_pair_sources(ev)


def _complex_pair_sources(ev: LaneEvaluator) -> set:
    """The sources of complex-pair rotations whose x is a projection's view into heads.

    Llama 4's and torchtitan's ``view_as_complex(q.reshape(..., D/2, 2)) * freqs_cis`` with q
    a projection's view into heads: x tracked over (N, D/2, 2) times a table over (D/2, 2) is a
    refused broadcast, and nothing downstream looks like a rotation. The node whose pairs are
    taken (q, past its float casts) is read as a leaf, over its last axis."""
    sources = set()
    for product in (n for n, why in ev.unsupported.items() if why == "broadcast" and _complex_node(n)):
        for operand in product.all_input_nodes:
            pairs = operand.args[0] if operand.target is aten.view_as_complex.default else None
            if not (isinstance(pairs, fx.Node) and pairs.target in RESHAPES):
                continue
            x = pairs.args[0]
            while isinstance(x, fx.Node) and is_float_cast(x):
                x = x.args[0]
            if isinstance(x, fx.Node) and ev.memo.get(x) is not None and len(ev.memo[x].inner) > 1:
                sources.add(x)
    return sources


def _complex_node(node: fx.Node) -> bool:
    return dtype(node) is not None and dtype(node).is_complex


#: deterministic ops that only pick, view or cast elements: two calls with the same arguments
#: hold the same value
SAME_VALUE_OPS = RESHAPES | {aten.select.int, aten.slice.Tensor, aten.expand.default, aten.alias.default,
                             aten._to_copy.default, aten.clone.default, aten.permute.default,
                             aten.transpose.int}


class _SameValues:
    """The forward's own values, where a leaf the program computes twice is one leaf.

    The forward's own values, with no saved tensors (the evaluator's provenance protocol), where
    a leaf the program computes twice is one leaf: torchtune writes ``rope_cache[..., 0]`` once
    per term, two ``select`` nodes of the same table, which must be the same cos to be a rotation."""

    def __init__(self):
        self._canonical = {}
        #: every node keyed so far (its key reads its arguments)
        self.keyed = set()

    def is_forward(self, node) -> bool:
        return False

    def saved_in_backward(self, node):
        return None

    def stands_for_saved(self, node) -> bool:
        return False

    def forward_definition(self, node):
        return node

    def same_saved_value(self, node: fx.Node) -> fx.Node:
        """The first node computing ``node``'s value by the same op on the same arguments."""
        if node.op != "call_function" or node.target not in SAME_VALUE_OPS:
            return node
        self.keyed.add(node)
        key = (node.target, tuple(self.same_saved_value(a) if isinstance(a, fx.Node) else _hashable(a)
                                  for a in node.args), _hashable(node.kwargs))
        return self._canonical.setdefault(key, node)


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value if isinstance(value, (int, float, bool, str, type(None))) else repr(value)


def _uncovered(ctx: RuleContext, ev: LaneEvaluator, looks) -> list:
    """The rotation-shaped nodes that no matched rotation over one axis computes, nor reads.

    A value over two
    axes inside one (torchtune's ``stack`` of the pairs, before its ``flatten``) needs no view
    read as a leaf, and reading x's ``view(..., D/2, 2)`` as one would hide the rotation."""
    matched = [y for y in looks if len(ev.memo[y].inner) == 1 and ctx.examine(y, match_y, ev, y) is not None]
    covered = {n for y in matched for n in region_of([y], lambda r: r in ev.interpreted)}
    outputs = set(matched)

    def built_on_match(y):  # a matched rotation scaled (``rope(q) * 2``) is no rotation left unmatched
        region = region_of([y], lambda r: r is y or (r in ev.interpreted and r not in outputs))
        return any(a in outputs for r in region for a in r.all_input_nodes)

    return [y for y in looks if y not in covered and not built_on_match(y)]


def _unshaped_rotations(ev: LaneEvaluator, seeds, gradient, looks) -> list:
    """Sums of rotation terms the evaluator read that are no rotation-shaped node nor inside one.

    They lie near a move of elements along the last axis (:func:`..rotation.rotation_sums`): where x is a
    product (a decomposed norm's ``normed * weight``, the norm left unfused), the evaluator cuts it
    into a different leaf at each term's reader, and the rotation reads no leaf twice."""
    inside = {n for y in looks for n in region_of([y], lambda r: r in ev.interpreted)}
    sums = rotation_sums(seeds, lambda u: u not in gradient and sums_rotation_terms(u), symbolic_only=False)
    return [n for n in sums if n in ev.interpreted and n not in inside]


#: ops that pass elements on unchanged (casts, views, slices, concatenations, negation)
PASSES_ON = CAST_TARGETS | VIEWS | RESHAPES | {aten.slice.Tensor, aten.select.int, aten.cat.default,
                                               aten.stack.default, aten.neg.default, aten.clone.default}


def _products_passed_on(ev: LaneEvaluator, unmatched, looks) -> set:
    """Products of tensors that a rotation no mode matched reads through casts or slices: x when
    it is a decomposed norm's ``normed * weight`` (torchtitan's Qwen3 in bf16, whose q/k norms stay
    decomposed). A product read by another product is cut to a leaf at its reader, so the term
    ``x * cos`` reads x's leaf while ``rotate_half(x) * sin`` reads the ``cat`` as one: read as a
    leaf where it is made (always sound), x is one leaf in both terms."""
    looks = set(looks)  # a rotation and what is computed from it are no x
    region = {n for y in unmatched for n in region_of([y], lambda r: r in ev.interpreted)}
    after = {n for n in region if any(a in looks for a in region_of([n], lambda r: r in region))}
    found = set()
    for n in (n for n in region - after if n.target not in PASSES_ON):  # where the product is made
        v = ev.memo.get(n)
        if v is not None and any(len(m) > 1 for p in position_forms(v) for m in p) and _moved_later(n):
            found.add(n)
    return found


def _moved_later(node: fx.Node) -> bool:
    """Whether ``node``'s elements reach, passed on unchanged, an op that moves them (the slices
    of ``rotate_half``): x, not a term of the rotation (``x * cos``, which a near miss may round)."""
    stack, seen = [u for u in node.users if u.target in PASSES_ON], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if moves_elements(n):
            return True
        stack.extend(u for u in n.users if u.target in PASSES_ON)
    return False


#: the ops whose value the lanes evaluator reads off their arguments; any other op is a leaf whatever
#: its arguments are (its value is its own, and its shape and dtype)
READS_ARGUMENTS = frozenset(LaneEvaluator.INTERPRETERS) | CAST_TARGETS | COMPLEX_VIEWS | CONJ_TARGETS


class _ForwardRead:
    """A joint graph's forward read near its element moves (the evaluator of :func:`_forward_nodes`, no leaf forced),
    kept while every node it read is as it was.

    Both RoPE rules read it each round (the backward rule for the tables of a site of table gradients
    alone, :func:`forward_rotations`; the forward rule first of all), and the rules between them rewrite
    other sites (a fused norm reads the projection the rotation reads as a leaf). A value depends only
    on the node's op, arguments and recorded value, and on its arguments' values; a leaf's only on its
    own recorded value (and, for a pick or a view, on what it picks from: :class:`_SameValues` keys it).
    So the read holds while the same nodes are asked for and every node it read is in the graph with
    the same recorded value and, where its value reads them, the same arguments: then a new read
    would compute the same values, leaves and errors."""

    def __init__(self, gradient: set, nodes: List[fx.Node], ev: LaneEvaluator):
        #: the round's gradient_dependent answer: a read is shared within one round only
        self.gradient = weakref.ref(gradient)
        self.nodes, self.ev = nodes, ev
        self.read = {n: (n.args, n.kwargs, n.meta.get("val")) for n in self._read_nodes()}

    def _read_nodes(self):
        return set(self.ev.memo) | set(self.ev.leaves) | self.ev.provenance.keyed

    def holds(self, gradient: set, nodes: List[fx.Node]) -> bool:
        if self.gradient() is not gradient or nodes != self.nodes or self._read_nodes() != set(self.read):
            return False
        for n, (args, kwargs, value) in self.read.items():
            if is_erased(n) or n.meta.get("val") is not value:
                return False
            reads_arguments = n.op == "call_function" and (n.target in READS_ARGUMENTS or n in self.ev.provenance.keyed)
            if reads_arguments and (n.args is not args or n.kwargs is not kwargs):
                return False
        return True


#: each joint graph's :class:`_ForwardRead` of the round (dropped with the graph, or by a later round's read)
_FORWARD_READS: "weakref.WeakKeyDictionary[fx.Graph, _ForwardRead]" = weakref.WeakKeyDictionary()


def _forward_nodes(graph: fx.Graph, gradient: set, seeds) -> List[fx.Node]:
    """The forward calls near the forward's element moves (``seeds``) whose last axis a rotation may have."""
    return [n for n in downstream(graph, seeds, DX_DEPTH) if n not in gradient and n.op == "call_function"
            and shape(n) and static_int(shape(n)[-1]) is not None and 2 <= static_int(shape(n)[-1]) <= MAX_LANES
            and dtype(n) is not None and dtype(n).is_floating_point]


def _forward_read(graph: fx.Graph, gradient: set, nodes: List[fx.Node],
                  ctx: Optional[RuleContext] = None) -> LaneEvaluator:
    """The evaluator that has read ``nodes`` (no leaf forced): the one read earlier in this round where it still holds.

    With ``ctx`` (the forward rule), each node is read through ``ctx.examine``, which skips a candidate that
    failed earlier in the run: a read is then shared only while none of ``nodes`` has failed, when it is
    the read without ``ctx`` (which raises what ``examine`` would record). ``gradient`` is the round's
    :func:`~..nodes.gradient_dependent` answer (the pass manager computes it once a round); a graph
    without one shares nothing."""
    clean = ctx is None or not any(ctx.has_failed(n) for n in nodes)
    clean = clean and isinstance(gradient, GradientNodes)
    kept = _FORWARD_READS.get(graph)
    if kept is not None and kept.gradient() is not gradient:
        del _FORWARD_READS[graph]  # an earlier round's: let it go
    elif clean and kept is not None and kept.holds(gradient, nodes):
        return kept.ev
    ev = lane_evaluator(_SameValues())
    for node in nodes:
        if ctx is None:
            ev.value(node)
        else:
            ctx.examine(node, ev.value, node)
    if clean and (ctx is None or not any(ctx.has_failed(n) for n in nodes)):
        _FORWARD_READS[graph] = _ForwardRead(gradient, nodes, ev)
    return ev


def _evaluated(ctx: RuleContext, nodes, forced=(), graph: Optional[fx.Graph] = None, gradient=None) -> tuple:
    """(the evaluator, the rotation-shaped nodes) with ``forced`` nodes read as leaves; with none forced and
    the ``graph`` and ``gradient`` given, the round's shared forward read (:func:`_forward_read`)."""
    if forced or graph is None:
        ev = lane_evaluator(_SameValues(), forced)
        for node in nodes:
            ctx.examine(node, ev.value, node)
    else:
        ev = _forward_read(graph, gradient, nodes, ctx)
    return ev, [n for n in nodes if looks_like_y(ev.memo.get(n))]


def forward_rotations(graph: fx.Graph, gradient: set) -> List[ForwardRopeMatch]:
    """The forward rotations of a joint graph over one tracked axis, matched by value and recording
    nothing (the backward rule reads their tables for a site of table gradients alone)."""
    seeds = [n for n in element_moves(graph) if n not in gradient]
    nodes = _forward_nodes(graph, gradient, seeds)
    ev = _forward_read(graph, gradient, nodes)
    looks = [n for n in nodes if looks_like_y(ev.memo.get(n))]
    return [m for m in (match_y(ev, n) for n in looks) if m is not None]


def find_sites(graph: fx.Graph, ctx: RuleContext) -> RoundReport:
    """The forward RoPE sites of a joint graph, and what looks like one but matched no mode."""
    if not isinstance(ctx.provenance, JointProvenance):
        return RoundReport()
    gradient = gradient_dependent(graph) or set()
    seeds = [n for n in element_moves(graph) if n not in gradient]
    symbolic = _symbolic_last_axis(seeds, gradient)
    nodes = _forward_nodes(graph, gradient, seeds)
    ev, looks = _evaluated(ctx, nodes, graph=graph, gradient=gradient)
    makers = _axis_makers(ev, _uncovered(ctx, ev, looks))
    if makers:
        ctx.evaluated(ev)
        ev, looks = _evaluated(ctx, nodes, makers)
    products = _products_passed_on(ev, _uncovered(ctx, ev, looks) + _unshaped_rotations(ev, seeds, gradient, looks),
                                   looks)
    if products:
        ctx.evaluated(ev)
        ev, looks = _evaluated(ctx, nodes, makers | products)
    matches = _unbroadcast([m for m in (ctx.examine(n, match_y, ev, n) for n in looks) if m is not None])
    wider = _axis_makers(ev, _uncovered(ctx, ev, looks), covering=False) - makers - products
    if wider:  # a rotation of N heads flattened after it: its N * D wide view matches no mode, its heads may
        ev_heads, looks_heads = _evaluated(ctx, nodes, makers | products | wider)
        heads = _unbroadcast([m for m in (ctx.examine(n, match_y, ev_heads, n) for n in looks_heads) if m is not None])
        if len(heads) > len(matches):
            ctx.evaluated(ev)
            ev, looks, matches = ev_heads, looks_heads, heads
    matches = outermost(matches, node=lambda m: m.y, same=lambda a, b: (a.mode, a.x, a.cos, a.sin) ==
                        (b.mode, b.x, b.cos, b.sin))
    matches = _innermost_where_shared(matches)
    inside = {n for m in matches for n in site_region(m) if n is not m.y}
    matches = [m for m in matches if m.y not in inside]
    ctx.evaluated(ev)
    looked = set(looks)
    scaled = [n for n in nodes if n not in looked and _reads_scaled_copy(ev, n)]
    # a rotation of a rotation this round fuses (RoPE applied twice) reads its fused output next round
    outputs = {m.y for m in matches}
    pending = len(outermost([n for n in looks if n not in inside and _built_on_match(ev, n, outputs)]))
    return RoundReport(matches, symbolic + _near_misses(ev, looks, matches, inside) + _near_misses(
        ev, scaled, matches, inside, SCALED_COPY_REASON), pending)


def _unbroadcast(matches: List[ForwardRopeMatch]) -> List[ForwardRopeMatch]:
    """Without the matches whose output is an ``expand`` of another match's output (MLA's
    shared ``k_rot`` broadcast over heads): the rotation is the one before the broadcast, whose
    x has its shape."""
    outputs = {m.y for m in matches}
    return [m for m in matches if not (m.y.target is aten.expand.default and m.y.args[0] in outputs)]


def _innermost_where_shared(matches: List[ForwardRopeMatch]) -> List[ForwardRopeMatch]:
    """Drop the matches that are copies of another match read elsewhere.

    Without the matches built on another match whose output something outside them also
    reads: a copy of a rotation (``repeat_kv``'s expand and clone of the rotated k, read twice
    by DiffLlama's two attentions) is a rotation too, but only the rotation itself can be
    replaced; its copies then read the fused op's output."""
    regions = {m.y: set(site_region(m)) for m in matches}

    def read_outside(outer, inner):
        return inner.y in regions[outer.y] and any(u not in regions[outer.y] for u in inner.y.users)

    return [m for m in matches if not any(o is not m and read_outside(m, o) for o in matches)]


#: why a rotation of a symbolic head dim (``dynamic=True``) stays as it is
SYMBOLIC_MOVES = "elements moved along a symbolic last axis and summed, as a RoPE forward does"
SYMBOLIC_REASON = symbolic_head_dim_reason(SYMBOLIC_MOVES)


def _symbolic_last_axis(seeds, gradient) -> List[Miss]:
    """Record the forward rotations that a symbolic head dim keeps from fusing.

    Forward elements moved along a symbolic last axis and then summed: no node of a symbolic
    head dim is evaluated, so such a rotation would be a silent miss (found by the forward
    property tests); recorded instead, as the backward rule does (:func:`..rope_grad.sites._symbolic_last_axis`).
    Only a move along the last axis whose sum is a rotation's: two products of tensors that vary
    along that axis (``x * cos + rotate(x) * sin``), or a product of complex pairs (``freqs_cis``);
    a difference, a causal convolution's taps or a sequence shift is no RoPE."""
    sums = rotation_sums(seeds, lambda u: u not in gradient and sums_rotation_terms(u))
    return [Miss(OP.name, n.name, symbolic_head_dim_reason(SYMBOLIC_MOVES, head_dim_mark(n))) for n in sums]


def sums_rotation_terms(node: fx.Node) -> bool:
    if node.target is aten.mul.Tensor:
        return dtype(node) is not None and dtype(node).is_complex
    if node.target is aten.addcmul.default:  # a + b * c, a rotation's two terms in one call
        return varying_product(node.args[0]) and all(
            isinstance(a, fx.Node) and shape(a) and static_int(shape(a)[-1]) != 1 for a in node.args[1:3])
    return node.target in (aten.add.Tensor, aten.sub.Tensor) and all(varying_product(a) for a in node.args[:2])


#: why a rotation that reads x in one term and a constant multiple of x in the other fuses in no form
SCALED_COPY_REASON = ("two products per element like a RoPE forward, one of x and one of x scaled by a constant "
                      "(x * cos + rotate(c * x) * sin): no form folds the constant into a table; scale the table "
                      "instead (x * cos + rotate(x) * (c * sin)) to fuse it")


def _reads_scaled_copy(ev: LaneEvaluator, node: fx.Node) -> bool:
    """Two products of two leaf elements per position, one term reading a leaf and the other a
    constant multiple of the same tensor at another position: a rotation of x whose rotated
    term reads ``c * x`` (a leaf of its own to the evaluator)."""
    v = ev.memo.get(node)
    if not (v is not None and v.reduction is None and not v.complex and v.inner and v.inner[-1] >= 2
            and all(len(p) == 2 and all(len(m) == 2 for m in p) for p in position_forms(v))):
        return False
    a, b = v.poly_at(0)
    return any(l1 != l2 and p1 != p2 and unscaled(ev.leaves[l1]) is unscaled(ev.leaves[l2])
               for l1, p1 in a for l2, p2 in b)


def _near_misses(ev: LaneEvaluator, looks, matches, inside, reason: Optional[str] = None) -> List[Miss]:
    """Rotation-shaped forward nodes that are neither a match, inside one, nor built on one."""
    outputs = {m.y for m in matches}
    matched = outputs | inside
    unmatched = [n for n in looks if n not in matched and not _built_on_match(ev, n, outputs)]
    return [Miss(OP.name, n.name, reason or ("two products per element like a RoPE forward, but no mode's formula "
                                            "(signs, split points or tables differ)" + _spanning(ev, n)))
            for n in outermost(unmatched)]


def _built_on_match(ev: LaneEvaluator, node: fx.Node, outputs: set) -> bool:
    """``node`` is no match's output (``outputs``) and is computed from one (through the nodes the evaluator read)."""
    if node in outputs:
        return False
    region = region_of([node], lambda r: r is node or (r in ev.interpreted and r not in outputs))
    return any(a in outputs for r in region for a in r.all_input_nodes)


def _spanning(ev: LaneEvaluator, node: fx.Node) -> str:
    inner = ev.memo[node].inner
    return "" if len(inner) == 1 else f"; its value spans the axes {list(inner)} (x or a table a view across them)"
