"""Fuse SwiGLU's forward on the joint graph into ``npu_fusion.swiglu``.

Unfused, as AOTAutograd writes Phi-3's MLP (``gate, up = gate_up_proj(h).chunk(2, -1)``)::

    gate, up = getitem(split(x, H, -1), 0), getitem(split(x, H, -1), 1)
    y = mul(silu(gate), up)

Fused::

    y = npu_fusion.swiglu(x, -1)

How a site is found, by value in the lanes domain (:class:`~.lanes.LaneEvaluator`: exact
per-position polynomials of leaf elements over the last axis, whatever slices, splits, chunks,
views and float casts spell them): ``silu`` is a leaf of the domain, and a site is a ``silu``
node whose argument is, position by position, the first half ``x[0:H]`` of a leaf x of width
``2H``, and a node y whose value is ``silu[i] * x[H + i]`` at each position i. A gated product
whose gate and up read one leaf otherwise (the halves swapped, silu on the second half, an odd
width, unequal pieces) is a near miss; a gate and an up from two projections (Llama's MLP) read
two leaves and are no site at all (concatenating the two weights is a change of the model the
pass does not make). Casts are identities of the domain; :func:`~.evaluator.rounding_problem`
refuses a site that rounds inside more coarsely than it keeps y, and the fused op's result,
in x's dtype, must hold the precision y is kept at (a float32 product of bf16 halves kept in
float32 is refused). Only views, splits, slices and casts may lie between x and the product, and
selects, joins and permutations of the axes after x's leading ones (``view(..., 2, H).unbind(-2)``),
never a permutation or broadcast of the leading axes, so the fused op's output is y's elements in
y's order. The gate of a view of x split along its last axis makes the view x (``swiglu(view, -1)``);
where the domain reads no piece of a leaf in the gate, the value its split cuts is x (a ``[..., 2, H]``
one read over its two rows, viewed ``[..., 2H]`` for the fused op: :mod:`.swiglu_views`).

Pairing: the rule runs after the backward rule (:mod:`.swiglu_grad`) in each round; a forward
whose ``silu`` or halves a decomposed backward still reads stays as it is this round (a miss,
decided again in the next), so the backward rule always sees the forward it was written for. The
backward's verdict on a site (:class:`~.context.SiteJudgements`, keyed by x) binds the forward: a
site the backward refused is refused for the same reason both ways.
The fused backward reads x itself, so the partition saves x instead of the halves and silu.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch.fx as fx

from ..lowering import FUSED_OPS
from ..lowering.ops.swiglu import OP, swiglu_target_problem
from ..lowering.ops.swiglu_grad import OP as GRAD_OP
from .evaluator import Unsupported, saved_by_the_forward
from .lanes import LaneEvaluator
from .nodes import aten, calls_to, gradient_dependent, is_float_cast, shape
from .pairing import site_key
from .rewrite import Insertion, Miss, RuleContext, as_forward_work, commit, emit_fused_op
from .rule import Form, FusionRule, RoundReport, SiteProbe

from .swiglu_halves import (DECOMPOSED_SILU_TARGETS, dead_region, decomposed_silu_misses, glu_problem,
                            is_product_value, is_silu, numel, order_problem, outermost_cast, piece_of,
                            precision_problem, rows_problem, scaled_from, scaled_users, unread_glu_problem)
from .swiglu_views import (flat_shape, gate_unread, leaf_axes, swiglu_evaluator, through_casts, unnamed_size_problem,
                           view_leaf_evaluator, viewable_problem)


@dataclasses.dataclass
class SwigluMatch:
    """A forward site: ``y`` (the outermost cast of the product) is ``silu(x[:H]) * x[H:]``."""
    y: fx.Node
    product: fx.Node
    silu: fx.Node
    x: fx.Node
    #: x's trailing axes the fused op reads as its last (2: a ``[..., 2, H]`` view whose rows are the halves)
    axes: int = 1

    @property
    def dx(self) -> fx.Node:
        """The node a transaction runs under (the rules' common key)."""
        return self.y


def _region(product: fx.Node, x: fx.Node) -> List[fx.Node]:
    """The nodes from x (exclusive) to the product (inclusive)."""
    region, stack = [], [product]
    while stack:
        node = stack.pop()
        if node is x or node in region or node.op != "call_function":
            continue
        region.append(node)
        stack.extend(node.all_input_nodes)
    return region


def _gated_products(silu: fx.Node) -> List[fx.Node]:
    """The products that read ``silu`` (through float casts) as a factor."""
    out, stack = [], [silu]
    while stack:
        node = stack.pop()
        for user in node.users:
            if is_float_cast(user):
                stack.append(user)
            elif user.target is aten.mul.Tensor:
                out.append(user)
    return out


def _examine(ev: LaneEvaluator, silu: fx.Node, gradient) -> Tuple[List[SwigluMatch], List[Miss]]:
    gate = piece_of(ev, silu.args[0])
    if gate_unread(gate, silu.args[0]):
        over_view = view_leaf_evaluator(ev, silu.args[0])
        if over_view is not None:
            return _examine(over_view, silu, gradient)
        if gate is None:
            return [], []
    axes = leaf_axes(ev, gate.x)
    silu_v = ev.value(silu)
    if silu_v is None or silu_v.poly_at(0) != {((ev.leaf_id(silu), 0),): 1}:
        return [], []
    matches, misses = [], []
    for product in _gated_products(silu):
        if gradient is not None and product in gradient:
            continue
        other = next((a for a in product.args[:2] if isinstance(a, fx.Node) and through_casts(a) is not silu
                      and not _reads_silu(a, silu)), None)
        up = piece_of(ev, other)
        if up is None or up.lid != gate.lid:
            continue  # a gate and an up of two projections: no site
        problem = glu_problem(gate, up)
        y = outermost_cast(product)
        if problem is None:
            v = ev.value(product)
            if v is None or not is_product_value(v, (ev.leaf_id(silu), 0), gate.lid, gate.size, gate.size):
                problem = rows_problem(ev, silu.args[0], other) or \
                    f"{product.name} is not silu(gate) * up position by position"
        problem = problem or order_problem([product], {gate.x}, [(numel(product), numel(gate.x) // 2)],
                                           shape(gate.x)[:len(shape(gate.x)) - axes])
        if problem is not None:
            misses.append(Miss(OP.name, y.name, problem))
        else:
            matches.append(SwigluMatch(y, product, silu, gate.x, axes))
    return matches, misses


def _reads_silu(node: fx.Node, silu: fx.Node) -> bool:
    return through_casts(node) is silu


def find_sites(graph: fx.Graph, ctx: RuleContext) -> RoundReport:
    """This round's forward sites and near misses (nothing rewritten)."""
    ev = swiglu_evaluator()
    gradient = gradient_dependent(graph)
    report = RoundReport()
    for silu in [n for n in graph.nodes if is_silu(n) and (gradient is None or n not in gradient)]:
        found = ctx.examine(silu, _examine, ev, silu, gradient)
        if found is not None:
            report.matches += found[0]
            report.misses += found[1]
    ctx.evaluated(ev)
    return report


def _pairing_problem(match: SwigluMatch, path, gradient, provenance=None, backward_fused=False) -> Optional[str]:
    """Why the forward waits: a decomposed backward still reads one of its intermediates.

    Once its own backward is fused (``backward_fused``), a backward that reads a half is another
    user's (``gate * gate``'s), which reads the half the split still computes: only a backward that
    reads silu keeps the forward waiting."""
    fused = {op.overload for op in FUSED_OPS}
    for node in path:
        if through_casts(node) is match.product:  # y: the program's later readers read the fused y
            continue
        others_only = backward_fused and not _reads_silu(node, match.silu)
        for user in node.users:
            if saved_by_the_forward(provenance, user):
                return (f"the forward saves {node.name} for its backward (a training forward after the partition): "
                        f"the fused op would compute it again beside it; SwiGLU fuses on the joint graph")
            if user not in path and gradient is not None and user in gradient and user.target not in fused and \
                    user.op != "output" and not others_only:  # the joint graph's outputs are no backward
                return (f"{user.name}, a decomposed backward, reads {node.name}: the forward fuses once its backward "
                        f"is a fused swiglu_grad (option swiglu)")
    return None



def emit(ctx: RuleContext, match: SwigluMatch):
    """One forward site rewritten into ``swiglu(x, -1)`` (a :class:`Site`), or a :class:`Miss`."""
    graph = ctx.graph
    gradient = gradient_dependent(graph)
    path = _region(match.y, match.x)
    ev = swiglu_evaluator((match.x,), {match.x: match.axes})
    ev.value(match.y)
    # the verdict its backward was given first (the site's), then its own roundings, then its pairing
    key = site_key(GRAD_OP.option, match.x)
    problem = ctx.context.judgements.binding(key) or \
        precision_problem(ev, match.y, "y", [match.x, match.x], [match.silu]) or \
        _pairing_problem(match, path, gradient, ctx.provenance, ctx.context.judgements.accepted(key))
    problem = problem or swiglu_target_problem(ctx.target, OP.ge_op, tuple(flat_shape(match.x, match.axes))) or \
        viewable_problem(match.x, match.axes)
    if problem is not None:
        return Miss(OP.name, match.y.name, problem)
    try:
        with Insertion(graph, match.x) as inserted:
            x = match.x if match.axes == 1 else \
                ctx.edit.call(aten.view.default, (match.x, flat_shape(match.x, match.axes)))
            emitted = emit_fused_op(ctx, OP, match.y, (x, -1), {"y": match.y})
            if isinstance(emitted, Miss):
                return emitted
            fused, replacements = emitted
    except Unsupported as exc:  # a view to a symbolic size the graph names nowhere
        return Miss(OP.name, match.y.name, unnamed_size_problem(exc))
    added = inserted.nodes()
    as_forward_work(added, match.product)
    return commit(ctx.edit, OP.name, None, dead_region([match.y], {match.x}), {"y": match.y}, replacements,
                  {"x": match.x}, added, fused)



def unread_forward_misses(graph: fx.Graph, misses) -> List[Miss]:
    """One miss per forward SiLU that gates another piece of its own split and no form read.

    The forward's no-silent-misses check: the lanes domain (:func:`_examine`) finds neither a
    site nor a near miss there, and :func:`unread_glu_problem` says why."""
    ev, gradient = swiglu_evaluator(), gradient_dependent(graph)
    seen, out = {m.node for m in misses}, []
    for silu in [n for n in calls_to(graph, aten.silu.default) if gradient is None or n not in gradient]:
        matches, near = _examine(ev, silu, gradient)
        if matches or near:
            continue
        for product in scaled_users(silu):
            other = next((a for a in product.args[:2] if not scaled_from(a, silu)), None)
            problem = unread_glu_problem(ev, silu.args[0], other) if other is not None else None
            if problem is not None and product.name not in seen:
                seen.add(product.name)
                out.append(Miss(OP.name, product.name, problem))
                break
    return out


class SwigluForwardRule(FusionRule):
    """SwiGLU's forward on the joint graph (or an inference graph), matched by value in the lanes
    domain, rewritten into ``swiglu`` once no decomposed backward reads its intermediates."""

    stage = "joint"
    reads_whole = ("silu",)
    domain = "lanes"
    ops = (OP,)
    site_probe = SiteProbe(kind=OP.option, same_sites_as=GRAD_OP.option)
    forms = tuple(Form(*row) for row in (
        ("forward on the joint graph, after its fused backward: `silu(gate) * up` of the two halves of one "
         "projection (`chunk`, `split`, slices), the product in the halves' dtype or upcast and cast back",
         "Phi-3, GLM-4 (`gate_up_proj`), Megatron fc1 with gated linear units"),
        ("forward of the viewed projections and of halves read besides the product (the backward rule's "
         "forms): `swiglu` over the projection or the view whose halves they are; a half the model returns stays",
         "MLPs that view gate_up_proj's output, or return or reuse its halves"),
    ))

    def find(self, graph: fx.Graph, ctx: RuleContext) -> RoundReport:
        return find_sites(graph, ctx)

    def emit(self, ctx: RuleContext, match: SwigluMatch):
        return emit(ctx, match)

    def unexplained(self, graph: fx.Graph, ctx: RuleContext, misses) -> List[Miss]:
        """A SwiGLU-like forward no form read, and a decomposed SiLU of a half in the forward: one miss each.

        The forward's own miss, on a joint graph too (its backward records the backward's), so
        each direction of the site ends fused or as one recorded miss."""
        unread = unread_forward_misses(graph, misses)
        gradient = gradient_dependent(graph)
        # the forward calls among those the decomposed SiLUs' scan reads (it reads no other)
        forward = None if gradient is None else {n for n in calls_to(graph, *DECOMPOSED_SILU_TARGETS)
                                                 if n not in gradient}
        return unread + decomposed_silu_misses(graph, OP.name, [*misses, *unread], forward)
