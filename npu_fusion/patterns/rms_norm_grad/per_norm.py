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
from ..nodes import aten, calls_to, gradient_product, normalize_dim, shape
from ..norm_algebra import NormEvaluator, is_zero
from ..rms_statistic import CLAMPED_EPS_REASON, resembling_reason
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


def subject(ev: NormEvaluator, node: fx.Node) -> frozenset:
    """The forward values a near miss at ``node`` is about: the leaves beside its sums over the normalized axes.

    Those are the norm's x and statistic (``rstd**3 * x * sum(dy*g*x)``), of each norm whose reduction
    it reads: a recorded miss accounts for those norms' backward products only (:func:`.misses.unexplained`),
    not for another norm's that a residual stream carries into it."""
    v = ev.memo.get(node)
    terms = v.expr.split_terms() if v is not None and v.lead_sum is None else ()
    return frozenset(ev.node_of[s] for mono, _ in terms if any(s in ev.sum_body for s, _ in mono)
                     for s, _ in mono if s in ev.node_of and not ev.depends_on_gradient(ev.node_of[s]))


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
            and graph_constant(condition.args[1]) >= 0 and is_zero(zero) and isinstance(passed, fx.Node)):
        return False
    v = ev.memo.get(passed)
    sums = {s for s in v.expr.free_symbols if s in ev.sum_body} if v is not None and v.lead_sum is None else set()
    norms = {origin.get(s) for s in sums}
    claimed = {origin.get(s) for n in suspects for s in ev.memo[n].expr.free_symbols if s in ev.sum_body}
    return len(norms) == 1 and not norms & claimed and any(_dx_sum(ev, v.expr, s, "statistic") for s in sums)


def clamped_gate_reason(node: fx.Node) -> str:
    """The reason of a miss at a clamped norm's backward read on a graph alone (:func:`clamped_gate`)."""
    if graph_constant(node.args[0].args[1]) == 0:
        return ZERO_CLAMP_REASON.format(node=node.name)
    return (f"{CLAMPED_EPS_REASON} (read on a backward graph alone: {node.name} is clamp_min's backward, passing dx's "
            "rstd**3*sum(dy*g*x) term only where the saved mean square is at least eps)")


#: why clamp's backward at 0 over a norm's dx term stays unfused on a backward graph alone
ZERO_CLAMP_REASON = ("an RMSNorm whose mean square is clamped at 0 (clamp(mean(x*x), min=0) or clamp_min(..., 0)), "
                     "read on a backward graph alone: {node} is the clamp's backward, gating dx's rstd**3*sum(dy*g*x) "
                     "term on the saved mean square being >= 0, which only the forward's definition proves; on a "
                     "joint graph the norm fuses both ways, and without the clamp (a no-op on a mean of squares) "
                     "it fuses here too")


def other_axes_gates(graph: fx.Graph, gradient: Optional[set]) -> List[tuple]:
    """[(node, axes, subject)]: clamp_min's backward over a clamped norm's dx term whose sum runs over other axes than the last.

    On a backward graph alone, a norm whose mean runs over another axis (``mean(0).clamp_min(eps)``) has no
    sum over the last axes for the algebra to start from (:func:`clamped_gate` reads the last axes'):
    ``where(mean >= eps, t, 0)`` with ``t`` a product, through scalings, of a cubed forward value (dx's
    ``rstd**3``) and a keep-dim sum over those axes of a gradient times a forward value (``sum(dy*g*x)``);
    the subject is those forward values (:func:`subject`)."""
    found = []
    for node in calls_to(graph, aten.where.self) if gradient is not None else ():
        if len(node.args) != 3 or not isinstance(node.args[1], fx.Node) or not is_zero(node.args[2]):
            continue
        condition = node.args[0]
        if not (isinstance(condition, fx.Node) and condition.op == "call_function"
                and condition.target in (aten.ge.Scalar, aten.gt.Scalar) and isinstance(condition.args[0], fx.Node)
                and condition.args[0] not in gradient and graph_constant(condition.args[1]) is not None
                and graph_constant(condition.args[1]) >= 0):
            continue
        term = _other_axes_term(node.args[1], gradient)
        if term is not None:
            found.append((node, *term))
    return found


def _other_axes_term(node: fx.Node, gradient: set) -> Optional[tuple]:
    """``(axes, subject)`` when ``node`` is, through scalings, a cubed forward value (dx's ``rstd**3``) times one
    keep-dim sum over other axes than the last of a gradient times a forward value (``sum(dy*g*x)``); else None."""
    factors = _factors(node, gradient)
    cubed = [f.args[0] for f in factors if f.target is aten.pow.Tensor_Scalar and f.args[1] == 3
             and isinstance(f.args[0], fx.Node) and f.args[0] not in gradient]
    sums = [(f, _other_axes(f, gradient)) for f in factors if f.target is aten.sum.dim_IntList]
    sums = [(f, axes) for f, axes in sums if axes is not None]
    if not cubed or len(sums) != 1:
        return None
    # about the cubed statistic and the x its sum reads
    return sums[0][1], frozenset([*cubed, gradient_product(sums[0][0].args[0], gradient)[1]])


def other_axes_terms(graph: fx.Graph, gradient: Optional[set]) -> List[tuple]:
    """[(node, axes, subject)]: an unclamped norm's dx term whose sum runs over other axes than the last.

    On a backward graph alone, a norm over another axis (``x * rsqrt(x.pow(2).mean(0, keepdim=True) + eps)``)
    has no sum over the last axes for the algebra to start from: ``t``, a product of a cubed forward value and
    a keep-dim sum over those axes of a gradient times a forward value x (:func:`_other_axes_term`), read by
    no gate (:func:`other_axes_gates` reads those), carried by broadcasts and scalings by numbers to a product
    with a multiple of that same x: the mean of squares' backward, ``expand(t) / N * 2x``."""
    found = []
    for node in calls_to(graph, aten.mul.Tensor) if gradient is not None else ():
        if node not in gradient or any(u.target is aten.where.self for u in node.users):
            continue
        term = _other_axes_term(node, gradient)
        if term is not None and _times_its_x(node, term[1], gradient):
            found.append((node, *term))
    return found


#: what carries a mean's gradient to its summand's backward: broadcasts and scalings by numbers
_CARRIERS = (aten.expand.default, aten.mul.Scalar, aten.div.Scalar, aten.neg.default)


def _times_its_x(node: fx.Node, subject: frozenset, gradient: set, depth: int = 4) -> bool:
    """``node``, through :data:`_CARRIERS`, is multiplied by a multiple of a forward value of ``subject`` (its x)."""
    for user in node.users:
        if user.target in _CARRIERS and depth:
            if _times_its_x(user, subject, gradient, depth - 1):
                return True
        elif user.target is aten.mul.Tensor:
            other = [a for a in user.args[:2] if a is not node]
            if other and isinstance(other[0], fx.Node) and _scaled_base(other[0]) in subject:
                return True
    return False


def _scaled_base(node: fx.Node, depth: int = 3) -> fx.Node:
    """``node`` through scalings by numbers and ``pow(., 1.0)`` (the ``2 * x**1`` a square's backward writes)."""
    for _ in range(depth):
        if node.op == "call_function" and node.target in (aten.mul.Scalar, aten.div.Scalar) \
                or (node.op == "call_function" and node.target is aten.pow.Tensor_Scalar and node.args[1] == 1):
            node = node.args[0]
    return node


def _factors(node: fx.Node, gradient: set, depth: int = 4) -> List[fx.Node]:
    """The call nodes ``node`` multiplies together, read through products and scalings by numbers."""
    if node.op != "call_function":
        return []
    if depth and node.target is aten.mul.Tensor:
        return [f for a in node.args[:2] if isinstance(a, fx.Node) for f in _factors(a, gradient, depth - 1)]
    if depth and node.target in (aten.mul.Scalar, aten.div.Scalar, aten.neg.default):
        return _factors(node.args[0], gradient, depth - 1)
    return [node]


def _other_axes(node: fx.Node, gradient: set) -> Optional[List[int]]:
    """The axes of a keep-dim sum of a gradient times a forward value over other axes than the last ones, or None."""
    src = node.args[0]
    rank = len(shape(src) or ()) if isinstance(src, fx.Node) else 0
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if not rank or not keepdim or not node.args[1] or gradient_product(src, gradient) is None:
        return None
    dims = sorted(normalize_dim(d, rank) for d in node.args[1])
    return dims if dims != list(range(rank - len(dims), rank)) or len(dims) == rank else None


def other_axes_term_reason(node: fx.Node, axes: List[int]) -> str:
    """The reason of a miss at a norm's dx term over other axes read on a graph alone (:func:`other_axes_terms`)."""
    rank = len(shape(node) or ())
    over = "every axis of the tensor (an RMSNorm keeps a leading axis)" if rank == len(axes) else \
        f"axes {axes} of a rank-{rank} tensor, not its last axes"
    return resembling_reason(f"a mean of squares over {over} (read on a backward graph alone: {node.name} is dx's "
                             "rstd**3*sum(dy*g*x) term, its sum over those axes)")


def other_axes_gate_reason(node: fx.Node, axes: List[int]) -> str:
    """The reason of a miss at a clamped norm's backward over other axes read on a graph alone (:func:`other_axes_gates`)."""
    over = "every axis" if len(shape(node) or ()) == len(axes) else f"axes {axes}"
    return (f"{CLAMPED_EPS_REASON}; and its mean runs over {over}, not x's last axes (read on a backward graph alone: "
            f"{node.name} is clamp_min's backward, passing dx's rstd**3*sum(dy*g*x) term only where the saved mean "
            "square is at least eps)")
