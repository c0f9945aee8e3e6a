"""RMSNorm forward rewrite: a site paired with its fused backward emitted as one ``rms_norm`` call."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.fx as fx

from ...lowering import FUSED_OPS, RMS_NORM as OP, RMS_NORM_GRAD
from ...lowering.ops.rms_norm_grad import rms_norm_target_problem
from ..nodes import CAST_TARGETS, VIEWS, aten, gradient_dependent, last_of, outside_users, region_of, shape, val
from ..rewrite import Insertion, Miss, RuleContext, commit, emit_fused_op, replacement_of, as_forward_work
from ..evaluator import saved_by_the_forward
from ..fake_values import move_views
from ..layout import memory_order, permuted, same_layout
from ..pairing import site_key
from .sites import ForwardNormMatch, site_dtypes, site_region, root_power, rounds_inside


def _readers(node: fx.Node, region) -> List[fx.Node]:
    """The nodes outside the site that read ``node``, seen through casts, views and detaches (the
    decomposed backward reads rstd through ``detach``; a statistic taken with ``keepdim=False``
    through the site's own ``unsqueeze(-1)``)."""
    copies = CAST_TARGETS | VIEWS
    found, stack, seen = [], [u for u in node.users if u not in region or u.target in copies], set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op == "call_function" and user.target in copies:
            stack.extend(user.users)
        else:
            found.append(user)
    return found


def _unfused_readers(node: fx.Node, region, gradient) -> List[fx.Node]:
    """Backward nodes other than a fused op that read ``node`` from outside the site (:func:`_readers`)."""
    fused_ops = {op.overload for op in FUSED_OPS}
    return [u for u in _readers(node, region) if u.target not in fused_ops and u in gradient]


def _pairing_problem(site: ForwardNormMatch, region, graph: fx.Graph, provenance=None) -> Optional[str]:
    """Why the site cannot fuse yet, or None.

    Why the site cannot fuse yet: a decomposed backward reads its statistic (the forward fuses
    paired with a fused backward, or with none), or, unpaired, a node outside it reads an
    intermediate (a fused dgamma-only backward reads the normalized value as its x). None when
    nothing but the site and fused ops reads its statistic; paired with its fused backward, an
    intermediate another node reads stays (:func:`_kept`), as does one a partitioned training forward
    saves for its backward (:func:`~..evaluator.saved_by_the_forward`: its y and rstd the fused op's)."""
    gradient, fused_ops = gradient_dependent(graph) or set(), {op.overload for op in FUSED_OPS}
    readers = [(n, u) for n in outside_users(region, [site.y, site.rstd]) for u in n.users
               if u not in region and not saved_by_the_forward(provenance, u)]
    decomposed = _unfused_readers(site.rstd, region, gradient)
    paired = _read_by_fused_backward(site.rstd, region)
    if not paired:
        decomposed += [u for _, u in readers if u in gradient and u.target not in fused_ops]
    if decomposed:
        return (f"a decomposed backward node ({decomposed[0].name}) reads the forward's statistic or intermediates "
                f"(its backward is unfused): the forward fuses only where its fused backward reads its statistic")
    if readers and not paired:
        node, user = readers[0]
        return f"intermediate {node.name} has a user outside the norm ({user.name})"
    return None


def _read_by_fused_backward(rstd: fx.Node, region) -> bool:
    """Whether a fused ``rms_norm_grad`` reads ``rstd``.

    A fused ``rms_norm_grad`` reads ``rstd`` (:func:`_readers`): the norm's backward is fused, and
    what of it the rewrite left to the program (a dgamma whose gradient is rounded more coarsely
    than it is kept, torchtitan's Qwen3 q/k norms in bf16) is the program's own."""
    return any(u.target == RMS_NORM_GRAD.overload for u in _readers(rstd, region))


def _kept(site: ForwardNormMatch, region) -> List[fx.Node]:
    """The site's intermediates that a node outside it reads, and what they are computed from.

    The site's intermediates that a node outside it reads, and what they are computed from
    inside it, up to the fused op's outputs: they stay, computing what they computed, from the
    fused op's rstd (the normalized value the program's decomposed dgamma reads)."""
    inside, outputs = set(region), {site.y, site.rstd}
    read_outside = [n for n in region if n not in outputs and any(u not in inside for u in n.users)]
    return region_of(read_outside, lambda n: n in inside and n not in outputs)


def _backward_readers_of_y(site: ForwardNormMatch, graph: fx.Graph, provenance) -> set:
    """The backward nodes, other than fused ops, that read a norm's output y under min-cut.

    Backward nodes other than fused ops that read y itself (a modulation's gradient
    ``sum(dy * y)``, DiT's adaLN ``norm(x) * (1 + scale) + shift``), where min-cut partitions the
    graph: the default partitioner (torchair's) saves y either way, and the program's y kept for
    them would only be computed twice in the forward."""
    if not getattr(provenance, "min_cut", False):
        return set()
    gradient, fused_ops = gradient_dependent(graph) or set(), {op.overload for op in FUSED_OPS}
    return {u for u in site.y.users if u in gradient and u.op == "call_function" and u.target not in fused_ops}


def _late_to_move(late: List[fx.Node], anchor: fx.Node) -> Optional[List[fx.Node]]:
    """The nodes that read y or rstd before the weight is computed, and theirs, to move after the fused op; None if one cannot move.

    The nodes that read the norm's y or rstd before its weight is computed (a partitioned training
    forward's saved ``detach(rstd)`` and kept normalized value, placed before Gemma's
    ``1 + weight``), and the nodes before the weight that read them: pure calls, moved after the
    fused op in graph order, they read its outputs and compute what they computed. None where one
    of them is not a pure call, or the weight reads one."""
    found, stack = set(), list(late)
    while stack:
        node = stack.pop()
        if node in found:
            continue
        if node.op != "call_function" or node.is_impure() or anchor in node.users:
            return None  # or the weight itself is computed from them
        found.add(node)
        stack.extend(u for u in node.users if u < anchor)
    return sorted(found)


def _computing_y(site: ForwardNormMatch, region, readers, anchor: fx.Node) -> List[fx.Node]:
    """Where the backward reads y: y and what computes it from x inside the site, kept for those
    readers and reading the fused rstd. Min-cut recomputes them from x and rstd as it does unfused;
    the opaque fused op's y it would save (twice the activations of a modulated norm). None where
    one of them comes before the fused op (a weight computed after x): all read the fused y then."""
    if not readers:
        return []
    inside = set(region)
    kept = region_of([site.y], lambda n: n in inside and n is not site.rstd)
    return [] if any(n < anchor for n in kept) else kept


def emit(ctx: RuleContext, site: ForwardNormMatch):
    """One site rewritten into one fused call (a :class:`Site`), or a :class:`Miss` saying why not."""
    graph = ctx.graph
    site.x, site.gamma = ctx.current(site.x), ctx.current(site.gamma)
    region = site_region(site)
    # the site's own verdicts first (the one its backward was given, then its roundings), then
    # whether it fuses this round (paired with a fused backward)
    problem = ctx.context.judgements.binding(site_key(RMS_NORM_GRAD.option, site.rstd)) or rounds_inside(site) \
        or _pairing_problem(site, region, graph, ctx.provenance)
    compute, gamma_dtype = site_dtypes(site)
    problem = problem or rms_norm_target_problem(ctx.target, compute, gamma_dtype, shape(site.x), site.ev.k,
                                                  ge_op=OP.ge_op)
    kept = set(_kept(site, region)) if problem is None else set()
    anchor = last_of(graph, [n for n in (site.x, site.gamma) if n is not None])
    readers = _backward_readers_of_y(site, graph, ctx.provenance) if problem is None else set()
    computing_y = _computing_y(site, region, readers, anchor)
    readers, kept = (readers, kept | set(computing_y)) if computing_y else (set(), kept)
    late = [u for out in (site.y, site.rstd) for u in out.users if (u not in region or u in kept) and u < anchor]
    moved_after = _late_to_move(late, anchor) if problem is None else None
    if problem is None and late and moved_after is None:
        problem = f"{late[0].name} reads the norm's output before its weight is computed"
    # the op runs in y's memory order (a q/k norm of a transposed q); where the normalized axes are
    # not innermost in memory, in the shape's order, its outputs then copied into the program's layouts
    order = memory_order(site.y, site.ev.k) or list(range(len(shape(site.y))))
    if problem is not None:
        return Miss(OP.name, site.y.name, problem)
    outputs = {"y": site.y, "rstd": site.rstd}
    with Insertion(graph, anchor) as inserted:
        emitted = _emit_call(ctx, site, compute, gamma_dtype, outputs, order)
        if isinstance(emitted, Miss):
            return emitted
        fused, replacements = emitted
        if root_power(site.rstd) != 1:
            _replace_root(ctx.edit, site.rstd, replacements)
    moved = [old for old, new in replacements.items() if not same_layout(new, old)]
    if moved:  # the program's views of its outputs rely on their strides
        return Miss(OP.name, site.y.name, f"{moved[0].name} has strides {list(val(moved[0]).stride())}, the fused "
                                          f"op's output in {site.y.name}'s memory order has others")
    added = inserted.nodes()
    after = added[-1] if added else anchor
    for node in moved_after or ():  # they read the fused outputs, inserted after the weight
        after.append(node)
        after = node
    as_forward_work(added, site.y)
    replaced = [n for n in region if n not in kept]
    fused_y = replacements.pop(site.y) if readers else None
    done = commit(ctx.edit, OP.name, None, replaced, outputs, replacements, {"x": site.x, "gamma": site.gamma},
                  added, fused)
    if fused_y is not None:  # the forward reads the fused y, the backward the program's, recomputable
        moved = [user for user in site.y.users if user not in readers]
        site.y.replace_all_uses_with(fused_y, delete_user_cb=lambda user: user not in readers)
        move_views(site.y, fused_y, moved)  # the moved readers' views of y now alias the fused y's memory
    return done


def _replace_root(edit, root: fx.Node, replacements) -> None:
    """Rewire the readers of the program's root to the fused op's rstd.

    The program's root (``x / sqrt(...)``) is the reciprocal of the fused op's rstd, which
    ``replacements`` holds for it: the root's readers read that reciprocal, and the ``root ** -1``
    the fused backward reads as its rstd reads the fused rstd itself."""
    rstd = replacements[root]
    for user in list(root.users):
        if user.target is aten.pow.Tensor_Scalar and user.args[1] == -1:
            replacements[user] = replacement_of(edit, rstd, user)
    replacements[root] = edit.call(aten.reciprocal.default, (rstd,))


def _emit_call(ctx: RuleContext, site: ForwardNormMatch, compute: torch.dtype, gamma_dtype: torch.dtype, outputs,
               order):
    x = permuted(ctx.edit, ctx.edit.cast(site.x, compute), order)
    if site.gamma is not None:
        gamma = ctx.edit.cast(site.gamma, gamma_dtype)
    elif all(isinstance(s, int) for s in site.ev.norm_shape):
        gamma = ctx.edit.call(aten.full.default, (list(site.ev.norm_shape), 1.0),
                              {"dtype": compute, "device": val(site.x).device})
    else:
        return Miss(OP.name, site.y.name, "a norm without weight over a symbolic size: mark the hidden size static")
    return emit_fused_op(ctx, OP, site.y, (x, gamma, site.eps), outputs, order)
