"""Fuse SwiGLU's backward into ``npu_fusion.swiglu_grad``.

Unfused, as AOTAutograd writes the backward of ``silu(gate) * up`` with ``gate, up = x.chunk(2, -1)``::

    d_gate = silu_backward(mul(dy, up), gate)
    d_up   = mul(dy, silu(gate))
    dx     = cat([d_gate, d_up], -1)          (slices: slice_backward of each, added)

Fused::

    dx = npu_fusion.swiglu_grad(dy, x, -1)

How a site is found, by value in the lanes domain (:mod:`.swiglu` holds what the forward and
backward rules share): a candidate is a ``silu_backward`` node (a leaf of the domain) whose input
is a piece of a leaf x and whose incoming gradient is ``dy[i] * x[j(i)]`` of the same x. It is a
site when the input is x's first half, ``j(i) = H + i`` (x's second half, the up) and some node
downstream (dx) holds, position by position, the ``silu_backward`` lanes in its first half and
``dy[i] * silu(x[:H])[i]`` in its second. Where no node holds that dx (the gate or the up has other
users, whose gradients autograd adds to the half before the halves join), the site is the two
halves' gradients, ``silu_backward`` and a node holding ``dy[i] * silu(x[:H])[i]``: each is replaced
by its half of the fused dx and the sums stay. A candidate whose pieces are not the two halves in
order is a near miss. A gate and an up of two projections read two leaves: no candidate. Where
the gate is no piece of the projection but of a view of it split along its last axis
(``view(..., N, 2 * I).chunk(2, -1)``), that view is x, and so is the value a split cuts where the domain
read no piece of a leaf in the gate (:func:`~.swiglu_views.view_leaf_evaluator`). The rounding rules are the forward's
(:func:`~.swiglu_halves.precision_problem`); the fused op runs in the narrowest dtype that holds dy and x.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch.fx as fx

from ..lowering.ops.swiglu_grad import OP
from ..lowering.ops.swiglu import OP as FORWARD_OP, swiglu_target_problem
from ..lowering.sizes import same_shape, static_int
from .evaluator import JointProvenance, Unsupported
from .lanes import LaneEvaluator
from .nodes import aten, calls_to, dtype, gradient_dependent, is_float_cast, last_of, shape, val
from .pairing import backwards_of_forward_misses, site_key
from .rewrite import (Insertion, Miss, RuleContext, commit, emit_fused_op, exact_common_dtype, in_layout_of,
                      replacement_of)
from .rule import Form, FusionRule, RoundReport, SiteProbe
from .swiglu_halves import (Piece, dead_region, decomposed_silu_misses, decomposed_silu_operand, glu_problem,
                            is_silu, numel, order_problem, piece_of, precision_problem, run_monomials,
                            unread_glu_problem)
from .swiglu_views import (flat_shape, gate_unread, leaf_axes, swiglu_evaluator, through_casts, unnamed_size_problem,
                           view_leaf_evaluator, viewable_problem)


#: how far below the silu_backward node dx may lie (cat, slice_backward and add, casts, a view)
DX_DEPTH = 6


class GradMatch:
    """A backward site: ``dx_node`` is the gradient of x (``x``), ``dy`` the incoming gradient."""

    def __init__(self, dx_node: fx.Node, dy: fx.Node, x: fx.Node, silu_backward: fx.Node, halves=None, axes=1):
        self.dx_node, self.dy, self.x, self.silu_backward = dx_node, dy, x, silu_backward
        #: x's trailing axes the fused op reads as its last (2: a ``[..., 2, H]`` view whose rows are the halves)
        self.axes = axes
        #: ``(d_gate, d_up)`` where autograd adds another gradient to a half before joining them (the
        #: gate or the up has other users): the two halves' gradients, each replaced by its half of
        #: the fused dx; None where ``dx_node`` holds the whole dx
        self.halves: Optional[Tuple[fx.Node, fx.Node]] = halves

    @property
    def dx(self) -> fx.Node:
        """The node a transaction runs under (the rules' common key)."""
        return self.dx_node


def _factors(ev: LaneEvaluator, node) -> Optional[List[Tuple[Tuple[int, int], Tuple[int, int]]]]:
    """Each position of ``node`` as one product of two leaf elements (coefficient 1), or None."""
    v = ev.value(node) if isinstance(node, fx.Node) else None
    if v is None or v.reduction is not None or v.complex or not v.inner:
        return None
    out = []
    for poly in v.polys:
        if len(poly) != 1:
            return None
        (mono, coef), = poly.items()
        if coef != 1 or len(mono) != 2:
            return None
        out.append(mono)
    return out


def _up_and_dy(ev: LaneEvaluator, grad: fx.Node, gate: Piece) -> Optional[Tuple[Piece, Tuple[int, int]]]:
    """The up (a piece of the gate's x) and dy (leaf id, start) of ``grad = dy * up``, or None."""
    v = ev.value(grad) if isinstance(grad, fx.Node) else None
    if v is None or v.reduction is not None or v.complex or not v.inner:
        return None
    runs = run_monomials(v)
    if runs is not None:  # once a run: position i reads (up leaf, i + o) * (dy leaf, i + o'), the same o, o' in all
        if math.prod(v.inner) != gate.size:
            return None
        pairs = set()
        for _, _, mono in runs:
            ups = [u for u in mono if u[0] == gate.lid]
            if len(mono) != 2 or len(ups) != 1:
                return None
            pairs.add((ups[0], next(u for u in mono if u != ups[0])))
        if len(pairs) != 1:
            return None
        (up_lid, up_start), dy = pairs.pop()
        return Piece(gate.x, gate.lid, up_start, gate.size, gate.width), dy
    factors = _factors(ev, grad)
    if factors is None or len(factors) != gate.size:
        return None
    ups = [[v for v in mono if v[0] == gate.lid] for mono in factors]
    if any(len(u) != 1 for u in ups):
        return None
    dys = [next(v for v in mono if v != u[0]) for mono, u in zip(factors, ups)]
    up_start, dy = ups[0][0][1], dys[0]
    if any(u[0] != (gate.lid, up_start + i) for i, u in enumerate(ups)) or \
            any(d != (dy[0], dy[1] + i) for i, d in enumerate(dys)):
        return None
    return Piece(gate.x, gate.lid, up_start, gate.size, gate.width), dy


def _is_dx(ev: LaneEvaluator, node: fx.Node, sb_lid: int, dy: Tuple[int, int], gate: Piece) -> bool:
    """Whether ``node`` holds ``cat(silu_backward, dy * silu(gate))`` position by position."""
    v = ev.value(node)
    h = gate.size
    if v is None or v.reduction is not None or v.complex or not v.inner or math.prod(v.inner) != 2 * h:
        return False
    silu_lids = _dx_silu_leaves(v, sb_lid, dy, h)
    if silu_lids is None or len(silu_lids) != 1:
        return False
    silu = ev.leaves[silu_lids.pop()]
    return is_silu(silu) and piece_of(ev, silu.args[0]) == gate


def _dx_silu_leaves(v, sb_lid: int, dy: Tuple[int, int], h: int) -> Optional[set]:
    """The leaves read as silu(gate) in ``v``'s second half where ``v`` is ``cat(silu_backward, dy * s)``
    position by position (the first half ``sb_lid``'s elements, the second ``dy[i] * s[i]``), else None.

    Once a run where the halves are runs of their own: position ``p`` reads a template's ``(leaf, offset)``
    as ``(leaf, p + offset)``, so the first half's template is ``sb_lid`` at offset 0 and the second
    half's, at ``p = h + i``, ``dy`` at offset ``dy[1] - h`` times a leaf at offset ``-h``."""
    if v.pieces is not None and all(hi <= h or lo >= h for lo, hi, _ in v.pieces):
        silu_lids = set()
        for lo, hi, template in v.pieces:
            if hi <= h:
                if template != {((sb_lid, 0),): 1}:
                    return None
                continue
            if len(template) != 1:
                return None
            (mono, coef), = template.items()
            others = [u for u in mono if u != (dy[0], dy[1] - h)]
            if coef != 1 or len(mono) != 2 or len(others) != 1 or others[0][1] != -h:
                return None
            silu_lids.add(others[0][0])
        return silu_lids
    if any(v.polys[i] != {((sb_lid, i),): 1} for i in range(h)):
        return None
    silu_lids = set()
    for i in range(h):
        poly = v.polys[h + i]
        if len(poly) != 1:
            return None
        (mono, coef), = poly.items()
        others = [u for u in mono if u != (dy[0], dy[1] + i)]
        if coef != 1 or len(mono) != 2 or len(others) != 1 or others[0][1] != i:
            return None
        silu_lids.add(others[0][0])
    return silu_lids


def _downstream(node: fx.Node, depth: int) -> List[fx.Node]:
    """The nodes below ``node`` within ``depth`` users, nearest first."""
    out, frontier, seen = [], [node], {node}
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u not in seen and u.op == "call_function":
                    seen.add(u)
                    nxt.append(u)
        out += nxt
        frontier = nxt
    return out


def _examine(ev: LaneEvaluator, sb: fx.Node):
    """A :class:`GradMatch`, a :class:`Miss`, or None (no SwiGLU candidate) at a silu_backward node."""
    grad, inp = sb.args[:2]
    gate = piece_of(ev, inp)
    if gate_unread(gate, inp):
        over_view = view_leaf_evaluator(ev, inp)
        if over_view is not None:
            return _examine(over_view, sb)
        if gate is None:
            return None
    axes = leaf_axes(ev, gate.x)
    found = _up_and_dy(ev, grad, gate)
    if found is None:
        return None  # dy * up of another projection (Llama's MLP): no candidate
    up, dy = found
    problem = glu_problem(gate, up)
    if problem is not None:
        return Miss(OP.name, sb.name, problem)
    dy_node = ev.leaves[dy[0]]
    dy_value = ev.value(dy_node)
    if dy[1] != 0 or dy_value is None or math.prod(dy_value.inner) != gate.size:
        return Miss(OP.name, sb.name, f"dy ({dy_node.name}) is a piece of a wider value: the fused op reads dy whole")
    sb_value = ev.value(sb)
    if sb_value is None:
        return None
    sb_lid = next(iter(sb_value.poly_at(0)))[0][0]
    dx = next((n for n in _downstream(sb, DX_DEPTH) if _is_dx(ev, n, sb_lid, dy, gate)), None)
    if dx is None:
        d_up = next((n for n in _downstream(dy_node, UP_DEPTH) if _is_up_gradient(ev, n, dy, gate)), None)
        if d_up is None:
            return Miss(OP.name, sb.name, f"no node holds the gradient of {gate.x.name} alone, nor dy * silu(gate), "
                                          f"the up's: the fused op writes one dx, whose halves are these")
        # another gradient of the gate or the up is added to its half before the halves join: the halves
        # of the fused dx replace the two gradients the product contributes, and the sums stay as they are
        return GradMatch(_outermost_cast(sb), dy_node, gate.x, sb, (_outermost_cast(sb), _outermost_cast(d_up)), axes)
    return GradMatch(_outermost_cast(dx), dy_node, gate.x, sb, axes=axes)


#: how far below dy the up's gradient ``dy * silu(gate)`` may lie (a cast of dy, the product, its cast)
UP_DEPTH = 3


def _outermost_cast(node: fx.Node) -> fx.Node:
    """``node`` past the float casts that are its only users (where the program keeps its value)."""
    while len(node.users) == 1 and is_float_cast(next(iter(node.users))):
        node = next(iter(node.users))
    return node


def _is_up_gradient(ev: LaneEvaluator, node: fx.Node, dy: Tuple[int, int], gate: Piece) -> bool:
    """Whether ``node`` holds ``dy[i] * silu(gate)[i]`` position by position (the up's gradient)."""
    factors = _factors(ev, node)
    if factors is None or len(factors) != gate.size:
        return False
    silus = set()
    for i, mono in enumerate(factors):
        others = [u for u in mono if u != (dy[0], dy[1] + i)]
        if len(others) != 1 or others[0][1] != i:
            return False
        silus.add(others[0][0])
    if len(silus) != 1:
        return False
    silu = ev.leaves[silus.pop()]
    return is_silu(silu) and piece_of(ev, silu.args[0]) == gate


def _order_problem(match: GradMatch) -> Optional[str]:
    """Why the backward's nodes may move elements across the leading axes, or None."""
    outputs = list(match.halves or [match.dx_node])
    return order_problem(outputs, {match.x, match.dy},
                         [(len(outputs) * numel(o), numel(match.x)) for o in outputs] +
                         [(2 * numel(match.dy), numel(match.x))], shape(match.x)[:len(shape(match.x)) - match.axes])


def _split_source(provenance, node) -> Optional[fx.Node]:
    """The forward node a saved ``node`` is a ``getitem`` of (a split or chunk), or None."""
    if not (isinstance(node, fx.Node) and node.op == "placeholder") or provenance is None:
        return None
    definition = provenance.forward_definition(node)
    if definition is None or getattr(definition.target, "__name__", "") != "getitem":
        return None
    return definition.args[0]


def _saved_halves_miss(provenance, sb: fx.Node) -> Optional[Miss]:
    """On a backward graph alone: a miss where the gate and the up are two saved pieces of one split.

    On a backward graph with its forward graph (torchair's post-partition hook), the gate and the up
    are two saved tensors, and x, which the fused op reads, was not saved: a miss where their
    forward definitions are two outputs of one split or chunk, so the site is not silent."""
    if isinstance(provenance, JointProvenance):
        return None
    grad, inp = sb.args[:2]
    source = _split_source(provenance, inp)
    factors = grad.args[:2] if isinstance(grad, fx.Node) and grad.target is aten.mul.Tensor else ()
    if source is None or not any(_split_source(provenance, f) is source for f in factors if f is not inp):
        return None
    return Miss(OP.name, sb.name, f"the gate and the up are two saved outputs of {source.name} and x is not "
                                  f"saved: on a backward graph alone swiglu_grad cannot read x (the npu_fusion "
                                  f"backend and install_inductor fuse it on the joint graph)")


def _saved_halves_decomposed_misses(graph: fx.Graph, provenance, misses) -> List[Miss]:
    """On a backward graph alone: a miss where a decomposed SiLU's backward reads two saved pieces of one split.

    torchair (the wheels' torchair has no converter for ``aten.silu_backward``) needs SiLU's
    backward decomposed (``custom_decompositions``), and the backward then reads ``sigmoid`` of
    the saved gate beside the saved up: the site :func:`_saved_halves_miss` records for a whole
    ``silu_backward``, one miss per split, so it is not silent."""
    if provenance is None or isinstance(provenance, JointProvenance) or provenance.forward is None:
        return []
    saved = {}
    for node in graph.nodes:
        source = _split_source(provenance, node)
        if source is not None:
            saved.setdefault(source, set()).add(node)
    seen, out = {m.node for m in misses}, []
    for node in graph.nodes:
        operand = decomposed_silu_operand(node)
        source = _split_source(provenance, through_casts(operand)) if isinstance(operand, fx.Node) else None
        pieces = source.meta.get("val") if source is not None else None
        if source is None or len(saved[source]) < 2 or source.name in seen or not (
                isinstance(pieces, (list, tuple)) and len(pieces) == 2 and same_shape(pieces[0].shape, pieces[1].shape)):
            continue  # two halves of one split, as a SwiGLU reads
        seen.add(source.name)
        out.append(Miss(OP.name, node.name, f"the gate and the up are two saved outputs of {source.name} (SiLU's "
                                            f"backward decomposed, {node.name}) and x is not saved: on a backward "
                                            f"graph alone swiglu_grad cannot read x (the npu_fusion backend and "
                                            f"install_inductor fuse it on the joint graph)"))
    return out


def find_sites(graph: fx.Graph, ctx: RuleContext) -> RoundReport:
    """This round's backward sites and near misses (nothing rewritten)."""
    gradient = gradient_dependent(graph)
    ev = swiglu_evaluator()
    report = RoundReport()
    for sb in [n for n in graph.nodes if n.op == "call_function" and n.target is aten.silu_backward.default
               and (gradient is None or n in gradient)]:
        found = ctx.examine(sb, _examine, ev, sb) or ctx.examine(sb, _saved_halves_miss, ctx.provenance, sb)
        if isinstance(found, Miss):
            report.misses.append(found)
        elif found is not None:
            report.matches.append(found)
    ctx.evaluated(ev)
    return report


def emit(ctx: RuleContext, match: GradMatch):
    """One backward site rewritten into ``swiglu_grad(dy, x, -1)`` (a :class:`Site`), or a :class:`Miss`."""
    graph, x, dy, dx = ctx.graph, match.x, match.dy, match.dx_node
    ev = swiglu_evaluator((x,), {x: match.axes})
    x_shape = flat_shape(x, match.axes)  # the [..., 2H] the fused op reads
    outputs = dict(zip(("dx_gate", "dx_up"), match.halves)) if match.halves else {"dx": dx}
    for output in outputs.values():
        ev.value(output)
    problem = _order_problem(match)
    compute = exact_common_dtype([dtype(dy), dtype(x)])
    silus = [n for n in ev.leaves if is_silu(n)]
    for name, output in outputs.items():
        problem = problem or precision_problem(ev, output, name, [dy, x], [match.silu_backward, *silus])
    problem = problem or swiglu_target_problem(ctx.target, OP.ge_op, tuple(x_shape)) or viewable_problem(x, match.axes)
    lead = list(shape(dy)[:-1])
    if problem is None and not same_shape(x_shape[:-1], lead) and not val(x).is_contiguous():
        problem = f"{x.name} is not contiguous: it cannot be viewed in dy's leading shape {lead}"
    # the site's verdict binds its forward (which waits for a fused backward): one reason both ways
    if problem is not None:
        ctx.context.judgements.record(site_key(OP.option, x), problem)
        return Miss(OP.name, dx.name, problem)
    try:
        with Insertion(graph, last_of(graph, [dy, x])) as inserted:
            x_in = x if same_shape(x_shape[:-1], lead) and match.axes == 1 else \
                ctx.edit.call(aten.view.default, (x, lead + [x_shape[-1]]))
            operands = (ctx.edit.cast(dy, compute), ctx.edit.cast(x_in, compute), -1)
            emitted = emit_fused_op(ctx, OP, dx, operands, {} if match.halves else {"dx": dx})
            if isinstance(emitted, Miss):
                ctx.context.judgements.record(site_key(OP.option, x), None)
                return emitted
            fused, replacements = emitted
            for i, half in enumerate(match.halves or ()):  # each half of the fused dx where the program keeps it
                h = static_int(x_shape[-1]) // 2
                piece = ctx.edit.call(aten.slice.Tensor, (fused, -1, i * h, (i + 1) * h))
                replacements[half] = in_layout_of(ctx.edit, replacement_of(ctx.edit, piece, half), half)
    except Unsupported as exc:  # a view to a symbolic size the graph names nowhere
        ctx.context.judgements.record(site_key(OP.option, x), unnamed_size_problem(exc))
        return Miss(OP.name, dx.name, unnamed_size_problem(exc))
    ctx.context.judgements.record(site_key(OP.option, x), None)
    return commit(ctx.edit, OP.name, None, dead_region(list(outputs.values()), {x, dy}), outputs, replacements,
                  {"dy": dy, "x": x}, inserted.nodes(), fused)


def unread_backward_misses(graph: fx.Graph, ctx: RuleContext, misses) -> List[Miss]:
    """One miss per ``silu_backward`` left of two pieces of one split that no form read (:func:`~.swiglu.unread_glu_problem`)."""
    gradient = gradient_dependent(graph)
    ev = swiglu_evaluator()
    seen, out = {m.node for m in misses}, []
    for sb in [n for n in calls_to(graph, aten.silu_backward.default)
               if (gradient is None or n in gradient) and n.name not in seen]:
        if _examine(ev, sb) is not None or _saved_halves_miss(ctx.provenance, sb) is not None:
            continue  # a site or a near miss, recorded when the rule found it
        problem = unread_glu_problem(ev, sb.args[1], sb.args[0])
        if problem is not None:
            out.append(Miss(OP.name, sb.name, problem))
    return out


class SwigluGradRule(FusionRule):
    """SwiGLU's backward, matched by value in the lanes domain, rewritten into ``swiglu_grad``."""

    stage = "backward"
    reads_whole = ("silu", "silu_backward")
    domain = "lanes"
    ops = (OP,)
    #: a module whose forward calls one gate_up projection (Phi-3's and GLM-4's MLPs) or indexes one
    #: per expert (transformers' MoE experts); each call of its gate activation is a site
    site_probe = SiteProbe(kind=OP.option, source=OP.counted_site.gated_source)
    forms = tuple(Form(*row) for row in (
        ("`silu(gate) * up` of the two halves of one projection: `chunk(2, -1)`, `split`, slices, "
         "upcast to float32 and cast back; dx joined by `cat` or by `slice_backward` and `add`",
         "Phi-3, GLM-4 (`gate_up_proj`), Megatron fc1 with gated linear units"),
        ("the projection viewed before its halves: `view(..., 2, I).unbind(-2)` or its selects (the halves of "
         "the projection; the view's two rows, read `[..., 2 * I]`, where a merged leading shape or a bias hides "
         "the projection's), `view(..., N, 2 * I).chunk(2, -1)` (the halves of the view, which the fused op reads)",
         "MLPs that view gate_up_proj's output per half or per head"),
        ("the gate or the up read besides the product (returned, added): the fused dx's halves replace the "
         "product's gradients of the halves, autograd's sums with the other gradients stay",
         "a gate_up_proj whose halves the model also returns or reuses"),
    ))

    def find(self, graph: fx.Graph, ctx: RuleContext) -> RoundReport:
        return find_sites(graph, ctx)

    def emit(self, ctx: RuleContext, match: GradMatch):
        return emit(ctx, match)

    def unexplained(self, graph: fx.Graph, ctx: RuleContext, misses) -> List[Miss]:
        """A SwiGLU-like backward no form read, and a decomposed SiLU of a half of one projection: one miss each."""
        unread = unread_backward_misses(graph, ctx, misses)
        decomposed = decomposed_silu_misses(graph, OP.name, [*misses, *unread])
        found = unread + decomposed + _saved_halves_decomposed_misses(graph, ctx.provenance,
                                                                      [*misses, *unread, *decomposed])
        return found + backwards_of_forward_misses(ctx.context, FORWARD_OP.name, OP, "SwiGLU", [*misses, *found],
                                                   DX_DEPTH)
