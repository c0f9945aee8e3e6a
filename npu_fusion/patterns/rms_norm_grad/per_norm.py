"""One near miss per RMSNorm: which norm's reduction a dx-shaped node reads, and clamp_min's backward on a graph alone.

A norm's unmatched dx flows on into what follows it (a residual stream's gradient, the next norm's
dy, its products), and those nodes still normalize like it: each norm is named once, by the
reduction its sums come from (:func:`sum_origins`). A norm whose eps bounds the mean square
(``rsqrt(clamp_min(mean(x*x), eps))``) shows on a backward graph alone (no forward to read its
statistic's definition from) only as clamp_min's backward gating dx's ``rstd**3*sum(dy*g*x)`` term
(:func:`clamped_gate`), where the algebra stops.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch.fx as fx

from ..algebra import graph_constant
from ..evaluator import JointProvenance, Provenance
from ..nodes import aten
from ..norm_algebra import NormEvaluator
from ..rms_statistic import CLAMPED_EPS_REASON
from .match import symbols_of


def sum_origins(ev: NormEvaluator) -> Dict[int, fx.Node]:
    """The reduction each sum over the normalized axes is made by: one norm's.

    The reduction each sum over the normalized axes is made by (a sum or mean whose value holds it and
    whose input's does not). A reduction whose summand holds earlier sums (a residual stream's
    gradient carrying a norm's dx into the next norm's ``sum(dy*g*x)``) expands into several sums,
    all of that one reduction: one norm."""
    origin: Dict[int, fx.Node] = {}
    for node, v in ev.memo.items():
        if v is None or node.op != "call_function" or node.target not in (aten.sum.dim_IntList, aten.mean.dim):
            continue
        below = {s for a in node.all_input_nodes if ev.memo.get(a) is not None for s in ev.memo[a].expr.free_symbols}
        for s in v.expr.free_symbols:
            if s in ev.sum_body and s not in below:
                origin.setdefault(s, node)
    return origin


def one_per_norm(ev: NormEvaluator, suspects: List[fx.Node], origin: Dict[int, fx.Node]) -> List[fx.Node]:
    """The suspects (in graph order) that each read a norm's reduction no earlier one reads: one miss per norm.

    A norm's unmatched dx flows on (a residual stream's gradient, the next norm's dy and its
    products): the nodes after it still normalize like it, by the same sums, and name no other norm."""
    claimed, kept = set(), []
    for n in suspects:
        norms = {origin.get(s) for s in ev.memo[n].expr.free_symbols if s in ev.sum_body}
        if norms - claimed:
            kept.append(n)
            claimed |= norms
    return kept


def accumulated_suspects(ev: NormEvaluator, suspects: List[fx.Node], accumulated: List[fx.Node],
                          origin: Dict[int, fx.Node]) -> List[fx.Node]:
    """The nodes of ``accumulated`` that add one more norm's unmatched dx to earlier suspects' (in graph order).

    A residual stream's gradient sums each norm's dx into the next: where no norm matched (a backward
    alone whose statistics cannot be proven), the second norm's dx is read with the first's sums in it,
    and so on. A node whose sums over the normalized axes are an earlier suspect's but one norm's (one
    reduction's, :func:`sum_origins`), those a dx's (:func:`_dx_sum`: beside x, else beside its cubed
    statistic where no node of the norm beside x is read), is that norm's suspect: one per norm, none silent."""
    claimed = {s for n in suspects for s in ev.memo[n].expr.free_symbols if s in ev.sum_body}
    found = []
    # sums of dx first; a dx's summed term alone (the sum beside it too many symbols to read) last
    ordered = sorted(accumulated, key=lambda n: len(ev.memo[n].expr.terms) == 1)
    for beside in ("x", "statistic"):
        for n in ordered:
            expr = ev.memo[n].expr
            new = {s for s in expr.free_symbols if s in ev.sum_body} - claimed
            if len({origin.get(s) for s in new}) == 1 and any(_dx_sum(ev, expr, s, beside) for s in new):
                found.append(n)
                claimed |= new
    return found


def _dx_sum(ev: NormEvaluator, expr, total, beside: str = "x") -> bool:
    """Whether ``total`` is a sum a dx term of ``expr`` reads: of a product of degree >= 2 (dy*g*x), beside x
    (``beside="statistic"``: beside a cubed leaf constant along the normalized axes, dx's ``rstd**3``)."""
    def term(mono) -> bool:
        if beside == "x":
            return bool(symbols_of(mono) & ev.varying)
        return any(e == 3 and s in ev.node_of and s not in ev.varying for s, e in mono)
    return sum(abs(e) for _, e in ev.sum_body[total]) >= 2 and any(
        total in symbols_of(m) and term(m) for m, _ in expr.split_terms())


def backward_alone(provenance: Optional[Provenance]) -> bool:
    """The graph is a backward without its forward graph: no saved tensor's definition to read."""
    return not isinstance(provenance, JointProvenance) and (provenance is None or provenance.forward is None)


def clamped_gate(ev: NormEvaluator, node: fx.Node, suspects: List[fx.Node], origin: Dict[int, fx.Node]) -> bool:
    """``node`` is clamp_min's backward over a clamped norm's dx term: ``where(mean >= eps, t, 0)``.

    ``t`` is, in the algebra, one norm's sums over the normalized axes (one reduction's,
    :func:`sum_origins`), one of a product of degree >= 2 beside a cubed statistic (dx's
    ``-rstd**3*sum(dy*g*x)/2``), the condition compares a forward value with a number eps >= 0, and
    the other branch is zero: the gradient of ``clamp_min(mean(x*x), eps)``. None of ``suspects``
    (the near misses recorded beside it) reads that norm."""
    if node.op != "call_function" or node.target is not aten.where.self or len(node.args) != 3:
        return False
    condition, passed, zero = node.args
    if not (isinstance(condition, fx.Node) and condition.op == "call_function"
            and condition.target in (aten.ge.Scalar, aten.gt.Scalar) and isinstance(condition.args[0], fx.Node)
            and not ev.depends_on_gradient(condition.args[0]) and graph_constant(condition.args[1]) is not None
            and graph_constant(condition.args[1]) >= 0 and _is_zero(zero) and isinstance(passed, fx.Node)):
        return False
    v = ev.memo.get(passed)
    sums = {s for s in v.expr.free_symbols if s in ev.sum_body} if v is not None and v.lead_sum is None else set()
    norms = {origin.get(s) for s in sums}
    claimed = {origin.get(s) for n in suspects for s in ev.memo[n].expr.free_symbols if s in ev.sum_body}
    return len(norms) == 1 and not norms & claimed and any(_dx_sum(ev, v.expr, s, "statistic") for s in sums)


def _is_zero(value) -> bool:
    """A zero number, or the zero scalar tensor AOTAutograd writes for one."""
    if isinstance(value, fx.Node):
        return value.op == "call_function" and value.target is aten.scalar_tensor.default and \
            graph_constant(value.args[0]) == 0
    return graph_constant(value) == 0


def clamped_gate_reason(node: fx.Node) -> str:
    """The reason of a miss at a clamped norm's backward read on a graph alone (:func:`clamped_gate`)."""
    return (f"{CLAMPED_EPS_REASON} (read on a backward graph alone: {node.name} is clamp_min's backward, passing dx's "
            "rstd**3*sum(dy*g*x) term only where the saved mean square is at least eps)")
