"""No silent forward misses: each fused backward site of a joint graph has a forward site too.

A forward rule's own near-miss scan sees only what looks like its forward (an ``rsqrt`` of a mean
of squares, two products per element). A forward spelled otherwise (``x / sqrt(...)``, a complex
``freqs_cis`` product, tables rebuilt from halves) would end neither fused nor recorded. Its
backward, though, is in the graph: the backward rules fused it into ``rms_norm_grad`` or
``rotary_position_embedding_grad``, and each such node is one site whose forward ran. So after the
last round, every fused backward node that no fused forward op and no recorded forward miss
accounts for is a forward miss named by that backward node, with a reason read off the forward
(what its statistic or tables are built of). Pairing is by the forward values the two fused ops
share: an RMSNorm backward reads the forward op's ``rstd``; a RoPE backward reads the same tables
as its forward (q and k share them, so RoPE pairs by count per pair of tables).

The other way round (:func:`backwards_of_forward_misses`): a forward the forward rule recorded as a
miss (a clamped statistic, a table scaled after the product) has a backward that no backward form
reads either, and the backward rules' scans, looking for a gradient times an RMS statistic or a
rotary table, may not see it. Each such recorded forward miss whose site's backward is in the graph
(gradients read the values the forward site read) and that no backward miss or fused backward op
accounts for is one backward miss, whose reason is the forward's.
"""
from __future__ import annotations

import collections
import operator
from typing import Callable, Dict, List, Sequence, Tuple

import torch.fx as fx

from ..lowering.fused_op import FusedOp
from .context import PassContext
from .nodes import CAST_TARGETS, VIEWS, dtype, gradient_dependent
from .rewrite import Miss


def source(node) -> object:
    """``node`` with views, casts and ``getitem`` taken off: the value it reads."""
    while isinstance(node, fx.Node) and node.op == "call_function" and (
            node.target in VIEWS or node.target in CAST_TARGETS or node.target is operator.getitem):
        node = node.args[0]
    return node


def site_key(kind: str, *values: fx.Node) -> tuple:
    """The key both rules of one site record and read its verdicts under: the forward values they
    both name (a norm's statistic; a rotation's cos and sin), each its :func:`source`; ``kind`` is the
    site's kind, its backward op's option."""
    return (kind, *(source(v) for v in values))


def calls(graph: fx.Graph, op: FusedOp) -> List[fx.Node]:
    """The calls of ``op`` in ``graph``, in graph order (from the graph's index of nodes by target)."""
    return graph.find_nodes(op="call_function", target=op.overload)


def forward_is_complex(graph: fx.Graph, gradient: set) -> bool:
    """Whether the forward computes with complex numbers (torchtitan's ``freqs_cis`` product)."""
    return any(n not in gradient and dtype(n) is not None and dtype(n).is_complex for n in graph.nodes)


def unpaired(backward_nodes: Sequence[fx.Node], forward_nodes: Sequence[fx.Node],
             key_backward: Callable[[fx.Node], Tuple], key_forward: Callable[[fx.Node], Tuple],
             misses: Sequence[Miss]) -> List[fx.Node]:
    """The backward nodes no forward node pairs with (by key first, then any forward left over
    pairs any backward), less one per recorded forward miss (a miss accounts for one site; it
    does not say which)."""
    left: Dict[Tuple, int] = collections.Counter(key_forward(n) for n in forward_nodes)
    lone = []
    for node in backward_nodes:
        key = key_backward(node)
        if left[key] > 0:
            left[key] -= 1
        else:
            lone.append(node)
    # a forward whose tables the program spelled differently from its backward's still pairs
    return lone[sum(left.values()) + len(misses):]


def _upstream(node: fx.Node, depth: int) -> List[fx.Node]:
    """``node``'s inputs and theirs, up to ``depth`` steps back (``node`` not among them)."""
    seen, frontier = {}, [node]
    for _ in range(depth):
        frontier = [a for n in frontier for a in n.all_input_nodes if a not in seen and a is not node]
        seen.update(dict.fromkeys(frontier))
    return list(seen)


def backwards_of_forward_misses(context: PassContext, forward_op: str, op: FusedOp, what: str,
                                backward_misses: Sequence[Miss], depth: int) -> List[Miss]:
    """One ``op`` miss for each recorded ``forward_op`` miss whose site's backward is in the graph and unaccounted.

    The forward misses are the context's (:attr:`~.context.PassContext.forward_misses`), at nodes of
    its :attr:`~.context.PassContext.forward_graph` (the graph itself when joint; a backward graph's
    forward, whose saved values its placeholders are named after). A site's backward is in the
    graph when a gradient reads a value the forward site read (up to ``depth`` steps before the
    miss's node, by name). The nodes of ``backward_misses`` and the fused ``op`` calls each account
    for one site whose values they or the gradients before them read. None on a graph without
    gradients (an inference graph: no backward to record)."""
    graph, forward_graph = context.graph, context.forward_graph
    forward_misses = [m for m in context.forward_misses if m.op == forward_op]
    gradient = gradient_dependent(graph)
    if gradient is None or forward_graph is None or not forward_misses:
        return []
    forward_nodes = {n.name: n for n in forward_graph.nodes}
    joint, provenance = forward_graph is graph, context.provenance
    sides: Dict[fx.Node, set] = {}

    def forward_side(value: fx.Node) -> set:
        """The forward values a value outside the gradients stands for, by name: itself in a joint
        graph; in a backward graph, also the saved values it is recomputed from."""
        if value not in sides:
            sides[value] = {value.name} | ({n.name for n in _upstream(value, depth)} if not joint else set())
        return sides[value]

    read_by_gradients: Dict[str, fx.Node] = {}  # a forward value's name -> the first gradient reading it
    for node in graph.nodes:
        if node in gradient:
            for a in node.all_input_nodes:
                if a not in gradient:
                    for name in forward_side(a):
                        read_by_gradients.setdefault(name, node)

    definitions: Dict[fx.Node, set] = {}

    def defined_from(value: fx.Node) -> set:
        """Name the forward values a saved backward input was computed from, ``depth`` steps back.

        A backward miss at a norm's weight gradient reads the saved normalized value, which the forward
        computed from the statistic its forward miss names."""
        if value not in definitions:
            definition = provenance.forward_definition(value) if not joint and provenance is not None \
                and value.op == "placeholder" else None
            definitions[value] = {n.name for n in _upstream(definition, depth)} if definition is not None else set()
        return definitions[value]

    def forward_reads(node: fx.Node) -> set:
        return {name for n in (node, *_upstream(node, depth)) if n is node or n in gradient
                for a in n.all_input_nodes if a not in gradient for name in forward_side(a) | defined_from(a)}
    by_name = {n.name: n for n in graph.nodes}
    accounted = [by_name[m.node] for m in backward_misses if m.node in by_name] + calls(graph, op)
    left = [forward_reads(n) for n in accounted]
    recorded = []
    for miss in forward_misses:
        site = forward_nodes.get(miss.node)
        values = {n.name for n in _upstream(site, depth)} if site is not None else set()
        readers = {read_by_gradients[v] for v in values if v in read_by_gradients}
        if not readers:
            continue  # no gradient of this site here: its backward is elsewhere, or there is none
        taken = next((i for i, reads in enumerate(left) if reads & (values | {miss.node})), None)
        if taken is not None:
            left.pop(taken)
            continue
        first = next(n for n in graph.nodes if n in readers)
        recorded.append(Miss(op.name, first.name, f"no {what} backward form reads it, and its forward is not "
                                                  f"{what}'s value (the forward's miss at {miss.node}): {miss.reason}"))
    return recorded
