"""Fuse forward RoPE on the joint graph into ``npu_fusion.rotary_position_embedding``.

Unfused, as AOTAutograd writes HF ``apply_rotary_pos_emb`` for q (and again for k)::

    y = add(mul(q, cos), mul(cat(neg(slice(q, -1, D/2, D)), slice(q, -1, 0, D/2)), sin))

Fused::

    y = npu_fusion.rotary_position_embedding(q, cos, sin, mode=0)

How a match is found, by value in the backward rule's domain (:class:`~.lanes.LaneEvaluator`,
exact per-position polynomials of leaf elements) run on the forward nodes: a node is a RoPE
output when, for some mode and some leaves playing x, cos and sin, position i of its value is
``x[a(i)] * cos[i] + s(i) * x[b(i)] * sin[i]`` with ``a``, ``b`` and the signs ``s`` of the
mode (the transpose of SPEC section 1's backward: :func:`~.rope.table_terms`), each table
possibly negated as a whole. The fused op then reads the nodes the site reads that hold x, cos
and sin exactly (a partial rotary's slice of q, a table after its ``unsqueeze``); tables that
exist only in pieces (half-width tables rebuilt in the graph, complex ``freqs_cis``) are
recorded misses. Casts are identities of the domain and the rounding rules of
:func:`~.evaluator.rounding_problem` judge the output. Only on a joint graph, after the backward
rules in each round: an intermediate a decomposed backward still reads (``rotate_half(q)`` for
a table's gradient) keeps the forward as it is until that backward is fused.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import List, Optional, Tuple

import torch.fx as fx

from ..lowering import ROPE as OP, ROPE_GRAD
from ..lowering.constraints import ROPE_MODES, rope_divisor, rope_target_problem
from ..lowering.sizes import same_shape, static_int
from .evaluator import JointProvenance, kept_precision, rounding_problem
from .lanes import LaneEvaluator, Lanes
from .nodes import (aten, downstream, dtype, gradient_dependent, last_of, outermost, outside_users, region_of, shape,
                    val)
from .rewrite import Insertion, Miss, RuleContext, commit, exact_common_dtype, input_problem, replacement_of
from .pairing import calls, forward_is_complex, source, unpaired
from .rms_norm_forward import _as_forward_work, expression, same_layout
from .rope import DX_DEPTH, MAX_LANES, TABLE_SIGNS, _moves_elements, lane_evaluator, table_terms
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


def _read_roles(v: Lanes, mode: int, x: Role):
    """(cos, sin, signs) read off the products with x's elements, or None."""
    d = len(v.polys)
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


def match_y(ev: LaneEvaluator, node: fx.Node) -> Optional[ForwardRopeMatch]:
    v = ev.memo.get(node)
    if v is None or v.reduction is not None or v.complex or len(v.inner) != 1 or v.inner[0] < 2 or v.inner[0] % 2:
        return None
    if any(len(p) != 2 or any(len(m) != 2 for m in p) for p in v.polys):
        return None
    d = v.inner[0]
    lids = set.intersection(*({lid for lid, _ in m} for m in v.polys[0]))
    for x_lid in sorted(lids):
        offset = min(p for poly in v.polys for m in poly for lid, p in m if lid == x_lid)
        x = (x_lid, tuple(range(offset, offset + d)))
        for mode in ROPE_MODES:
            if d % rope_divisor(mode):
                continue
            roles = _read_roles(v, mode, x)
            if roles is None or x_lid in (roles[0][0], roles[1][0]):
                continue
            cos, sin, signs = roles
            if signs in TABLE_SIGNS and v.polys == expected_y(mode, d, x, cos, sin, signs):
                return ForwardRopeMatch(node, mode, x, cos, sin, signs, ev)
    return None


def _looks_like_y(v: Optional[Lanes]) -> bool:
    """Two products of two leaf elements per position, one leaf read at two positions (over
    one tracked axis, or several: see :func:`_axis_makers`)."""
    if not (v is not None and v.reduction is None and not v.complex and v.inner and v.inner[-1] >= 2
            and all(len(p) == 2 and all(len(m) == 2 for m in p) for p in v.polys)):
        return False
    a, b = v.polys[0]
    return any(l1 == l2 and p1 != p2 for l1, p1 in a for l2, p2 in b)


#: the lane evaluator's views: a view that reshapes the tracked axes
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int,
            aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims}


def _axis_makers(ev: LaneEvaluator, looks) -> set:
    """The views that give a rotation a second tracked axis, from a value tracked over one:
    BSND's tables ``cos[:, None]`` ([S, 1, D], tracked as (1, D); the product with an x of
    [B, S, N, D] is then no value at all) and, for a rotation-shaped value over several axes,
    ``proj.view(B, S, N, D)`` of a projection N*D wide (tracked as (N, D)). Read as leaves
    (always sound: a leaf is its own value), the rotation is one of the last axis again. A
    view the formula reads through (DeepSeek's interleave-half ``view(..., D/2, 2)``) is none
    of these and stays read."""
    spanning = [y for y in looks if len(ev.memo[y].inner) > 1]
    near = {n for y in spanning for n in region_of([y], lambda r: r in ev.interpreted)}
    makers = set()
    for n in (n for n in ev.interpreted if n.target in RESHAPES and isinstance(n.args[0], fx.Node)):
        v, source = ev.memo.get(n), ev.memo.get(n.args[0])
        if v is None or len(v.inner) < 2 or (source is not None and len(source.inner) > 1):
            continue
        if n in near or static_int(shape(n)[-2]) == 1:
            makers.add(n)
    return makers


def _evaluated(ctx: RuleContext, nodes, forced=()) -> tuple:
    """(the evaluator, the rotation-shaped nodes) with ``forced`` nodes read as leaves."""
    ev = lane_evaluator(None, forced)  # the forward's own values: no provenance
    for node in nodes:
        ctx.examine(node, ev.value, node)
    return ev, [n for n in nodes if _looks_like_y(ev.memo.get(n))]


def find_sites(graph: fx.Graph, ctx: RuleContext) -> RoundReport:
    """The forward RoPE sites of a joint graph, and what looks like one but matched no mode."""
    if not isinstance(ctx.provenance, JointProvenance):
        return RoundReport()
    gradient = gradient_dependent(graph) or set()
    seeds = [n for n in graph.nodes if n not in gradient and _moves_elements(n)]
    nodes = [n for n in downstream(graph, seeds, DX_DEPTH) if n not in gradient and n.op == "call_function"
             and shape(n) and static_int(shape(n)[-1]) is not None and 2 <= static_int(shape(n)[-1]) <= MAX_LANES
             and dtype(n) is not None and dtype(n).is_floating_point]
    ev, looks = _evaluated(ctx, nodes)
    makers = _axis_makers(ev, looks)
    if makers:
        ctx.evaluated(ev)
        ev, looks = _evaluated(ctx, nodes, makers)
    matches = [m for m in (ctx.examine(n, match_y, ev, n) for n in looks) if m is not None]
    matches = outermost(matches, node=lambda m: m.y, same=lambda a, b: (a.mode, a.x, a.cos, a.sin) ==
                        (b.mode, b.x, b.cos, b.sin))
    inside = {n for m in matches for n in _region(m) if n is not m.y}
    matches = [m for m in matches if m.y not in inside]
    ctx.evaluated(ev)
    scaled = [n for n in nodes if n not in looks and _reads_scaled_copy(ev, n)]
    return RoundReport(matches, _near_misses(ev, looks, matches, inside) + _near_misses(
        ev, scaled, matches, inside, SCALED_COPY_REASON))


#: why a rotation that reads x in one term and a constant multiple of x in the other fuses in no form
SCALED_COPY_REASON = ("two products per element like a RoPE forward, one of x and one of x scaled by a constant "
                      "(x * cos + rotate(c * x) * sin): no form folds the constant into a table; scale the table "
                      "instead (x * cos + rotate(x) * (c * sin)) to fuse it")


def _unscaled(node: fx.Node) -> fx.Node:
    """``node`` without the products and quotients by constants it is (``2 * q`` is q)."""
    while node.op == "call_function" and node.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor,
                                                         aten.div.Scalar):
        tensors = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        if len(tensors) != 1 or (node.target in (aten.div.Tensor, aten.div.Scalar) and node.args[0] is not tensors[0]):
            break
        node = tensors[0]
    return node


def _reads_scaled_copy(ev: LaneEvaluator, node: fx.Node) -> bool:
    """Two products of two leaf elements per position, one term reading a leaf and the other a
    constant multiple of the same tensor at another position: a rotation of x whose rotated
    term reads ``c * x`` (a leaf of its own to the evaluator)."""
    v = ev.memo.get(node)
    if not (v is not None and v.reduction is None and not v.complex and v.inner and v.inner[-1] >= 2
            and all(len(p) == 2 and all(len(m) == 2 for m in p) for p in v.polys)):
        return False
    a, b = v.polys[0]
    return any(l1 != l2 and p1 != p2 and _unscaled(ev.leaves[l1]) is _unscaled(ev.leaves[l2])
               for l1, p1 in a for l2, p2 in b)


def _near_misses(ev: LaneEvaluator, looks, matches, inside, reason: Optional[str] = None) -> List[Miss]:
    """Rotation-shaped forward nodes that are neither a match, inside one, nor built on one."""
    outputs = {m.y for m in matches}
    matched = outputs | inside

    def built_on_match(n):
        region = region_of([n], lambda r: r is n or (r in ev.interpreted and r not in outputs))
        return any(a in outputs for r in region for a in r.all_input_nodes)

    unmatched = [n for n in looks if n not in matched and not built_on_match(n)]
    return [Miss(OP.name, n.name, reason or ("two products per element like a RoPE forward, but no mode's formula "
                                            "(signs, split points or tables differ)" + _spanning(ev, n)))
            for n in outermost(unmatched)]


def _spanning(ev: LaneEvaluator, node: fx.Node) -> str:
    inner = ev.memo[node].inner
    return "" if len(inner) == 1 else f"; its value spans the axes {list(inner)} (x or a table a view across them)"


# -- the rewrite --------------------------------------------------------------

def _region(site: ForwardRopeMatch) -> List[fx.Node]:
    ev = site.ev
    role_ids = {site.x[0], site.cos[0], site.sin[0]}
    leaves = {ev.leaves[i] for i in role_ids}
    return region_of([site.y], lambda n: n in ev.interpreted and n not in leaves)


def _identity(ev: LaneEvaluator, role: Role):
    return [{((role[0], p),): 1} for p in role[1]]


def _role_node(ev: LaneEvaluator, region, role: Role, like) -> Optional[fx.Node]:
    """The node the site reads that holds ``role`` exactly (position by position) in a shape
    ``like`` accepts: the one nearest the output (a table after its ``unsqueeze``, a partial
    rotary's slice of x)."""
    want = _identity(ev, role)
    read = {a for n in region for a in n.all_input_nodes} | set(region)
    found = [n for n in read if ev.memo.get(n) is not None and ev.memo[n].reduction is None
             and not ev.memo[n].complex and ev.memo[n].polys == want and like(shape(n))]
    return max(found) if found else None


def _operands(site: ForwardRopeMatch):
    """(x, cos, sin, the replaced region), or the reason the site cannot fuse."""
    ev, wide = site.ev, _region(site)
    y_shape = shape(site.y)
    roles = [_role_node(ev, wide, site.x, lambda s: same_shape(s, y_shape))] + [
        _role_node(ev, wide, r, lambda s: len(s) <= len(y_shape) and same_shape(s[-1:], y_shape[-1:]))
        for r in (site.cos, site.sin)]
    if None in roles:
        which = ("x", "cos", "sin")[roles.index(None)]
        return (f"no node the site reads holds its {which} whole (a table rebuilt from halves or complex "
                f"parts, x read in pieces): the fused op reads whole tensors")
    region = region_of([site.y], lambda n: n in ev.interpreted and n not in roles)
    shared = outside_users(region, [site.y])
    if shared:
        user = next(u for u in shared[0].users if u not in region)
        return f"intermediate {shared[0].name} has a user outside the rotation ({user.name})"
    foreign = [a for n in region for a in n.all_input_nodes
               if a not in region and a not in roles and shape(a) is not None]
    if foreign:
        return f"the rotation also reads {foreign[0].name}, which is none of x, cos and sin"
    return (*roles, region)


def _memory_order(node: fx.Node) -> Optional[List[int]]:
    """The axes of ``node``'s value from outermost to innermost in memory (a transposed q is
    BSND in memory though BNSD in shape), the last axis innermost: the order of the leading axes
    whose dense strides equal the value's, compared as expressions (symbolic sizes included,
    no guard); None when no such order exists."""
    v = val(node)
    rank, size = v.dim(), [expression(s) for s in v.shape]
    strides = [expression(s) for s in v.stride()]
    for lead in itertools.permutations(range(rank - 1)):
        order, dense, expected = list(lead) + [rank - 1], 1, [None] * rank
        for axis in reversed(order):
            expected[axis], dense = dense, dense * size[axis]
        if all(static_int(v.shape[d]) == 1 or expected[d] == strides[d] for d in range(rank)):
            return order
    return None


def _permuted(ctx: RuleContext, node: fx.Node, order: List[int]) -> fx.Node:
    """``node`` (right-aligned to ``len(order)`` axes) with its axes in ``order``."""
    for _ in range(len(order) - len(shape(node))):
        node = ctx.edit.call(aten.unsqueeze.default, (node, 0))
    return node if order == sorted(order) else ctx.edit.call(aten.permute.default, (node, order))


def emit(ctx: RuleContext, site: ForwardRopeMatch):
    """One site rewritten into one fused call (a :class:`Site`), or a :class:`Miss` saying why not.
    The op's output is contiguous: it is called on x, cos and sin with their axes in the memory
    order of the output it replaces (a transposed q: BSND with 1S1D tables), and its result is
    permuted back, so the program's views of that output keep their strides."""
    operands = _operands(site)
    if isinstance(operands, str):
        return Miss(OP.name, site.y.name, operands)
    x, cos, sin, region = operands
    order = _memory_order(site.y)
    if order is None:
        return Miss(OP.name, site.y.name, f"the output's strides {list(val(site.y).stride())} are no dense layout "
                                          f"of its shape with the rotated axis innermost")
    compute = exact_common_dtype((dtype(x), dtype(cos), dtype(sin), kept_precision(site.y)))
    laid = [tuple(shape(x)[d] for d in order), tuple(([1] * (len(order) - len(shape(cos))) + list(shape(cos)))[d]
                                                      for d in order)]
    problem = rounding_problem(site.ev, {"y": site.y}, [x, cos, sin]) or rope_target_problem(
        ctx.target, site.mode, laid[0], laid[1], False, compute)
    if problem is not None:
        return Miss(OP.name, site.y.name, problem)
    with Insertion(ctx.graph, last_of(ctx.graph, [x, cos, sin])) as inserted:
        done = _emit_call(ctx, site, x, cos, sin, compute, order)
        if isinstance(done, Miss):
            return done
    fused, replacement = done
    added = inserted.nodes()
    _as_forward_work(added, site.y)
    return commit(ctx.edit, OP.name, ROPE_MODES[site.mode], region, {"y": site.y}, {site.y: replacement},
                  {"x": x, "cos": cos, "sin": sin}, added, fused)


def _emit_call(ctx: RuleContext, site: ForwardRopeMatch, x, cos, sin, compute, order):
    operands = [_permuted(ctx, ctx.edit.cast(x, compute), order)]
    for table, sign in zip((cos, sin), site.signs):
        table = _permuted(ctx, ctx.edit.cast(table, compute), order)
        operands.append(table if sign == 1 else ctx.edit.call(aten.neg.default, (table,)))
    problem = input_problem(ctx.edit.fake_mode, OP.check_inputs, *operands, site.mode)
    if problem is not None:
        return Miss(OP.name, site.y.name, problem)
    fused = ctx.edit.call(OP.overload, (*operands, site.mode))
    inverse = sorted(range(len(order)), key=order.__getitem__)
    back = fused if order == sorted(order) else ctx.edit.call(aten.permute.default, (fused, inverse))
    replacement = replacement_of(ctx.edit, back, site.y)
    if not same_layout(replacement, site.y):
        return Miss(OP.name, site.y.name, f"the output's strides {list(val(site.y).stride())} are no dense layout "
                                          f"of its shape with the rotated axis innermost")
    return fused, replacement


def unexplained(graph: fx.Graph, provenance, misses: List[Miss]) -> List[Miss]:
    """No silent misses: a fused ``rotary_position_embedding_grad`` that no fused forward and no
    recorded forward miss accounts for is a rotation whose forward matched no form
    (:mod:`.pairing`); each a miss named by the backward node, saying what its forward is."""
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


class RopeForwardRule(FusionRule):
    """RoPE's forward on the joint graph, matched by value in per-position polynomials
    (:mod:`.lanes`), rewritten into ``rotary_position_embedding``."""

    stage = "joint"
    domain = "lanes"
    ops = (OP,)
    enabled_by_default = True
    #: each rotation the model runs is one forward site, the backward's site
    site_probe = SiteProbe(kind=OP.option, same_sites_as="rope")
    forms = tuple(Form(*row) for row in (
        ("forward on the joint graph, modes 0 to 3 (2 and 3 on Ascend 950 and `generic`), a table negated as "
         "a whole, partial rotary (the slice of x the rotation reads), tables broadcast from 11SD/1S1D/...",
         "HF `apply_rotary_pos_emb`, GPT-J, DeepSeek-V3, nanochat"),
    ))

    def find(self, graph: fx.Graph, ctx: RuleContext) -> RoundReport:
        return find_sites(graph, ctx)

    def emit(self, ctx: RuleContext, match: ForwardRopeMatch):
        return emit(ctx, match)

    def unexplained(self, graph: fx.Graph, ctx: RuleContext, misses) -> List[Miss]:
        return unexplained(graph, ctx.provenance, misses)
