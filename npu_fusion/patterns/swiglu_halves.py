"""The two halves of one projection, as both SwiGLU rules read them: pieces, products, and the near misses.

What :mod:`.swiglu` (the forward) and :mod:`.swiglu_grad` (the backward) share: the lanes
evaluator they read values with, a :class:`Piece` of a leaf (which leaf, which positions), the
checks a site's gate and up must pass (:func:`glu_problem`, :func:`order_problem`,
:func:`precision_problem`), and the near-miss readers that find a gated product no form read
(pieces of a split followed through products, signs, casts and pointwise ops of one tensor) and a
SiLU spelled ``x * sigmoid(x)``, so that no such site is silent.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple

import torch
import torch.fx as fx

from .evaluator import kept_precision, rounding_problem
from . import lane_pieces
from .lanes import LaneEvaluator
from ..lowering.checks import numel as product_of, size_equal
from ..lowering.sizes import same_shape, static_int
from .nodes import aten, axis_order, calls_to, dtype, holds, is_float_cast, shape
from .rewrite import Miss
from .swiglu_views import VIEWS, split_piece, swiglu_evaluator, through_casts


#: the ops that may move elements across the leading axes (the lanes domain tracks the last axis
#: only): none may lie inside a site, so the fused op's output is the site's elements in its order
REORDERING = {aten.permute.default, aten.transpose.int, aten.t.default, aten.expand.default, aten.select.int,
              aten.unbind.int, aten.as_strided.default, aten.flip.default, aten.roll.default, aten.repeat.default,
              aten.index.Tensor, aten.gather.default, aten.select_backward.default}
#: the ops that join along an axis: only along the last one (the halves)
JOINING = {aten.cat.default, aten.stack.default}


@dataclasses.dataclass(frozen=True)
class Piece:
    """A value that is, position by position, leaf ``x`` (its node) at ``start .. start + size``
    of its last axis, which is ``width`` wide."""
    x: fx.Node
    lid: int
    start: int
    size: int
    width: int

    @property
    def is_gate(self) -> bool:
        return self.start == 0 and 2 * self.size == self.width

    @property
    def is_up(self) -> bool:
        return 2 * self.start == self.width and 2 * self.size == self.width


def piece_of(ev: LaneEvaluator, node) -> Optional[Piece]:
    """``node``'s value as a contiguous piece of one leaf's last axis (its tracked positions in order), or None."""
    if not isinstance(node, fx.Node):
        return None
    v = ev.value(node)  # over every tracked axis: [..., 1, H] of a chunk(2, -2) of [..., 2, H] is a piece too
    if v is None or v.reduction is not None or v.complex or not v.inner or not math.prod(v.inner):
        return None
    runs = run_monomials(v)
    if runs is not None:  # position i of a run reads (leaf, i + offset): one leaf, one offset for all of them
        variables = {mono for _, _, mono in runs}
        if len(variables) != 1 or len(next(iter(variables))) != 1:
            return None
        (lid, start), = variables.pop()
        return _piece(ev, lid, start, math.prod(v.inner))
    vars_ = []
    for poly in v.polys:
        if len(poly) != 1:
            return None
        (mono, coef), = poly.items()
        if coef != 1 or len(mono) != 1:
            return None
        vars_.append(mono[0])
    lid, start = vars_[0]
    if any(var != (lid, start + i) for i, var in enumerate(vars_)):
        return None
    return _piece(ev, lid, start, len(vars_))


def _piece(ev: LaneEvaluator, lid: int, start: int, size: int) -> Optional[Piece]:
    leaf = ev.leaves[lid]
    value = ev.value(leaf)
    if value is None:
        return None
    width = math.prod(value.inner)  # over every tracked axis: a [..., 2, H] view read as a leaf is 2H wide
    return Piece(leaf, lid, start, size, width)


def run_monomials(v) -> Optional[List[Tuple[int, int, tuple]]]:
    """``v``'s runs of positions as ``(lo, hi, monomial)`` where each run's template is one monomial of
    coefficient 1 (position i reads it with every offset plus i), or None (no runs, or a run that is not).

    The same question the per-position polynomials answer, asked once a run, so that a piece of a
    wide projection costs the same as a narrow one."""
    if v.pieces is None:
        return None
    runs = []
    for lo, hi, template in v.pieces:
        if len(template) != 1:
            return None
        (mono, coef), = template.items()
        if coef != 1:
            return None
        runs.append((lo, hi, mono))
    return runs


def numel(node: fx.Node):
    """The number of elements of ``node``'s value (symbolic where its sizes are)."""
    return product_of(shape(node))


def is_silu(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.silu.default


def outermost_cast(node: fx.Node) -> fx.Node:
    """``node`` followed through the float casts that are its only user."""
    while len(node.users) == 1 and is_float_cast(next(iter(node.users))):
        node = next(iter(node.users))
    return node


def product_value(ev: LaneEvaluator, a: Tuple[int, int], b_lid: int, b_start: int, size: int) -> List[dict]:
    """The lanes of ``leaf a[i] * leaf b[b_start + i]``, a given as (leaf id, start)."""
    return [{tuple(sorted(((a[0], a[1] + i), (b_lid, b_start + i)))): 1} for i in range(size)]


def is_product_value(v, a: Tuple[int, int], b_lid: int, b_start: int, size: int) -> bool:
    """Whether ``v``'s lanes are :func:`product_value`'s, compared once a run where ``v`` has runs.

    Position i of a run reads its template's variables ``(leaf, offset)`` as ``(leaf, i + offset)``, so the
    product's lanes are the one run of ``a[i] * b[b_start + i]``: offsets ``a``'s start and ``b_start``."""
    if v.flat is not None:
        return lane_pieces.equal(v.flat, ((0, size, {tuple(sorted(((a[0], a[1]), (b_lid, b_start)))): 1}),))
    return v.polys == product_value(None, a, b_lid, b_start, size)


def glu_problem(gate: Piece, up: Piece) -> Optional[str]:
    """Why a gate and an up read from one x are not SwiGlu's halves (first gated, second up), or None."""
    if gate.width % 2:
        return (f"{gate.x.name}'s last axis is {gate.width} wide, odd: SwiGlu splits x into two equal halves "
                f"(docs/fused-ops.md#swiglu)")
    if gate.size != up.size:
        return f"the gate ({gate.size} wide) and the up ({up.size} wide) are unequal pieces of {gate.x.name}"
    if up.is_gate and gate.is_up:
        return (f"silu gates the second half of {gate.x.name} and the first half is the up: SwiGlu gates the "
                f"first half (torch_npu's npu_swiglu has no flag to swap them)")
    if not (gate.is_gate and up.is_up):
        return (f"the gate reads {gate.x.name}[{gate.start}:{gate.start + gate.size}] and the up "
                f"[{up.start}:{up.start + up.size}] of its {gate.width}: not its two halves in order")
    return None


def order_problem(outputs, stops, numels, lead=None) -> Optional[str]:
    """Why the nodes between ``stops`` and ``outputs`` may move elements across the leading axes, or None.

    Why the nodes from ``stops`` (exclusive) to ``outputs`` (their inputs, recursively) may move
    elements across the leading axes, which the lanes domain does not track, or None: a permutation,
    broadcast or selection among them, a join along another axis than the last, or, with ``numels``
    (pairs of sizes that must be equal), a site whose outputs are not as large as the fused op's.
    With ``lead`` (x's leading shape), a selection, join or permutation of only the axes after
    ``lead`` (``x.view(B, S, 2, H).unbind(-2)`` and its backward's ``stack``) moves no element across
    them: the lanes domain read it exactly."""
    for a, b in numels:
        if not size_equal(a, b):
            return f"the site's sizes ({a} and {b} elements) are not the fused op's: a broadcast inside"
    stack, seen = [a for o in outputs for a in o.all_input_nodes], set()
    while stack:
        node = stack.pop()
        if node in seen or node in stops or node.op != "call_function":
            continue
        seen.add(node)
        name = getattr(node.target, "__name__", str(node.target))
        rank = len(shape(node)) if shape(node) is not None else 0
        joins_last = node.target in JOINING and rank and \
            (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % rank == rank - 1
        if (node.target in REORDERING or (node.target in JOINING and not joins_last)) and \
                not (lead is not None and _after_leading_axes(node, lead)):
            return (f"{node.name} ({name}) lies inside the site: it may move elements across the leading axes, "
                    f"which the fused op keeps in place")
        stack.extend(node.all_input_nodes)
    return None


#: the ops that move elements along the axes they name only: ``(axes of, the shape they index)``
_AXIS_OPS = {aten.select.int: lambda n: ([n.args[1]], shape(n.args[0])),
             aten.unbind.int: lambda n: ([n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)], shape(n.args[0])),
             aten.select_backward.default: lambda n: ([n.args[2]], n.args[1]),
             aten.stack.default: lambda n: ([n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)], shape(n)),
             aten.cat.default: lambda n: ([n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)], shape(n))}


def _after_leading_axes(node: fx.Node, lead) -> bool:
    """Whether ``node`` selects, joins or permutes only axes after ``lead``, the leading axes it keeps."""
    if node.target in (aten.transpose.int, aten.permute.default):
        ref = shape(node.args[0])
        if ref is None:
            return False
        order = axis_order(node.target, node.args[1:], len(ref))
        axes = [i for i, a in enumerate(order) if i != a]
    elif node.target in _AXIS_OPS:
        dims, ref = _AXIS_OPS[node.target](node)
        if ref is None or not all(isinstance(d, int) for d in dims):
            return False
        axes = [d % len(ref) for d in dims]
    else:
        return False
    return len(ref) > len(lead) and all(a >= len(lead) for a in axes) and same_shape(ref[:len(lead)], lead)


def precision_problem(ev: LaneEvaluator, output: fx.Node, name: str, roles, leaves=()) -> Optional[str]:
    """Why the site's roundings keep it unfused, or None.

    The rounding rules of :func:`~.evaluator.rounding_problem`, also below the site's ``leaves``
    (silu and silu_backward are leaves of the domain: the operands of ``leaves`` are judged by
    the narrowing casts they were read through), and the fused op's own: it rounds its result to
    x's dtype, which must hold the precision the program keeps ``output`` at."""
    problem = rounding_problem(ev, {name: output}, roles)
    if problem is not None:
        return problem
    kept = kept_precision(output)
    x, working = roles[-1], dtype(roles[0])
    read = frozenset().union(*(ev.rounded.get(role, frozenset()) for role in roles))
    for leaf in leaves:
        for operand in leaf.all_input_nodes:
            ev.value(operand)
            rounded = ev.rounded.get(operand, frozenset())
            coarse = sorted(str(d) for d in rounded if not holds(d, kept))
            if coarse:
                return (f"the program rounds {operand.name}, an operand of {leaf.name}, to {', '.join(coarse)} "
                        f"inside the site, more coarsely than it keeps {name} ({output.name}, {kept}); the "
                        f"fused op would not round it")
            # the halves of a rounded copy of x, read where the fused op reads x as it is: another function
            copies = sorted(str(d) for d in rounded - read if not holds(d, working))
            if copies:
                return (f"{leaf.name} reads {operand.name}, a piece of a copy of {x.name} rounded to "
                        f"{', '.join(copies)}, where the fused op would read {x.name} as it is ({dtype(x)})")
    if not holds(dtype(x), kept):
        return (f"the program keeps {name} ({output.name}) in {kept}, finer than x's {dtype(x)} in which the fused "
                f"op rounds it (a product of {dtype(x)} halves computed and kept in {kept})")
    return None



def dead_region(outputs, stops) -> List[fx.Node]:
    """The calls that compute ``outputs`` and that nothing else reads (above them, up to ``stops``):
    what the rewrite replaces once the outputs are rewired."""
    region, stack = set(outputs), [a for o in outputs for a in o.all_input_nodes]
    while stack:
        node = stack.pop()
        if node in region or node in stops or node.op != "call_function":
            continue
        if all(u in region for u in node.users):
            region.add(node)
            stack.extend(node.all_input_nodes)
    return sorted(region)



#: how many steps :func:`factor_pieces` follows products, negations and casts
FACTOR_DEPTH = 3


def factor_pieces(node, depth: int = FACTOR_DEPTH, transforms: Optional[list] = None
                  ) -> List[Tuple[fx.Node, Tuple[fx.Node, int, tuple]]]:
    """The split pieces ``node`` is a product of, up to constant factors and signs: ``(piece node, split_piece)``.

    Followed through float casts, negations, products and divisions by a number, ``depth`` steps;
    with a list ``transforms``, also through the other pointwise ops (a clamp, a shift, a sum of the
    up and another term: ``up + gate``), whose nodes are appended to it."""
    piece = split_piece(node)
    if piece is not None:
        return [(node, piece)]
    if depth == 0 or not isinstance(node, fx.Node) or node.op != "call_function":
        return []
    if node.target in (aten.mul.Tensor, aten.neg.default) or is_float_cast(node):
        factors = node.args[:2] if node.target is aten.mul.Tensor else node.args[:1]
    elif node.target is aten.div.Tensor and not isinstance(node.args[1], fx.Node):
        factors = node.args[:1]
    elif transforms is not None and _pointwise_of_one_tensor(node) is not None:
        transforms.append(node)
        factors = [_pointwise_of_one_tensor(node)]
    elif transforms is not None and _pointwise_of_tensors(node):
        transforms.append(node)
        factors = node.all_input_nodes
    else:
        return []
    return [p for f in factors for p in factor_pieces(f, depth - 1, transforms)]


def _pointwise_of_one_tensor(node: fx.Node) -> Optional[fx.Node]:
    """The one tensor a pointwise op of the same shape reads (``clamp(x)``, ``x + 1``, ``tanh(x)``), or None."""
    inputs = node.all_input_nodes
    if not (isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags
            and len(inputs) == 1 and shape(node) is not None and shape(inputs[0]) is not None
            and same_shape(shape(node), shape(inputs[0]))):
        return None
    return inputs[0]


def _pointwise_of_tensors(node: fx.Node) -> bool:
    """``node`` is a pointwise op of several tensors with its own shape (``up + gate``, ``up * 2 - bias``)."""
    return (isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags
            and len(node.all_input_nodes) > 1 and shape(node) is not None)


def _combined_term(transform: fx.Node, up: fx.Node) -> fx.Node:
    """The tensor a pointwise op of several tensors combines the ``up`` piece with (``gate`` in ``up + gate``)."""
    others = [a for a in transform.all_input_nodes if up not in [n for n, _ in factor_pieces(a, transforms=[])]]
    return (others or transform.all_input_nodes)[-1]


def unread_glu_problem(ev: LaneEvaluator, gate_input, gated) -> Optional[str]:
    """Why a SiLU of ``gate_input`` times ``gated``, two pieces of one split, is not a site the rules read.

    None where they are not two pieces of one split (no SwiGLU at all). The lanes domain proves
    the halves over a static last axis, and the fused op computes exactly ``silu(x[:H]) * x[H:]``:
    a split along another axis, a symbolic width, or a scale or sign inside the product is a
    SwiGLU-like site it does not read, recorded rather than silent. A gate and an up the lanes
    domain reads from two leaves (the halves of a ``cat`` of two projections) are no site."""
    transforms: list = []
    gates = factor_pieces(gate_input, transforms=transforms)
    if len(gates) != 1:
        return None
    source, axis, which = gates[0][1]
    up_transforms: list = []
    ups = [node for node, p in factor_pieces(gated, transforms=up_transforms)
           if _same_value(p[0], source) and p[2] != which]
    transforms += up_transforms
    if not ups:
        return None
    combined = next((t for t in transforms if len(t.all_input_nodes) > 1), None)
    if combined is not None:  # a half read with another term (silu(gate) * (up + gate)): another function
        gate_side = combined in transforms[:len(transforms) - len(up_transforms)]
        role, piece = ("gate", gates[0][0]) if gate_side else ("up", ups[0])
        return (f"silu gates a piece of {source.name} and another piece is the up, but {combined.name} "
                f"({combined.target}) combines the {role} with {_combined_term(combined, piece).name} between the "
                f"split and the product: the fused op computes silu(x[:H]) * x[H:] of the halves as they are, and "
                f"this is another function, which no SwiGLU form fuses; it fuses only where silu of the first half "
                f"multiplies the second half itself")
    if transforms:  # a clamped SwiGLU (GPT-OSS's), a shifted up: not the two halves as the split cut them
        return (f"silu gates a piece of {source.name} and another piece is the up, but {transforms[0].name} "
                f"({transforms[0].target}) changes a piece between the split and the product: the fused op computes "
                f"silu(x[:H]) * x[H:] of the halves as they are")
    strided = [n for n in (gates[0][0], ups[0]) if split_piece(n)[2][0] == "strided"]
    if strided:
        return (f"silu gates {through_casts(gates[0][0]).name} and the up is {through_casts(ups[0]).name}, pieces of "
                f"{source.name} where {', '.join(through_casts(n).name for n in strided)} is an as_strided view: the "
                f"rules follow slices, splits, chunks and views, not as_strided's sizes, strides and offset, so they "
                f"prove no halves there (spell them {source.name}.chunk(2, -1) or slices, which fuse)")
    rows = rows_problem(ev, gate_input, ups[0])
    if rows is not None:
        return rows
    rank = len(shape(source))
    if axis != rank - 1 and source.target in (aten.permute.default, aten.transpose.int):
        moved_from = axis_order(source.target, source.args[1:], rank)[axis]
        return (f"silu gates a piece of {source.name} split along axis {axis} of {rank}, which {source.name} "
                f"({source.target}) moved there from axis {moved_from} of {source.args[0].name}: the rules read the "
                f"halves over the axes after the leading ones and follow no permutation that moves one of those "
                f"among the leading axes (split {source.args[0].name} itself, swiglu(x, -1) reads its halves)")
    if axis != rank - 1:
        return (f"silu gates a piece of {source.name} split along axis {axis} of {rank}, and the other piece is "
                f"the up: the rules find the two halves as blocks of a last axis (chunk(2, -1), swiglu(x, -1)) or as "
                f"the two rows of a [..., 2, H] view's axis before its last (unbind(-2)), and this split is neither")
    gate_lanes, up_lanes = piece_of(ev, gate_input), piece_of(ev, ups[0])
    if gate_lanes is not None and up_lanes is not None and gate_lanes.lid != up_lanes.lid:
        g, u, update = gate_lanes.x, up_lanes.x, _updated_in_place(source)
        if _same_value(g, u) or update is not None:  # one value the domain reads as two
            how = f"two views of {g.args[0].name} to one shape" if _same_value(g, u) else "the values it joins"
            after = f", after an in-place update ({update.name}, {update.target})," if update is not None else ""
            return (f"silu gates a piece of {source.name} and the up is another piece of that value, but{after} the "
                    f"rules read the gate as a piece of {g.name} and the up of {u.name}, {how}, each a value of its "
                    f"own: no two halves of one value, so no site is proven (fold the update into the projection's "
                    f"weight to fuse)")
        return None  # two projections joined along the last axis: as Llama's MLP, no site
    if static_int(shape(source)[axis]) is None:
        return (f"{source.name}'s last axis ({shape(source)[axis]}) is symbolic: the rules prove the two halves over "
                f"a static width (mark only the batch and sequence axes dynamic)")
    interleaved = _interleaving(ev, gate_input, ups[0])
    if interleaved is not None:
        return interleaved
    return (f"silu({through_casts(gate_input).name}) and another piece of {source.name} are multiplied with a "
            f"constant, a sign or a piece that is not the second half: not silu(x[:H]) * x[H:] position by position, "
            f"which the fused op computes")


#: the ops with which functionalization writes an in-place update of a slice into its base
_SCATTERS = {aten.slice_scatter.default, aten.select_scatter.default, aten.as_strided_scatter.default,
             aten.index_put.default, aten.copy.default}


def _same_value(a: fx.Node, b: fx.Node) -> bool:
    """Whether ``a`` and ``b`` are one node, or two views of one node to one shape (functionalization's twins)."""
    return a is b or (a.target in VIEWS and a.target is b.target and a.args == b.args and a.kwargs == b.kwargs)


def _updated_in_place(source: fx.Node) -> Optional[fx.Node]:
    """The scatter ``source`` is a view of: functionalization's trace of an in-place update of a slice, or None."""
    while source.op == "call_function" and source.target in VIEWS:
        source = source.args[0]
    return source if source.op == "call_function" and source.target in _SCATTERS else None


def rows_problem(ev: LaneEvaluator, gate_input, up) -> Optional[str]:
    """Why the two halves of one leaf, each several rows of a view (``view(B, S, 4, H // 2).chunk(2, -2)``), are
    not read, or None where they are not such halves.

    The rules read silu and its gradient over their last axis (leaves of the domain), a row at a time:
    halves one row each (``view(..., 2, H).unbind(-2)``, ``chunk(2, -2)``) fuse, several rows each do not."""
    gate, ups = piece_of(ev, gate_input), piece_of(ev, up) if isinstance(up, fx.Node) else None
    v = ev.value(gate_input)
    if gate is None or ups is None or gate.lid != ups.lid or not (gate.is_gate and ups.is_up) or \
            v is None or len(v.inner) < 2 or math.prod(v.inner[:-1]) < 2:
        return None
    found = split_piece(gate_input)
    where = f" of {found[0].name} ({list(shape(found[0]))}), split along its axis {found[1]}" if found else ""
    return (f"silu gates {gate.x.name}[..., :{gate.size}] and the up is {gate.x.name}[..., {gate.size}:], its two "
            f"halves, but each half is {math.prod(v.inner[:-1])} rows{where}: the rules read silu and its gradient "
            f"over their last axis, a row at a time, and fuse halves of one row each (view(..., 2, {gate.size}) with "
            f"unbind(-2) or chunk(2, -2), or chunk(2, -1) of {gate.x.name}), not halves that span several rows")


def _positions(ev: LaneEvaluator, node) -> Optional[Tuple[fx.Node, List[int]]]:
    """``(leaf, positions)`` where ``node`` reads, position by position, one element of one leaf's last axis."""
    v = ev.value(node) if isinstance(node, fx.Node) else None
    if v is None or v.reduction is not None or v.complex:
        return None
    read = []
    for poly in v.polys:
        if len(poly) != 1 or next(iter(poly.values())) != 1 or len(next(iter(poly))) != 1:
            return None
        read.append(next(iter(poly))[0])
    if not read or len({lid for lid, _ in read}) != 1:
        return None
    return ev.leaves[read[0][0]], [p for _, p in read]


def _interleaving(ev: LaneEvaluator, gate_input, up) -> Optional[str]:
    """Why a gate and an up that read one leaf's last axis in alternation are not the fused op's halves, or None.

    ``h.view(B, S, I, 2).unbind(-1)``, ``h[..., ::2]``: the gate reads every other element of x and the
    up the ones between; the same function as ``swiglu`` over x viewed ``[..., I, 2]``, with halves
    one element wide, which the rules do not emit (they read halves that are blocks of x's last axis)."""
    gate, ups = _positions(ev, gate_input), _positions(ev, up)
    if gate is None or ups is None or gate[0] is not ups[0]:
        return None
    (x, g), (_, u) = gate, ups
    width = static_int(shape(x)[-1]) if shape(x) else None
    if width is None or 2 * len(g) != width or g != list(range(0, width, 2)) or u != list(range(1, width, 2)):
        return None
    return (f"the gate reads {x.name}[..., 0::2] and the up {x.name}[..., 1::2]: the halves interleave element by "
            f"element along its last axis, where swiglu reads two blocks (silu(x[..., :H]) * x[..., H:]; over "
            f"{x.name} viewed [..., {width // 2}, 2] the halves would be one element wide, which the rules do not emit)")


def scaled_users(node: fx.Node, depth: int = FACTOR_DEPTH) -> List[fx.Node]:
    """The products that read ``node``, past float casts, negations and products with a number."""
    out = []
    for user in node.users:
        if user.op != "call_function":
            continue
        if user.target is aten.mul.Tensor and all(isinstance(a, fx.Node) for a in user.args[:2]):
            out.append(user)
        elif depth and (is_float_cast(user) or user.target in (aten.neg.default, aten.mul.Tensor, aten.div.Tensor)):
            out += scaled_users(user, depth - 1)
    return out


def scaled_from(node, silu: fx.Node, depth: int = FACTOR_DEPTH + 1) -> bool:
    """Whether ``node`` is ``silu`` past float casts, negations and products or divisions by a number."""
    for _ in range(depth):
        if node is silu:
            return True
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return False
        tensors = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        if is_float_cast(node) or node.target is aten.neg.default:
            node = node.args[0]
        elif node.target is aten.mul.Tensor and len(tensors) == 1:
            node = tensors[0]
        elif node.target is aten.div.Tensor and tensors == [node.args[0]]:
            node = node.args[0]
        else:
            return False
    return node is silu


#: the calls :func:`decomposed_silu_operand` reads a decomposed SiLU at
DECOMPOSED_SILU_TARGETS = (aten.sigmoid.default, aten.exp.default)


def decomposed_silu_operand(node: fx.Node):
    """The operand of a decomposed SiLU at ``node``: ``sigmoid(a)`` (core ATen) or ``exp(-a)`` (Inductor's)."""
    if node.op != "call_function":
        return None
    if node.target is aten.sigmoid.default:
        return node.args[0]
    if node.target is aten.exp.default and isinstance(node.args[0], fx.Node) and node.args[0].target is aten.neg.default:
        return node.args[0].args[0]
    return None


def _halves_source(ev: LaneEvaluator, operand) -> Optional[fx.Node]:
    """The value ``operand`` is one half of: by value in the lanes domain, else by structure (a split in two)."""
    piece = piece_of(ev, operand)
    if piece is not None:
        return piece.x if piece.is_gate or piece.is_up else None
    found = split_piece(operand)
    if found is None or found[2][0] != "piece":
        return None
    split = through_casts(operand).args[0]
    pieces = split.meta.get("val")
    return found[0] if isinstance(pieces, (list, tuple)) and len(pieces) == 2 else None


def decomposed_silu_misses(graph: fx.Graph, op: str, misses, nodes=None) -> List[Miss]:
    """The misses for SiLUs of a half of one projection decomposed into ``x * sigmoid(x)`` or ``x / (1 + exp(-x))``.

    No silent misses: a SiLU the program spelled so, or a table's decomposition the pass did not
    put back (it recomposes only the exact trace of the table the path traced with), is a site
    the rules do not read (they read ``silu`` and ``silu_backward``); one miss per projection,
    unless a recorded miss is at it already. ``nodes``: where to look (every node when None)."""
    ev = swiglu_evaluator()
    seen, out = {m.node for m in misses}, []
    for node in [n for n in calls_to(graph, *DECOMPOSED_SILU_TARGETS) if nodes is None or n in nodes]:
        operand = decomposed_silu_operand(node)
        source = _halves_source(ev, operand) if operand is not None else None
        if source is None or source.name in seen:
            continue
        seen.add(source.name)
        out.append(Miss(op, source.name, f"silu of half of {source.name} is spelled with {node.target.__name__.split('.')[0]} "
                                         f"({node.name}): the rules read aten.silu and aten.silu_backward; write "
                                         f"F.silu (the npu_fusion backend and install_inductor put SiLU back where "
                                         f"the graph holds exactly the trace of their decomposition table, core ATen's "
                                         f"or Inductor's, and nothing else)"))
    return out
