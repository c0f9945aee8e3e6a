"""RoPE backward rewrite: a matched site emitted as one ``rotary_position_embedding_grad`` call."""
from __future__ import annotations

from typing import Tuple

import torch.fx as fx

from ...lowering import ROPE_GRAD as OP
from ...lowering.ops.rope_grad import ROPE_MODES
from ...lowering.sizes import same_shape, static_int
from ..evaluator import kept_precision, rounding_problem
from ..nodes import aten, dtype, last_of, shape
from ..rewrite import (Edit, Insertion, Miss, RuleContext, add_back_accumulated, commit, emit_fused_op,
                       exact_common_dtype, in_layout_of, replacement_of)
from ..layout import permuted
from ..pairing import site_key
from .match import RopeMatch
from ..rotation import fold_heads, heads_folded, rope_layout_problem, unfold_heads


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


def emit(rewrites: RuleContext, site: RopeMatch, outputs, region):
    """The site rewritten into one fused call (a :class:`Site`), or a :class:`Miss` saying why not."""
    graph, edit, ev, target = rewrites.graph, rewrites.edit, site.ev, rewrites.target
    dy_leaf, cos_leaf, sin_leaf = (rewrites.current(ev.leaves[r[0]]) for r in (site.dy, site.cos, site.sin))
    x_leaf = rewrites.current(ev.leaves[site.x[0]]) if site.x is not None else None
    leaves = [dy_leaf, cos_leaf, sin_leaf, x_leaf]
    if not site.table_only and not same_shape(shape(dy_leaf)[:-1], shape(site.dx)[:-1]):
        return Miss(OP.name, site.dx.name, f"dy {dy_leaf.name} is broadcast to dx's shape")
    if not same_shape(shape(cos_leaf)[:-1], shape(sin_leaf)[:-1]):
        return Miss(OP.name, site.dx.name, f"cos {list(shape(cos_leaf))} and sin {list(shape(sin_leaf))} "
                                           f"have different shapes")
    with Insertion(graph, last_of(graph, [n for n in leaves if n is not None])) as inserted:
        try:
            operands, folded = _operands(edit, site, leaves, outputs)
        except TableLayoutError as exc:
            return Miss(OP.name, site.dx.name, str(exc))
        dy, cos, sin, x = operands
        rounding = rounding_problem(ev, outputs, leaves)
        layout = rope_layout_problem(target, site.mode, shape(dy), shape(cos), x is not None, dtype(dy))
        # the rotation's verdict binds its forward: its roundings, and what the target refuses of the
        # rotation itself (not the limits A2/A3 add for the table gradients, which no forward computes)
        rotation = layout if x is None or layout is None else rope_layout_problem(
            target, site.mode, shape(dy), shape(cos), False, dtype(dy))
        rewrites.context.judgements.record(site_key(OP.option, cos_leaf, sin_leaf), rounding or rotation)
        problem = rounding or layout  # in the forward rule's order: one reason for the rotation
        if problem is None and x is not None and not same_shape(shape(x), shape(dy)):
            problem = f"x {list(shape(x))} and dy {list(shape(dy))} have different shapes"
        if problem is not None:
            return Miss(OP.name, site.dx.name, problem)
        emitted = emit_fused_op(rewrites, OP, site.dx, (dy, cos, sin, x, site.mode), {} if folded else outputs)
        if isinstance(emitted, Miss):
            return emitted
        fused, replacements = emitted
        if folded:
            replacements = _unfolded(edit, fused, outputs)
    added = inserted.nodes()
    if site.rest:
        added += add_back_accumulated(edit, site, replacements)
    return commit(edit, OP.name, ROPE_MODES[site.mode], region, outputs, replacements,
                  {"dy": dy_leaf, "cos": cos_leaf, "sin": sin_leaf, "x": x_leaf}, added, fused)


def _unfolded(edit: Edit, fused: fx.Node, outputs) -> dict:
    """What replaces each output of a site whose fused call runs as BNSD
    (:func:`~..rotation.heads_folded`): its result in the output's shape (:func:`~..rotation.unfold_heads`),
    cast and laid out as :func:`~..rewrite.emit_fused_op` does."""
    replacements = {}
    for index, name in enumerate(OP.outputs):
        old = outputs.get(name)
        if old is not None:
            result = unfold_heads(edit, edit.getitem(fused, index), len(shape(old)))
            replacements[old] = in_layout_of(edit, replacement_of(edit, result, old), old)
    return replacements


def _operands(edit: Edit, site: RopeMatch, leaves, outputs) -> tuple:
    """Build dy, cos, sin and x for the fused op from the site's role leaves, and whether they
    were viewed as BNSD (:func:`~..rotation.heads_folded`).

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
    # only: a [S, D] table is 11SD to both rules), a 3-D dy whose tables broadcast over its first axis
    # viewed as 4-D (:func:`~..rotation.heads_folded`); dx, dcos and dsin come back in the program's shapes
    rank = len(shape(operands[0]))
    operands[1:3] = [permuted(edit, n, list(range(rank))) for n in operands[1:3]]
    folded = all(heads_folded(shape(operands[0]), shape(table)) for table in operands[1:3])
    if folded:  # a 3-D dy with [S, D] tables: run as BNSD
        operands = [fold_heads(edit, n) for n in operands]
    return [edit.cast(n, compute) if n is not None else None for n in operands], folded
