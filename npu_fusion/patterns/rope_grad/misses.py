"""What still looks like a RoPE backward after the last round: each one recorded miss, never silent."""
from __future__ import annotations

import operator
from typing import Dict, List, Optional, Tuple

import torch.fx as fx

from ...lowering import ROPE, ROPE_GRAD as OP
from ..evaluator import JointProvenance, Provenance
from ..lanes import LaneEvaluator
from ..nodes import CAST_TARGETS, VIEWS, aten, calls_to, downstream, gradient_dependent, gradient_product, is_float_cast
from ..rewrite import Miss
from ..pairing import calls, source
from ..rotation import DX_DEPTH, lane_evaluator
from .sites import refused_unit_axis_tables


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


def _rotary_table(node: fx.Node, provenance: Optional[Provenance], fused: Dict[object, fx.Node]):
    """What makes ``node`` a rotary table, or None: the fused forward RoPE op whose cos or sin it is
    (through the ops that shape a table, compared by :func:`~.pairing.source`), else True when it is
    shaped from cos, sin or a complex polar."""
    frontier, seen = [node], {node}
    for _ in range(TABLE_SEARCH_DEPTH):
        above = []
        for n in frontier:
            if source(n) in fused:
                return fused[source(n)]
            if n.op == "placeholder":
                n = provenance.forward_definition(n) if provenance is not None else None
                if n is None:
                    continue
                if source(n) in fused:
                    return fused[source(n)]
            if n.op != "call_function":
                continue
            if n.target in ROTARY_SOURCES:
                return True
            above += [a for a in _table_inputs(n) if a not in seen]
        seen.update(above)
        frontier = above
    return None


def _fused_forward_tables(graph: fx.Graph) -> Dict[object, fx.Node]:
    """The fused forward RoPE ops of a joint graph by the :func:`~..pairing.source` of their cos and sin
    and of what those are shaped from (a complex ``freqs_cis`` the forward rule rebuilt them from)."""
    tables: Dict[object, fx.Node] = {}
    for op in calls(graph, ROPE):
        frontier = [a for a in op.args[1:3] if isinstance(a, fx.Node)]
        for _ in range(TABLE_SEARCH_DEPTH):
            for node in frontier:
                tables.setdefault(source(node), op)
            frontier = [a for n in frontier for a in _table_inputs(n)]
    return tables


def unexplained(graph: fx.Graph, provenance: Optional[Provenance], misses: List[Miss]) -> List[Miss]:
    """Record each RoPE the pass left in the graph that no form matched and no miss explains.

    No silent misses: a gradient multiplied by a rotary table (a forward value shaped from
    cos, sin or a complex polar by views, casts, repeats and concatenation, or the cos or sin of
    a fused forward RoPE op, whatever they are computed from: tables passed in as inputs too)
    that is left in the graph after the pass, and that no recorded miss accounts for, is a RoPE
    application no form matched. Each connected group of such products becomes a miss naming
    the fused forward it is the backward of, if any, and where the lane evaluator stopped, the
    nearest difference."""
    gradient = gradient_dependent(graph)
    if gradient is None:
        return []
    fused = _fused_forward_tables(graph)
    # the only products gradient_product reads
    tables = {n: _table_product(n, gradient, provenance, fused) for n in calls_to(graph, aten.mul.Tensor)}
    anchors = [n for n, table in tables.items() if table is not None]
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
    found = [Miss(OP.name, anchor.name, _unmatched_reason(tables[anchor]) + _nearest_difference(ev, graph, anchor))
             for anchor, _ in groups]
    return found + _saved_rotation_misses(graph, provenance, gradient, [*misses, *found])


#: why the tables' gradients of a rotation read through a saved rotate(x) stay on a backward graph alone
SAVED_ROTATION_REASON = ("the tables' gradients of a rotation whose x takes no gradient, read from the saved "
                         "rotate(x) ({saved}): this backward graph holds no cos or sin for "
                         "RotaryPositionEmbeddingGrad to read (torchair's install sees it after the partition); "
                         "the npu_fusion backend and install_inductor fuse it on the joint graph")


def _saved_rotation_misses(graph: fx.Graph, provenance: Optional[Provenance], gradient: set,
                           misses: List[Miss]) -> List[Miss]:
    """On a backward graph alone: a miss per forward rotation whose saved rotated x a gradient multiplies, and nothing else records.

    Learned tables of an x that takes no gradient: the partitioned backward is only ``sum(dy * x)``
    and ``sum(dy * rotate(x))`` over the saved x and ``rotate(x)``, with no table for the scan above
    to anchor on; the saved ``rotate(x)`` is a move of elements that a rotation-shaped sum of the
    forward graph reads (the forward rule's own miss names that forward)."""
    from ..rope.sites import sums_rotation_terms
    from ..rotation import moves_elements, rotation_sums

    forward = getattr(provenance, "forward", None)
    if forward is None or isinstance(provenance, JointProvenance) or misses or calls(graph, OP):
        return []
    out, seen = [], set()
    for node in calls_to(graph, aten.mul.Tensor):  # the only products gradient_product reads
        product = gradient_product(node, gradient)
        saved = product[1] if product is not None else None
        definition = provenance.forward_definition(saved) if saved is not None and saved.op == "placeholder" else None
        if definition is None or not moves_elements(definition):
            continue
        sums = rotation_sums([definition], sums_rotation_terms, symbolic_only=False)
        if sums and sums[0] not in seen:
            seen.add(sums[0])
            out.append(Miss(OP.name, node.name, SAVED_ROTATION_REASON.format(saved=saved.name)))
    return out


def _unmatched_reason(table) -> str:
    """The opening of an unmatched backward's reason: the fused forward it belongs to, if any."""
    if isinstance(table, fx.Node):
        return (f"this rotation's forward fused ({table.name}), but its backward, a gradient multiplied by the "
                f"same cos/sin, matched no RoPE form; ")
    return "a gradient multiplied by a rotary table (cos/sin/polar in the forward) that no RoPE form matched; "


def _table_product(node: fx.Node, gradient: set, provenance, fused: Dict[object, fx.Node]):
    """The table's :func:`_rotary_table` verdict where ``node`` is a gradient times a rotary table
    (not a fused op's dcos or dsin), else None."""
    product = gradient_product(node, gradient)
    if product is None or _is_fused_table_gradient(product[0]):
        return None
    return _rotary_table(product[1], provenance, fused)


def _is_fused_table_gradient(node: fx.Node) -> bool:
    """A fused op's dcos or dsin (through casts and views): times a table it is the chain rule
    into the angles the tables were computed from (``cos(freqs)``), not a RoPE application."""
    while node.op == "call_function" and (is_float_cast(node) or node.target in VIEWS):
        node = node.args[0]
    return (node.op == "call_function" and node.target is operator.getitem and node.args[1] in (1, 2)
            and getattr(node.args[0], "target", None) is OP.overload)


def _nearest_difference(ev: LaneEvaluator, graph: fx.Graph, anchor: fx.Node) -> str:
    """Where the lane evaluator stopped past ``anchor``, reading the table views the rule reads as leaves
    as leaves too (:func:`~.sites.refused_unit_axis_tables`): a stop the rule went past is no difference."""
    nodes = downstream(graph, [anchor], DX_DEPTH)
    for node in nodes:
        ev.value(node)
    forced = refused_unit_axis_tables(ev)
    if forced:
        gradient, ev = ev.gradient_nodes, lane_evaluator(ev.provenance, forced)
        ev.gradient_nodes = gradient
        for node in nodes:
            ev.value(node)
    for node in nodes:
        if node in ev.unsupported:
            return f"the lane evaluator stopped at {node.name} ({node.target}): {ev.unsupported[node]}"
    return f"the products after {anchor.name} read as no mode's formula"
