"""What still looks like an RMSNorm backward after the last round: each one recorded miss, never silent."""
from __future__ import annotations

import functools
from typing import Dict, List, Optional

import torch.fx as fx

from ...lowering import RMS_NORM_GRAD as OP
from ...lowering.sizes import static_int
from ..evaluator import Provenance
from ..nodes import aten, calls_to, downstream, gradient_dependent, gradient_product, normalize_dim, shape
from ..rewrite import Miss
from .sites import DX_DEPTH, taken_norms
from ..rms_statistic import (EVERY_AXIS_REASON, clamped_statistic, definition_of, is_rms_statistic,
                             exact_source, fused_normalized_operand, fused_statistic_operand, normalized_operand,
                             over_every_axis, resembling_operand, resembling_reason, rms_statistic_operand,
                             spelled_root, unmatched_spelling)


def unexplained(graph: fx.Graph, provenance: Optional[Provenance], misses: List[Miss],
                subjects: Optional[Dict[str, frozenset]] = None) -> List[Miss]:
    """Record each RMSNorm the pass left in the graph that no form matched and no miss explains.

    No silent misses: a gradient multiplied by an RMS statistic (``rsqrt(mean(x*x) + eps)``,
    saved or recomputed), or by a normalized value and summed as a weight's gradient (a norm
    whose input takes no gradient), that is left in the graph after the pass, and that no
    recorded miss accounts for, is an RMSNorm no form matched. One norm is one miss: its dx's
    product (by the statistic) and its weight gradient's (by the normalized value) are grouped
    by the norm's statistic, and a recorded miss any of them reaches accounts for all (the nearest norm's
    miss: :func:`_accounted`), if it is about that norm: ``subjects`` are the forward values each near
    miss was read to be about (its norm's x and statistic, :func:`.per_norm.subject`), and a miss with
    them accounts only for the norms whose products read one of them."""
    gradient = gradient_dependent(graph)
    if gradient is None:
        return []
    missed = {m.node for m in misses}
    norms: Dict[object, list] = {}  # the norm's statistic (or the product itself) -> [node, reason, reach]
    reached = set()
    about = {name: {exact_source(n, provenance) for n in values} for name, values in (subjects or {}).items()}
    weight_gradient = _unfused_weight_gradient(graph, provenance, missed, about)
    for node in calls_to(graph, aten.mul.Tensor, aten.div.Tensor):  # what _forward_operand reads
        operand = _forward_operand(node, gradient)
        spelled = node if node.target is aten.div.Tensor else operand
        reason = unmatched_spelling(spelled, provenance) if operand is not None else None
        other = _other_statistic(operand, provenance) if operand is not None and reason is None else None
        if other is not None:  # a statistic no form reads: its dx and dgamma products, one miss keyed by its input
            reason = other[1]
        if operand is None or not (reason or is_rms_statistic(operand, provenance)
                                   or fused_statistic_operand(operand, provenance) is not None
                                   or weight_gradient(node, operand)):
            continue
        key = ("other", exact_source(other[0], provenance)) if other else _statistic_key(operand, spelled, provenance)
        if key is None and node in reached:
            continue  # no norm of its own: a product after one already counted (a residual stream carries a
            # norm's dx into the next norm's products, which count by their own statistic's key)
        reached |= set(downstream(graph, [node], 2 * DX_DEPTH))
        entry = norms.setdefault(key or node, [node, reason, []])
        entry[1] = entry[1] or reason or (UNIT_AXIS_REASON if _over_a_unit_axis(node) else None) or (
            EVERY_AXIS_REASON if over_every_axis(operand, provenance) else None)
        entry[2].append(node)
    accounted = _accounted([products for _, _, products in norms.values()], missed,
                           [_read(key, products, gradient, provenance) for key, (_, _, products) in norms.items()], about)
    return [Miss(OP.name, n.name, reason or (
        "a gradient scaled by an RMS statistic rsqrt(mean(x*x) + eps), or by the normalized value "
        "x*rsqrt(mean(x*x) + eps) and summed as a weight's gradient, that no RMSNorm form matched (run with "
        "TORCH_LOGS=npu_fusion and dump_graphs to see it)")) for i, (n, reason, _) in enumerate(norms.values())
        if i not in accounted]


def _accounted(norms: List[List[fx.Node]], missed: set, read: List[set], about: Dict[str, set]) -> set:
    """The indices of the norms (each its backward products) a recorded miss accounts for.

    A recorded miss at a node at most ``2 * DX_DEPTH`` uses after a norm's products accounts for
    that norm, and only for the norms nearest it (fewest uses): a residual stream carries each
    norm's dx into the next norm's backward, so an earlier norm's products reach a later norm's
    miss too, and that miss says nothing of them. A miss known to be about some forward values
    (``about``, by its node's name) accounts only for the norms whose products read one of them
    (``read``, per norm): a near miss of a norm the scan has no products of (eps outside the root:
    no statistic) is nearest to the next norm's products, and is still not about them."""
    nearest: Dict[str, tuple] = {}  # a missed node's name -> (uses from the nearest norms, their indices)
    for i, products in enumerate(norms):
        seen, frontier = set(products), list(products)
        for uses in range(2 * DX_DEPTH + 1):
            for n in frontier:
                if n.name in missed and (n.name not in about or about[n.name] & read[i]):
                    best = nearest.get(n.name, (uses, set()))
                    if uses < best[0]:
                        best = (uses, set())
                    if uses == best[0]:
                        best[1].add(i)
                    nearest[n.name] = best
            frontier = [u for n in frontier for u in n.users if u not in seen]
            seen.update(frontier)
    return {i for _, indices in nearest.values() for i in indices}


def _read(key, products: List[fx.Node], gradient: set, provenance: Optional[Provenance]) -> set:
    """The forward values (exact sources) a norm's backward products read: each product's operand, the
    factors of its definition (x and the statistic of a normalized value), and the norm's key's."""
    found = {k for k in (key if isinstance(key, tuple) else (key,)) if isinstance(k, fx.Node)}
    for product in products:
        operand = _forward_operand(product, gradient)
        definition = definition_of(operand, provenance)
        found |= {operand, definition}
        if definition.op == "call_function" and definition.target in (aten.mul.Tensor, aten.div.Tensor):
            found.update(a for a in definition.args[:2] if isinstance(a, fx.Node))
    return {exact_source(n, provenance) for n in found}


#: why an RMSNorm over a last axis of size 1 keeps its backward decomposed
UNIT_AXIS_REASON = ("a norm over a last axis of size 1 (hidden size 1) whose backward matched no RMSNorm form: "
                    "autograd writes it without the sum over that axis, so the pass reads it as "
                    "rstd*dy*g - rstd**3*x*(dy*g*x) per element, and this one differs (another statistic, a "
                    "missing term); per element the norm is x * rsqrt(x*x + eps) * w, cheap as it is")


def _other_statistic(operand: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """``(y, reason)`` when ``operand`` is, or is y normalized by, a statistic of y no form reads.

    Eps bounding the mean square (:func:`clamped_statistic`), another axis or a scaled mean
    (:func:`resembling_operand`): the reason says how it differs, as the forward's miss does. The norm
    of y is one miss, its dx's product and its weight gradient's (a norm whose input takes no gradient)."""
    found = clamped_statistic(operand, provenance) or normalized_operand(operand, provenance, clamped_statistic)
    if found:
        return found[0], found[2]
    found = resembling_operand(operand, provenance) or normalized_operand(operand, provenance, resembling_operand)
    return (found[0], resembling_reason(found[2])) if found else None


def _over_a_unit_axis(node: fx.Node) -> bool:
    """``node`` (a gradient's product in a norm's backward) has a last axis of size 1: a norm over one element."""
    s = shape(node)
    return bool(s) and static_int(s[-1]) == 1


def _statistic_key(operand: fx.Node, spelled: fx.Node, provenance: Optional[Provenance]):
    """The norm a backward product belongs to, as one key per norm.

    One key per norm for the products of its backward: its statistic (the exact source, one key
    for a forward value and its saved or recomputed copy) where ``operand`` is the statistic or a
    value normalized by it, decomposed or fused; the root of a spelling no form reads (``spelled``:
    the product's node where it divides, else ``operand``); None where it is none of them. Two norms
    of one input with statistics of their own are two keys."""
    def statistic(node):
        if rms_statistic_operand(node, provenance) is not None:
            return exact_source(node, provenance)
        fused = fused_statistic_operand(node, provenance)
        return ("fused", exact_source(fused[0], provenance)) if fused is not None else None
    key = statistic(operand)
    if key is not None:
        return key
    node = definition_of(operand, provenance)
    if node.op == "call_function" and node.target is aten.mul.Tensor:
        key = next((k for k in (statistic(a) for a in node.args[:2] if isinstance(a, fx.Node)) if k is not None), None)
        if key is not None:
            return key
    fused = fused_normalized_operand(operand, provenance)  # a fused y with a weight of ones
    if fused is not None:
        return ("fused", exact_source(fused[0], provenance))
    return spelled_root(spelled, provenance)


def _forward_operand(node: fx.Node, gradient: set) -> Optional[fx.Node]:
    """The forward operand of a gradient times a forward value, or of a gradient divided by one."""
    product = gradient_product(node, gradient)
    if product is not None:
        return product[1]
    if node.op == "call_function" and node.target is aten.div.Tensor and node.args[0] in gradient \
            and isinstance(node.args[1], fx.Node) and node.args[1] not in gradient:
        return node.args[1]
    return None


def _unfused_weight_gradient(graph: fx.Graph, provenance: Optional[Provenance], missed: set, about: Dict[str, set]):
    """Test whether a product is an unaccounted weight gradient of an RMSNorm.

    A test of (product, forward operand): a gradient times a normalized value
    ``y * rsqrt(mean(y*y) + eps)`` summed over leading axes (a weight's gradient, as a norm
    whose input takes no gradient has), of a norm neither a fused op in the graph covers (a
    fused dx whose dgamma the rewrite left to the program, with a note) nor a recorded miss
    (one at a node its statistic reaches: the norm's dx left unfused with the reason; one known to
    be about other forward values, ``about`` by its node's name, is another norm's)."""
    @functools.lru_cache(maxsize=None)  # computed once, and only where such a product is left
    def covered() -> frozenset:
        taken = taken_norms(graph, provenance, [])
        for node in graph.nodes:
            stat = rms_statistic_operand(node, provenance) if node.op in ("placeholder", "call_function") else None
            norm = {exact_source(node, provenance), exact_source(stat[0], provenance)} if stat is not None else set()
            if stat is not None and any(n.name in missed and (n.name not in about or about[n.name] & norm)
                                        for n in downstream(graph, [node], 2 * DX_DEPTH)):
                taken.add(exact_source(stat[0], provenance))
        return frozenset(taken)

    def summed_over_leading_axes(node: fx.Node, k: int) -> bool:
        rank = len(shape(node))
        return any(s.op == "call_function" and s.target is aten.sum.dim_IntList and s.args[1]
                   and len(shape(s.args[0])) == rank and all(normalize_dim(d, rank) < rank - k for d in s.args[1])
                   for s in downstream(graph, [node], 2))

    def test(node: fx.Node, operand: fx.Node) -> bool:
        stat = normalized_operand(operand, provenance) or fused_normalized_operand(operand, provenance)
        return (stat is not None and summed_over_leading_axes(node, stat[1])
                and exact_source(stat[0], provenance) not in covered())
    return test
