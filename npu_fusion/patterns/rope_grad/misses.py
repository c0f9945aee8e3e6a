"""What still looks like a RoPE backward after the last round: each one recorded miss, never silent."""
from __future__ import annotations

import operator
from typing import List, Optional, Tuple

import torch.fx as fx

from ...lowering import ROPE_GRAD as OP
from ..evaluator import Provenance
from ..lanes import LaneEvaluator
from ..nodes import CAST_TARGETS, VIEWS, aten, downstream, gradient_dependent, gradient_product, is_float_cast
from ..rewrite import Miss
from ..rotation import DX_DEPTH, lane_evaluator


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


def _is_rotary_table(node: fx.Node, provenance: Optional[Provenance]) -> bool:
    frontier, seen = [node], {node}
    for _ in range(TABLE_SEARCH_DEPTH):
        above = []
        for n in frontier:
            if n.op == "placeholder":
                n = provenance.forward_definition(n) if provenance is not None else None
                if n is None:
                    continue
            if n.op != "call_function":
                continue
            if n.target in ROTARY_SOURCES:
                return True
            above += [a for a in _table_inputs(n) if a not in seen]
        seen.update(above)
        frontier = above
    return False


def unexplained(graph: fx.Graph, provenance: Optional[Provenance], misses: List[Miss]) -> List[Miss]:
    """Record each RoPE the pass left in the graph that no form matched and no miss explains.

    No silent misses: a gradient multiplied by a rotary table (a forward value shaped from
    cos, sin or a complex polar by views, casts, repeats and concatenation) that is left in the
    graph after the pass, and that no recorded miss accounts for, is a RoPE application no form
    matched. Each connected group of such products becomes a miss naming where the lane
    evaluator stopped, the nearest difference."""
    gradient = gradient_dependent(graph)
    if gradient is None:
        return []
    anchors = [n for n in graph.nodes if _table_product(n, gradient, provenance)]
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
    return [Miss(OP.name, anchor.name, "a gradient multiplied by a rotary table (cos/sin/polar in the forward) "
                                  "that no RoPE form matched; " + _nearest_difference(ev, graph, anchor))
            for anchor, _ in groups]


def _table_product(node: fx.Node, gradient: set, provenance) -> bool:
    product = gradient_product(node, gradient)
    return product is not None and _is_rotary_table(product[1], provenance) \
        and not _is_fused_table_gradient(product[0])


def _is_fused_table_gradient(node: fx.Node) -> bool:
    """A fused op's dcos or dsin (through casts and views): times a table it is the chain rule
    into the angles the tables were computed from (``cos(freqs)``), not a RoPE application."""
    while node.op == "call_function" and (is_float_cast(node) or node.target in VIEWS):
        node = node.args[0]
    return (node.op == "call_function" and node.target is operator.getitem and node.args[1] in (1, 2)
            and getattr(node.args[0], "target", None) is OP.overload)


def _nearest_difference(ev: LaneEvaluator, graph: fx.Graph, anchor: fx.Node) -> str:
    nodes = downstream(graph, [anchor], DX_DEPTH)
    for node in nodes:
        ev.value(node)
    for node in nodes:
        if node in ev.unsupported:
            return f"the lane evaluator stopped at {node.name} ({node.target}): {ev.unsupported[node]}"
    return f"the products after {anchor.name} read as no mode's formula"
