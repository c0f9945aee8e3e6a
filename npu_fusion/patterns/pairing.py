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
"""
from __future__ import annotations

import collections
import operator
from typing import Callable, Dict, List, Sequence, Tuple

import torch.fx as fx

from ..lowering.fused_op import FusedOp
from .nodes import CAST_TARGETS, VIEWS, dtype
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
