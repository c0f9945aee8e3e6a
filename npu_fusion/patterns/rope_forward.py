"""Fuse forward RoPE on the joint graph into ``npu_fusion.rotary_position_embedding``.

Unfused, as AOTAutograd writes HF ``apply_rotary_pos_emb`` for q (and again for k)::

    y = add(mul(q, cos), mul(cat(neg(slice(q, -1, D/2, D)), slice(q, -1, 0, D/2)), sin))

Fused::

    y = npu_fusion.rotary_position_embedding(q, cos, sin, mode=0)

How a match is found, by value in the backward rule's domain (:class:`~.lanes.LaneEvaluator`,
exact per-position polynomials of leaf elements) run on the forward nodes: a node is a RoPE
output when, for some mode and some leaves playing x, cos and sin, position i of its value is
``x[a(i)] * cos[i] + s(i) * x[b(i)] * sin[i]`` with ``a``, ``b`` and the signs ``s`` of the
mode (the transpose of the backward in docs/fused-ops.md#rotary_position_embedding_grad:
:func:`~.rope.table_terms`), each table possibly negated as a whole. The fused op then reads the
nodes the site reads that hold x, cos
and sin exactly (a partial rotary's slice of q, a table after its ``unsqueeze``); an operand that
exists only in pieces (a half-width table read twice, x read as its even and odd lanes, the real
parts of a complex ``freqs_cis``, a cache's ``select``) is rebuilt from the node that holds its
elements with slices and ``cat`` (or ``stack``), and the rebuilt node is evaluated and must equal
the role position by position before the site fuses. Casts are identities of the domain and the rounding rules of
:func:`~.evaluator.rounding_problem` judge the output; since a rounded copy of a role equals the role in the
domain, every node the site reads of a role's elements must carry the rounding of the operand the fused op
reads (a table read rounded in some lanes and exactly in others is refused). A rotation is one site with its
backward: the backward rule's verdict on its tables' roundings and on what the target runs binds this rule,
and this rule's precision verdict gives a backward no form read its reason (:class:`~.context.SiteJudgements`). Only on a joint graph, after the backward
rules in each round: an intermediate a decomposed backward still reads (``rotate_half(q)`` for
a table's gradient) keeps the forward as it is until that backward is fused; and on an inference
graph (:class:`~.evaluator.InferenceProvenance`), where no backward pairs a rotation and what no
form matched is found by its shape (:func:`_left_rotations`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import List, Optional, Tuple

import torch.fx as fx

from ..lowering import ROPE as OP, ROPE_GRAD
from ..lowering.ops.rope_grad import ROPE_MODES, rope_divisor
from ..lowering.sizes import same_shape, static_int
from .evaluator import InferenceProvenance, JointProvenance, kept_precision, rounding_problem
from . import lane_pieces
from .lanes import LaneEvaluator, Lanes, position_forms
from .lanes import shape as lane_shape
from .nodes import (CAST_TARGETS, VIEWS, aten, downstream, dtype, gradient_dependent, is_float_cast, last_of,
                    outermost, outside_users, region_of, shape, val)
from .rewrite import (Insertion, Miss, RuleContext, commit, exact_common_dtype, in_layout_of, input_problem,
                      replacement_of)
from .pairing import ROTATION_SITE, calls, forward_is_complex, site_key, source, unpaired
from .rms_norm_forward import _as_forward_work
from .layout import memory_order, permuted, restored, same_layout
from .rope import (DX_DEPTH, MAX_LANES, TABLE_SIGNS, _moves_elements, lane_evaluator, rope_layout_problem,
                   rotation_sums, symbolic_head_dims, table_terms, unscaled, varying_product)
from .rule import Form, FusionRule, RoundReport, SiteProbe

#: (leaf id, the leaf position that plays each position of the fused op's operand)
Role = Tuple[int, Tuple[int, ...]]


@dataclasses.dataclass
class ForwardRopeMatch:
    y: fx.Node
    mode: int
    x: Role
    cos: Role
    sin: Role
    signs: Tuple[int, int]
    ev: LaneEvaluator

    @property
    def dx(self) -> fx.Node:
        """The node a transaction runs under (the rules' common key)."""
        return self.y


def expected_y(mode: int, d: int, x: Role, cos: Role, sin: Role, signs=(1, 1)):
    """y's polynomials: ``x[a(i)] * cos[i] + s(i) * x[b(i)] * sin[i]``, each table times its sign."""
    polys = []
    for i, ((_, a), (s, b)) in enumerate(zip(table_terms(mode, d, "cos"), table_terms(mode, d, "sin"))):
        poly = {}
        for coef, xp, table, sign in ((1, a, cos, signs[0]), (s, b, sin, signs[1])):
            mono = tuple(sorted(((x[0], x[1][xp]), (table[0], table[1][i]))))
            poly[mono] = poly.get(mono, 0) + coef * sign
        polys.append(poly)
    return polys


@functools.lru_cache(maxsize=256)
def y_runs(mode: int, d: int):
    """y's formula as runs of positions (:func:`~.lane_pieces.term_runs`): position i pairs x's index
    a(i) with cos[i] and, times s(i), x's index b(i) with sin[i]; None for the interleaved modes."""
    return lane_pieces.term_runs(tuple(((1, a, "cos", i), (s, b, "sin", i)) for i, ((_, a), (s, b)) in
                                       enumerate(zip(table_terms(mode, d, "cos"), table_terms(mode, d, "sin"))))) \
        if d else None


def _read_roles(v: Lanes, mode: int, x: Role):
    """(cos, sin, signs) read off the products with x's elements, or None."""
    d = v.inner[0] if len(v.inner) == 1 else len(v.polys)
    runs = y_runs(mode, d) if v.pieces is not None else None
    if runs is not None:  # read once a run of positions: the same roles and signs
        read = lane_pieces.read_partners(v.pieces, runs, x, ("cos", "sin"), d)
        if read is None:
            return None
        roles, coefs = read
        if any(coef not in (c, -c) for t in coefs for c, coef in coefs[t]):
            return None
        signs = {t: {coef * c for c, coef in coefs[t]} for t in coefs}
        if any(len(s) != 1 for s in signs.values()):
            return None
        return roles["cos"], roles["sin"], (next(iter(signs["cos"])), next(iter(signs["sin"])))
    found = {"cos": [], "sin": []}
    signs = {"cos": set(), "sin": set()}
    for i, ((_, a), (s, b)) in enumerate(zip(table_terms(mode, d, "cos"), table_terms(mode, d, "sin"))):
        poly = v.polys[i]
        for which, xp, base in (("cos", a, 1), ("sin", b, s)):
            var = (x[0], x[1][xp])
            monos = [m for m in poly if var in m]
            if len(monos) != 1 or poly[monos[0]] not in (base, -base):
                return None
            (other,) = [u for u in monos[0] if u != var] or [var]
            found[which].append(other)
            signs[which].add(poly[monos[0]] * base)
    if any(len(s) != 1 for s in signs.values()) or any(len({o[0] for o in found[t]}) != 1 for t in found):
        return None
    cos, sin = ((found[t][0][0], tuple(p for _, p in found[t])) for t in ("cos", "sin"))
    return cos, sin, (next(iter(signs["cos"])), next(iter(signs["sin"])))


def _equals_expected_y(v: Lanes, mode: int, d: int, x: Role, cos: Role, sin: Role, signs) -> bool:
    """``v.polys == expected_y(...)``, once a run of positions where the value and the formula have runs."""
    runs = y_runs(mode, d) if v.pieces is not None else None
    if runs is not None:
        sign = {"cos": signs[0], "sin": signs[1]}
        equal = lane_pieces.equals_formula(v.pieces, runs, x, {"cos": cos, "sin": sin}, lambda c, t: c * sign[t])
        if equal is not None:
            return equal
    return v.polys == expected_y(mode, d, x, cos, sin, signs)


def match_y(ev: LaneEvaluator, node: fx.Node) -> Optional[ForwardRopeMatch]:
    v = ev.memo.get(node)
    if v is None or v.reduction is not None or v.complex or len(v.inner) != 1 or v.inner[0] < 2 or v.inner[0] % 2:
        return None
    if any(len(p) != 2 or any(len(m) != 2 for m in p) for p in position_forms(v)):
        return None
    d = v.inner[0]
    lids = set.intersection(*({lid for lid, _ in m} for m in v.poly_at(0)))
    # a complex product is symmetric: x is the leaf over y's leading axes, not the broadcast table
    for x_lid in sorted(lids, key=lambda lid: (not _leads_like(ev.leaves[lid], node), lid)):
        offset = v.lowest_position(x_lid)
        x = (x_lid, tuple(range(offset, offset + d)))
        for mode in ROPE_MODES:
            if d % rope_divisor(mode):
                continue
            roles = _read_roles(v, mode, x)
            if roles is None or x_lid in (roles[0][0], roles[1][0]):
                continue
            cos, sin, signs = roles
            if signs in TABLE_SIGNS and _equals_expected_y(v, mode, d, x, cos, sin, signs):
                return ForwardRopeMatch(node, mode, x, cos, sin, signs, ev)
    return None


def _leads_like(leaf: fx.Node, y: fx.Node) -> bool:
    """``leaf`` has ``y``'s leading sizes (its trailing ones are the tracked lanes)."""
    a, b = lane_shape(leaf), shape(y)
    return a is not None and b is not None and len(a) >= len(b) and same_shape(a[:len(b) - 1], b[:-1])


def _looks_like_y(v: Optional[Lanes]) -> bool:
    """Two products of two leaf elements per position, one leaf read at two positions (over
    one tracked axis, or several: see :func:`_axis_makers`)."""
    if not (v is not None and v.reduction is None and not v.complex and v.inner and v.inner[-1] >= 2
            and all(len(p) == 2 and all(len(m) == 2 for m in p) for p in position_forms(v))):
        return False
    a, b = v.poly_at(0)
    return any(l1 == l2 and p1 != p2 for l1, p1 in a for l2, p2 in b)


#: the lane evaluator's views: a view that reshapes the tracked axes
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int,
            aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims}


#: the ops whose outputs the lane evaluator reads through their ``getitem`` (Megatron's
#: ``torch.split(mixed_qkv, ...)``): the views before them are near the rotation too
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}


def _axis_makers(ev: LaneEvaluator, looks) -> set:
    """The views that give a rotation a second tracked axis, to be read as leaves.

    The views that give a rotation a second tracked axis, from a value tracked over one:
    BSND's tables ``cos[:, None]`` ([S, 1, D], tracked as (1, D); the product with an x of
    [B, S, N, D] is then no value at all) and, for a rotation-shaped value over several axes,
    ``proj.view(B, S, N, D)`` of a projection N*D wide (tracked as (N, D)). Read as leaves
    (always sound: a leaf is its own value), the rotation is one of the last axis again. A
    view the formula reads through (DeepSeek's interleave-half ``view(..., D/2, 2)``) is none
    of these and stays read, as does a value over several axes that a rotation-shaped value of
    one axis reads (the complex product's ``view_as_real``, torchtune's ``stack``, before their
    ``flatten``): that one is the candidate, matched or a near miss as it is."""
    flat = [y for y in looks if len(ev.memo[y].inner) == 1]
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

    They lie near a move of elements along the last axis (:func:`.rope.rotation_sums`): where x is a
    product (a decomposed norm's ``normed * weight``, the norm left unfused), the evaluator cuts it
    into a different leaf at each term's reader, and the rotation reads no leaf twice."""
    inside = {n for y in looks for n in region_of([y], lambda r: r in ev.interpreted)}
    sums = rotation_sums(seeds, lambda u: u not in gradient and _sums_rotation_terms(u), symbolic_only=False)
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
        if _moves_elements(n):
            return True
        stack.extend(u for u in n.users if u.target in PASSES_ON)
    return False


def _evaluated(ctx: RuleContext, nodes, forced=()) -> tuple:
    """(the evaluator, the rotation-shaped nodes) with ``forced`` nodes read as leaves."""
    ev = lane_evaluator(_SameValues(), forced)
    for node in nodes:
        ctx.examine(node, ev.value, node)
    return ev, [n for n in nodes if _looks_like_y(ev.memo.get(n))]


def find_sites(graph: fx.Graph, ctx: RuleContext) -> RoundReport:
    """The forward RoPE sites of a joint graph, and what looks like one but matched no mode."""
    if not isinstance(ctx.provenance, JointProvenance):
        return RoundReport()
    gradient = gradient_dependent(graph) or set()
    seeds = [n for n in graph.nodes if n not in gradient and _moves_elements(n)]
    symbolic = _symbolic_last_axis(seeds, gradient)
    nodes = [n for n in downstream(graph, seeds, DX_DEPTH) if n not in gradient and n.op == "call_function"
             and shape(n) and static_int(shape(n)[-1]) is not None and 2 <= static_int(shape(n)[-1]) <= MAX_LANES
             and dtype(n) is not None and dtype(n).is_floating_point]
    ev, looks = _evaluated(ctx, nodes)
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
    matches = outermost(matches, node=lambda m: m.y, same=lambda a, b: (a.mode, a.x, a.cos, a.sin) ==
                        (b.mode, b.x, b.cos, b.sin))
    matches = _innermost_where_shared(matches)
    inside = {n for m in matches for n in _region(m) if n is not m.y}
    matches = [m for m in matches if m.y not in inside]
    ctx.evaluated(ev)
    scaled = [n for n in nodes if n not in looks and _reads_scaled_copy(ev, n)]
    # a rotation of a rotation this round fuses (RoPE applied twice) reads its fused output next round
    pending = len(outermost([n for n in looks if n not in inside and _built_on_match(ev, n, matches)]))
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
    regions = {m.y: set(_region(m)) for m in matches}

    def read_outside(outer, inner):
        return inner.y in regions[outer.y] and any(u not in regions[outer.y] for u in inner.y.users)

    return [m for m in matches if not any(o is not m and read_outside(m, o) for o in matches)]


#: why a rotation of a symbolic head dim (``dynamic=True``) stays as it is
SYMBOLIC_REASON = ("elements moved along a symbolic last axis and summed, as a RoPE forward does: the pass proves "
                   "RoPE per position of a static head dim, and this one was marked dynamic (mark_dynamic) or "
                   "compiled where no guard can fix it: keep the head dim static")


def _symbolic_last_axis(seeds, gradient) -> List[Miss]:
    """Record the forward rotations that a symbolic head dim keeps from fusing.

    Forward elements moved along a symbolic last axis and then summed: no node of a symbolic
    head dim is evaluated, so such a rotation would be a silent miss (found by the forward
    property tests); recorded instead, as the backward rule does (:func:`.rope._symbolic_last_axis`).
    Only a move along the last axis whose sum is a rotation's: two products of tensors that vary
    along that axis (``x * cos + rotate(x) * sin``), or a product of complex pairs (``freqs_cis``);
    a difference, a causal convolution's taps or a sequence shift is no RoPE."""
    sums = rotation_sums(seeds, lambda u: u not in gradient and _sums_rotation_terms(u))
    return [Miss(OP.name, n.name, SYMBOLIC_REASON) for n in sums]


def _sums_rotation_terms(node: fx.Node) -> bool:
    if node.target is aten.mul.Tensor:
        return dtype(node) is not None and dtype(node).is_complex
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
    matched = {m.y for m in matches} | inside
    unmatched = [n for n in looks if n not in matched and not _built_on_match(ev, n, matches)]
    return [Miss(OP.name, n.name, reason or ("two products per element like a RoPE forward, but no mode's formula "
                                            "(signs, split points or tables differ)" + _spanning(ev, n)))
            for n in outermost(unmatched)]


def _built_on_match(ev: LaneEvaluator, node: fx.Node, matches) -> bool:
    """``node`` is no match and is computed from a match's output (through the nodes the evaluator read)."""
    outputs = {m.y for m in matches}
    if node in outputs:
        return False
    region = region_of([node], lambda r: r is node or (r in ev.interpreted and r not in outputs))
    return any(a in outputs for r in region for a in r.all_input_nodes)


def _spanning(ev: LaneEvaluator, node: fx.Node) -> str:
    inner = ev.memo[node].inner
    return "" if len(inner) == 1 else f"; its value spans the axes {list(inner)} (x or a table a view across them)"


# -- the rewrite --------------------------------------------------------------

def _region(site: ForwardRopeMatch) -> List[fx.Node]:
    ev = site.ev
    role_ids = {site.x[0], site.cos[0], site.sin[0]}
    leaves = {ev.leaves[i] for i in role_ids}
    return region_of([site.y], lambda n: n in ev.interpreted and n not in leaves)


@dataclasses.dataclass
class Operand:
    """How the fused op gets one role from a node the site reads.

    How the fused op gets one role: ``base``, a node the site reads, holds the role's values
    in its trailing axes (flattened, a complex tensor as its real view); ``picks`` are the
    positions of those values that make the role, in order (None: base is the role whole)."""
    base: fx.Node
    inner: Tuple[int, ...]
    picks: Optional[Tuple[int, ...]] = None

    def shape(self) -> tuple:
        s = lane_shape(self.base)
        width = len(self.picks) if self.picks is not None else math.prod(self.inner)
        return tuple(s[:len(s) - len(self.inner)]) + (width,)

    def dtype(self):
        d = dtype(self.base)
        return d.to_real() if d.is_complex else d


def _picks(ev: LaneEvaluator, node: fx.Node, role: Role) -> Optional[Tuple[int, ...]]:
    """Where each of the role's positions lies in ``node``'s flattened trailing values, when each
    value of node is one element of the role's leaf (a half-width table, x's de-interleaved
    copy, a complex table's parts); None otherwise."""
    v = ev.memo.get(node)
    if v is None or v.reduction is not None or len(v.inner) > 2 or (len(v.inner) == 2 and not (
            v.complex or tuple(static_int(s) for s in shape(node)[-2:]) == v.inner)):
        return None
    where = {}
    for j, poly in enumerate(v.polys):
        if len(poly) != 1 or next(iter(poly.values())) != 1 or len(next(iter(poly))) != 1:
            return None
        (lid, p), = next(iter(poly))
        if lid == role[0]:
            where.setdefault(p, j)
    if any(p not in where for p in role[1]):
        return None
    picks = tuple(where[p] for p in role[1])
    return None if _gather_plan(picks) is None else picks


def _runs(picks) -> List[Tuple[int, int, int]]:
    """``picks`` as (start, stop, step) slices, each as long as it can be, in order."""
    runs, k = [], 0
    while k < len(picks):
        step = picks[k + 1] - picks[k] if k + 1 < len(picks) and picks[k + 1] > picks[k] else 1
        end = k + 1
        while end < len(picks) and picks[end] - picks[end - 1] == step:
            end += 1
        runs.append((picks[k], picks[end - 1] + 1, step))
        k = end
    return runs


#: the most slices a rebuilt operand is concatenated from
MAX_PIECES = 4


def _gather_plan(picks):
    """("cat", runs): the picks concatenated from a few slices; ("pairs", evens, odds): two
    such gathers interleaved element by element (a table repeated pairwise, x re-interleaved
    from its halves); None when the picks are neither."""
    runs = _runs(picks)
    if len(runs) <= MAX_PIECES:
        return ("cat", runs)
    if len(picks) % 2 == 0:
        evens, odds = _runs(picks[0::2]), _runs(picks[1::2])
        if len(evens) <= MAX_PIECES // 2 and len(odds) <= MAX_PIECES // 2:
            return ("pairs", evens, odds)
    return None


def _find_operand(ev: LaneEvaluator, region, role: Role, like) -> Optional[Operand]:
    """How the fused op reads ``role`` from the nodes the site reads.

    How the fused op reads ``role``, from the nodes the site reads (and the role's leaf): a
    node holding it exactly, position by position, in a shape ``like`` accepts, the one nearest
    the output (a table after its ``unsqueeze``, a partial rotary's slice of x); else a node
    whose values are the role's in pieces, nearest the output first (a half-width table read
    twice, x read as its even and odd lanes, a complex table's parts)."""
    read = {a for n in region for a in n.all_input_nodes} | set(region) | {ev.leaves[role[0]]}
    found = [n for n in read if ev.memo.get(n) is not None and ev.memo[n].reduction is None
             and not ev.memo[n].complex and ev.memo[n].reads(*role) and like(shape(n))]
    if found:
        return Operand(max(found), ev.memo[max(found)].inner)
    for node in sorted(read, reverse=True):
        picks = _picks(ev, node, role)
        if picks is not None:
            operand = Operand(node, ev.memo[node].inner, picks)
            if like(operand.shape()):
                return operand
    return None


def _built(edit, ev: LaneEvaluator, operand: Operand, role: Role) -> Optional[fx.Node]:
    """Emit the operand's tensor from its base and picks.

    The operand's tensor, emitted: its base (a complex one as its real view), trailing axes
    flattened, the picks gathered by slices and ``cat`` (or ``stack`` of two such for pairs);
    None unless the emitted node's value is the role's, position by position (the proof)."""
    node = operand.base
    if dtype(node).is_complex:  # a saved ``freqs.conj()`` is a lazy view view_as_real refuses
        node = edit.call(aten.view_as_real.default, (edit.call(aten.resolve_conj.default, (node,)),))
    if len(operand.inner) == 2:
        node = edit.call(aten.flatten.using_ints, (node, -2, -1))
    if operand.picks is not None and operand.picks != tuple(range(math.prod(operand.inner))):
        plan = _gather_plan(operand.picks)
        if plan[0] == "cat":
            node = _sliced(edit, node, plan[1])
        else:
            pairs = edit.call(aten.stack.default, ([_sliced(edit, node, runs) for runs in plan[1:]], -1))
            node = edit.call(aten.flatten.using_ints, (pairs, -2, -1))
    value = ev.value(node)
    return node if value is not None and not value.complex and value.reads(*role) else None


def _sliced(edit, node: fx.Node, runs) -> fx.Node:
    pieces = [edit.call(aten.slice.Tensor, (node, -1, start, stop, step)) for start, stop, step in runs]
    return pieces[0] if len(pieces) == 1 else edit.call(aten.cat.default, (pieces, -1))


def _empty(node: fx.Node) -> bool:
    """Whether ``node`` has no elements, as a partial rotary's empty pass-through has.

    No elements: the pass-through of a partial rotary whose rotation is the whole head
    (``cat([rotated, q[..., D:]])``, Phi-3's ``q_pass`` at ``partial_rotary_factor`` 1), read by
    nothing the fused op computes, and left to the graph's dead-code removal."""
    return any(static_int(s) == 0 for s in shape(node) or ())


def _operands(ctx: RuleContext, site: ForwardRopeMatch):
    """(x, cos, sin as :class:`Operand`, the replaced region), or the reason the site cannot fuse."""
    ev, wide = site.ev, _region(site)
    y_shape = shape(site.y)
    roles = [_find_operand(ev, wide, site.x, lambda s: same_shape(s, y_shape))] + [
        _find_operand(ev, wide, r, lambda s: len(s) <= len(y_shape) and same_shape(s[-1:], y_shape[-1:]))
        for r in (site.cos, site.sin)]
    if None in roles:
        which = ("x", "cos", "sin")[roles.index(None)]
        return (f"no node the site reads holds its {which}, whole or in pieces that a few slices and a cat "
                f"rebuild, in a shape the fused op reads (x in y's shape, a table broadcast to it)")
    bases = [r.base for r in roles]
    region = _replaced(ev, region_of([site.y], lambda n: n in ev.interpreted and n not in bases and not _empty(n)),
                       site.y)
    shared = outside_users(region, [site.y])
    if shared:
        user = next(u for u in shared[0].users if u not in region)
        return f"intermediate {shared[0].name} has a user outside the rotation ({user.name})"
    leaves = {site.x[0], site.cos[0], site.sin[0]}
    foreign = [a for n in region for a in n.all_input_nodes if a not in region and a not in bases
               and shape(a) is not None and not _empty(a) and not _picks_of_one_leaf(ev, a, leaves)]
    if foreign:
        return f"the rotation also reads {foreign[0].name}, which is none of x, cos and sin"
    mixed = _read_at_another_precision(ev, region, roles, (site.x, site.cos, site.sin))
    if mixed is not None:
        return _judged(ctx, site, _precision_problem(site, *mixed))
    return (*roles, region)


def _read_at_another_precision(ev: LaneEvaluator, region: List[fx.Node], operands, roles):
    """(a node the rotation reads, the operand node it stands beside) where the rotation reads
    elements of a role's leaf rounded otherwise than the node the fused op reads for that role;
    None when every read agrees. Casts are identities of the domain, so a rounded copy of a table
    equals the table: the issue's cache read through a bf16 round trip in half of its lanes and
    exactly in the other half holds cos whole in the rounded copy, which alone the fused op would
    read (the other half's rounding added). The nodes inside the region are judged by
    :func:`~.evaluator.rounding_problem`; these are the region's inputs, kept for other users (a
    slice the decomposed backward reads) or the leaf itself."""
    bases = {}
    for operand, role in zip(operands, roles):
        bases.setdefault(role[0], []).append(operand.base)
    inside = set(region)
    reads = {a: None for n in region for a in n.all_input_nodes if a not in inside}
    for read in reads:
        for lid, nodes in bases.items():
            if read not in nodes and _picks_of_one_leaf(ev, read, {lid}) and all(
                    ev.rounded.get(read, frozenset()) != ev.rounded.get(b, frozenset()) for b in nodes):
                return read, nodes[0]
    return None


def _judged(ctx: RuleContext, site: ForwardRopeMatch, rounding: Optional[str]) -> Optional[str]:
    """``rounding``, the site's precision verdict, recorded for a backward no form read to take."""
    ctx.context.judgements.record(site_key(ROTATION_SITE, *_leaves(site)[1:]), rounding, by="forward")
    return rounding


def _leaves(site: ForwardRopeMatch) -> List[fx.Node]:
    """The leaves whose elements play x, cos and sin (in that order)."""
    return [site.ev.leaves[role[0]] for role in (site.x, site.cos, site.sin)]


def _precision_problem(site: ForwardRopeMatch, read: fx.Node, operand: fx.Node) -> str:
    """Why the site cannot fuse when it reads a role at two precisions.

    The rounding the program
    does inside the site, judged by :func:`~.evaluator.rounding_problem` against the role leaves as
    the backward rule judges its site's (the same reason), else the two reads named."""
    return rounding_problem(site.ev, {"y": site.y}, _leaves(site)) or (
        f"the site reads one of its inputs rounded in some lanes and not in others ({read.name} and "
        f"{operand.name} hold the same elements at different precisions), where the fused op reads one")


def _replaced(ev: LaneEvaluator, region: List[fx.Node], y: fx.Node) -> List[fx.Node]:
    """The region less what stays for other users: a selection of one input's elements (a
    table's ``select`` from a cache, a slice the decomposed backward also reads) costs nothing
    to keep, and with it what it is computed from."""
    kept = [n for n in outside_users(region, [y]) if _picks_of_one_leaf(ev, n)]
    inside = set(region)
    stays = set(region_of(kept, lambda n: n in inside))
    return [n for n in region if n not in stays]


def _picks_of_one_leaf(ev: LaneEvaluator, node: fx.Node, among=None) -> bool:
    """Each value of ``node`` is one element of one leaf (``among`` those, when given): a
    view's or a selection's value."""
    v = ev.memo.get(node)
    forms = position_forms(v) if v is not None else []
    lids = {lid for poly in forms for mono in poly for lid, _ in mono}
    return v is not None and v.reduction is None and not v.complex and len(lids) == 1 and (
        among is None or lids <= set(among)) and all(
        len(poly) == 1 and list(poly.values()) == [1] and len(next(iter(poly))) == 1 for poly in forms)


def emit(ctx: RuleContext, site: ForwardRopeMatch):
    """One site rewritten into one fused call (a :class:`Site`), or a :class:`Miss` saying why not.
    The op's output is contiguous: it is called on x, cos and sin with their axes in the memory
    order of the output it replaces (a transposed q: BSND with 1S1D tables), and its result is
    permuted back, so the program's views of that output keep their strides."""
    bound = ctx.context.judgements.binding(site_key(ROTATION_SITE, *_leaves(site)[1:]))
    if bound is not None:  # every backward of these tables was refused for its roundings or by the target
        return Miss(OP.name, site.y.name, bound)
    operands = _operands(ctx, site)
    if isinstance(operands, str):
        return Miss(OP.name, site.y.name, operands)
    x, cos, sin, region = operands
    # in y's memory order; where the rotated axis is not innermost in memory (Zaya's q, BHDS in
    # memory), in the shape's order, the result then copied into y's layout
    order = memory_order(site.y) or list(range(len(shape(site.y))))
    compute = exact_common_dtype((x.dtype(), cos.dtype(), sin.dtype(), kept_precision(site.y)))
    bases = [x.base, cos.base, sin.base]
    problem = _judged(ctx, site, rounding_problem(site.ev, {"y": site.y}, bases)) or rope_layout_problem(
        ctx.target, site.mode, x.shape(), cos.shape(), False, compute, order)
    if problem is not None:
        return Miss(OP.name, site.y.name, problem)
    with Insertion(ctx.graph, last_of(ctx.graph, bases)) as inserted:
        done = _emit_call(ctx, site, (x, cos, sin), compute, order)
        if isinstance(done, Miss):
            return done
    fused, replacement = done
    added = inserted.nodes()
    _as_forward_work(added, site.y)
    return commit(ctx.edit, OP.name, ROPE_MODES[site.mode], region, {"y": site.y}, {site.y: replacement},
                  dict(zip(("x", "cos", "sin"), bases)), added, fused)


def _emit_call(ctx: RuleContext, site: ForwardRopeMatch, roles, compute, order):
    built = [_built(ctx.edit, site.ev, operand, role) for operand, role in zip(roles, (site.x, site.cos, site.sin))]
    if None in built:
        which = ("x", "cos", "sin")[built.index(None)]
        return Miss(OP.name, site.y.name, f"internal: the {which} rebuilt from {roles[built.index(None)].base.name} "
                                          f"is not the site's {which} position by position")
    operands = [permuted(ctx.edit, ctx.edit.cast(built[0], compute), order)]
    for table, sign in zip(built[1:], site.signs):
        table = permuted(ctx.edit, ctx.edit.cast(table, compute), order)
        operands.append(table if sign == 1 else ctx.edit.call(aten.neg.default, (table,)))
    problem = input_problem(ctx.edit.fake_mode, OP.check_inputs, *operands, site.mode)
    if problem is not None:
        return Miss(OP.name, site.y.name, problem)
    fused = ctx.edit.call(OP.overload, (*operands, site.mode))
    replacement = in_layout_of(ctx.edit, replacement_of(ctx.edit, restored(ctx.edit, fused, order), site.y), site.y)
    if not same_layout(replacement, site.y):
        return Miss(OP.name, site.y.name, f"the output's strides {list(val(site.y).stride())} are no dense layout "
                                          f"of its shape with the rotated axis innermost")
    return fused, replacement


def unexplained(graph: fx.Graph, provenance, misses: List[Miss]) -> List[Miss]:
    """Record each fused RoPE backward whose forward neither fused nor was recorded as a miss.

    No silent misses: a fused ``rotary_position_embedding_grad`` that no fused forward and no
    recorded forward miss accounts for is a rotation whose forward matched no form
    (:mod:`.pairing`); each a miss named by the backward node, saying what its forward is. An
    inference graph has no backward to pair with: there, each rotation left in it (:func:`_left_rotations`)."""
    if isinstance(provenance, InferenceProvenance):
        return _left_rotations(graph, misses)
    if not isinstance(provenance, JointProvenance):
        return []
    gradient = gradient_dependent(graph) or set()

    def tables(node, first):
        return source(node.args[first]), source(node.args[first + 1])

    lone = unpaired(calls(graph, ROPE_GRAD), calls(graph, OP), lambda n: tables(n, 1), lambda n: tables(n, 1),
                    misses)
    why = ("its forward multiplies complex numbers (view_as_complex(x) * freqs_cis), and the fused op reads real "
           "cos and sin tables the program never holds whole; write the rotation with real cos/sin tables to fuse "
           "it" if forward_is_complex(graph, gradient) else
           "no forward RoPE form reads its forward (tables only in pieces, or a spelling the forward rule does "
           "not know; run with TORCH_LOGS=npu_fusion and dump_graphs to see it)")
    return [Miss(OP.name, n.name, f"this rotation's backward fused ({n.name}), but {why}") for n in lone]


#: why a rotation left in an inference graph stays as it is
LEFT_ROTATION_REASON = ("elements moved along the last axis and summed with products of tensors varying along it, as "
                        "a RoPE forward is, but no forward RoPE form reads it (its x, cos or sin not seen whole, or "
                        "a spelling the forward rule does not know; run with TORCH_LOGS=npu_fusion and dump_graphs "
                        "to see it)")


def _left_rotations(graph: fx.Graph, misses: List[Miss]) -> List[Miss]:
    """Rotations left after the pass on a graph with no backward to pair them, each a miss.

    Where no backward pairs a rotation (an inference graph), each sum of rotation terms (:func:`_sums_rotation_terms`) near a move of elements along the last axis, left
    after the pass, that no recorded miss at it or after it accounts for, is a miss."""
    missed = {m.node for m in misses}
    seeds = [n for n in graph.nodes if _moves_elements(n)]
    left = rotation_sums(seeds, _sums_rotation_terms, symbolic_only=False)
    return [Miss(OP.name, n.name, LEFT_ROTATION_REASON) for n in left
            if not any(d.name in missed for d in downstream(graph, [n], DX_DEPTH))]


class RopeForwardRule(FusionRule):
    """RoPE's forward on the joint graph, matched by value in per-position polynomials
    (:mod:`.lanes`), rewritten into ``rotary_position_embedding``."""

    stage = "joint"
    domain = "lanes"
    ops = (OP,)
    #: each rotation the model runs is one forward site, the backward's site
    site_probe = SiteProbe(kind=OP.option, same_sites_as="rope")
    forms = tuple(Form(*row) for row in (
        ("forward on the joint graph, modes 0 to 3 (2 and 3 on Ascend 950 and `generic`), a table negated as "
         "a whole, partial rotary (the slice of x the rotation reads), tables broadcast from 11SD/1S1D/...",
         "HF `apply_rotary_pos_emb`, GPT-J, DeepSeek-V3, nanochat"),
        ("forward operands only in pieces, rebuilt from the node holding them and checked by value: half-width "
         "tables read twice, x's even/odd lanes, complex `freqs_cis` (its real parts), a cache's selects",
         "GPT-OSS, HF DeepSeek/MLA, Llama 4, torchtitan, torchtune"),
    ))

    def find(self, graph: fx.Graph, ctx: RuleContext) -> RoundReport:
        return find_sites(graph, ctx)

    def static_sizes(self, graph: fx.Graph) -> list:
        return symbolic_head_dims(graph, False, _sums_rotation_terms)

    def emit(self, ctx: RuleContext, match: ForwardRopeMatch):
        return emit(ctx, match)

    def unexplained(self, graph: fx.Graph, ctx: RuleContext, misses) -> List[Miss]:
        return unexplained(graph, ctx.provenance, misses)
