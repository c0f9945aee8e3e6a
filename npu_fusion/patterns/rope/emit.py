"""RoPE forward rewrite: operands gathered from the leaves and the site emitted as one ``rotary_position_embedding`` call."""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple

import torch.fx as fx

from ...lowering import ROPE as OP, ROPE_GRAD
from ...lowering.ops.rope_grad import ROPE_MODES
from ...lowering.sizes import same_shape, static_int
from ..evaluator import kept_precision, rounding_problem, saved_by_the_forward
from ..lanes import LaneEvaluator, shape as lane_shape
from ..lane_polys import position_forms
from ..nodes import aten, dtype, last_of, outside_users, region_of, shape, val
from ..rewrite import (Insertion, Miss, RuleContext, commit, exact_common_dtype, in_layout_of, input_problem,
                       replacement_of, as_forward_work)
from ..pairing import site_key
from ..layout import memory_order, permuted, restored, same_layout
from ..rotation import fold_heads, heads_folded, rope_layout_problem, unfold_heads
from .match import ForwardRopeMatch, Role, site_region


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
    ev, wide = site.ev, site_region(site)
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
        if saved_by_the_forward(ctx.provenance, user):
            return (f"the backward reads {shared[0].name}, an intermediate of the rotation this training forward saves "
                    f"for it (a table's gradient reads the rotated half of x), which the fused op does not compute: "
                    f"the partition is fixed here, so the forward stays (backend='npu_fusion' fuses the joint graph)")
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
    :func:`~..evaluator.rounding_problem`; these are the region's inputs, kept for other users (a
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
    ctx.context.judgements.record(site_key(ROPE_GRAD.option, *_leaves(site)[1:]), rounding, by="forward")
    return rounding


def _leaves(site: ForwardRopeMatch) -> List[fx.Node]:
    """The leaves whose elements play x, cos and sin (in that order)."""
    return [site.ev.leaves[role[0]] for role in (site.x, site.cos, site.sin)]


def _precision_problem(site: ForwardRopeMatch, read: fx.Node, operand: fx.Node) -> str:
    """Why the site cannot fuse when it reads a role at two precisions.

    The rounding the program
    does inside the site, judged by :func:`~..evaluator.rounding_problem` against the role leaves as
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
    bound = ctx.context.judgements.binding(site_key(ROPE_GRAD.option, *_leaves(site)[1:]))
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
    as_forward_work(added, site.y)
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
    folded = all(heads_folded(shape(operands[0]), shape(table)) for table in operands[1:])
    if folded:  # a 3-D x whose tables broadcast over its first axis: run as BNSD, the result viewed back
        operands = [fold_heads(ctx.edit, n) for n in operands]
    problem = input_problem(ctx.edit.fake_mode, OP.check_inputs, *operands, site.mode)
    if problem is not None:
        return Miss(OP.name, site.y.name, problem)
    fused = ctx.edit.call(OP.overload, (*operands, site.mode))
    result = unfold_heads(ctx.edit, fused, len(shape(site.y))) if folded else fused
    replacement = in_layout_of(ctx.edit, replacement_of(ctx.edit, restored(ctx.edit, result, order), site.y), site.y)
    if not same_layout(replacement, site.y):
        return Miss(OP.name, site.y.name, f"the output's strides {list(val(site.y).stride())} are no dense layout "
                                          f"of its shape with the rotated axis innermost")
    return fused, replacement
