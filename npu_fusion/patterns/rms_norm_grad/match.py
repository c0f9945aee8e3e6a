"""RMSNorm backward matching: dx and dgamma recognised by value in the norm algebra."""
from __future__ import annotations

import dataclasses
import itertools
from typing import List, Optional

import torch.fx as fx

from ...lowering.sizes import same_shape, static_int
from ..algebra import Expr
from ..evaluator import Unsupported
from ..norm_algebra import NormEvaluator
from ..nodes import region_of, shape
from ..rewrite import gradient_accumulation


# -- matching -----------------------------------------------------------------

@dataclasses.dataclass
class NormMatch:
    dx: fx.Node                 # the node whose value is dx (plus ``rest``)
    dy: fx.Node
    x: fx.Node
    rstd: fx.Node
    gamma: Optional[fx.Node]
    ev: NormEvaluator
    parts: List[fx.Node] = dataclasses.field(default_factory=list)  # summands that make up dx
    rest: List[fx.Node] = dataclasses.field(default_factory=list)   # other gradients summed into dx's node
    chain: List[fx.Node] = dataclasses.field(default_factory=list)  # the adds that sum parts and rest
    dgamma: Optional[fx.Node] = None
    #: a dgamma-only site: the statistics it was matched against (to match it again)
    candidates: list = dataclasses.field(default_factory=list)
    #: the fused op's rstd is ``rstd ** rstd_power``: 1 where the program holds rstd itself, else the
    #: power of the statistic it holds (-1 of a root ``x / sqrt(...)`` divides by)
    rstd_power: object = 1

    @property
    def roles(self):
        return (self.dy, self.x, self.rstd, self.gamma)

    @property
    def dgamma_only(self) -> bool:
        """A norm whose input takes no gradient: the site is its dgamma (``dx`` names it too);
        ``rstd`` None when the backward holds only the normalized value (then ``x``)."""
        return self.dx is self.dgamma


def expected_dx(ev: NormEvaluator, dy: Expr, x: Expr, r: Expr, g: Expr) -> Expr:
    return r * dy * g - r ** 3 * x * ev.sum_over_normalized(dy * g * x) / ev.n


def symbols_of(mono) -> set:
    return {s for s, _ in mono}


def match_dx(ev: NormEvaluator, node: fx.Node, expr: Expr) -> Optional[NormMatch]:
    """Read the roles off the two terms of ``r*dy*g - r**3*x*S[dy*g*x]/N``, then check equality."""
    if ev.unit:
        return _match_over_unit_axes(ev, node, expr)
    sums = {s for s in expr.free_symbols if s in ev.sum_body}
    terms = [mono for mono, _ in expr.split_terms()]
    plain = [m for m in terms if not (symbols_of(m) & sums)]
    summed = [m for m in terms if symbols_of(m) & sums]
    if len(sums) != 1 or len(plain) != 1 or len(summed) != 1:
        return _match_gradient_sum(ev, node, expr, sums) if sums and plain and summed else None

    def leaves(term, varying, full_shape=None, rank=None):
        nodes = [ev.node_of[s] for s in symbols_of(term) if s in ev.node_of]
        return [n for n in nodes if (ev.symbol_of[n] in ev.varying) == varying
                and (full_shape is None or same_shape(shape(n), full_shape))
                and (rank is None or len(shape(n)) == rank)]

    full = shape(node)
    stats, gammas = statistic_powers(ev, plain[0]), leaves(plain[0], True, rank=ev.k) + [None]
    candidates = itertools.product(stats, leaves(plain[0], True, full_shape=full), gammas,
                                   leaves(summed[0], True, full_shape=full))
    for (r, power), dy, g, x in candidates:
        if len({r, dy, g, x}) == 4 and expr == expected_dx(ev, ev.symbol(dy), ev.symbol(x), ev.value_of(r) ** power,
                                                           ev.value_of(g)):
            return NormMatch(node, dy, x, r, g, ev, rstd_power=power)
    return _match_expression_roles(ev, node, expr, stats, gammas, sums)


def _match_over_unit_axes(ev: NormEvaluator, node: fx.Node, expr: Expr) -> Optional[NormMatch]:
    """dx of a norm over axes of static size 1: ``r*dy*g - r**3*x*(dy*g*x)``.

    Autograd elides the sum over unit axes (it is its summand), so no sum tells the roles apart;
    each assignment of the roles (dy a gradient, rstd and x none) is checked against the whole
    formula. dy and x are leaves, or nodes dx is computed from (:func:`_computed_roles`): the
    gradient of an output read again (``y * y``, ``exp(y)``, ``2 * y``) is no leaf."""
    nodes = [ev.node_of[s] for s in sorted(expr.free_symbols) if s in ev.node_of]
    full = shape(node)
    fulls = [n for n in nodes if same_shape(shape(n), full)]
    computed = _computed_roles(ev, node, full)
    dys = list(dict.fromkeys(n for n in fulls + computed if ev.depends_on_gradient(n)))
    xs = list(dict.fromkeys(n for n in fulls + computed if not ev.depends_on_gradient(n)))
    gammas = [n for n in nodes if len(shape(n)) == ev.k and all(static_int(x) == 1 for x in shape(n))] + [None]
    stats = list(dict.fromkeys(p for m, _ in expr.split_terms() for p in statistic_powers(ev, m)))
    # a weight first: with none, ``dy * g`` would pass for dy and dgamma be left unmatched
    for g, (r, power), dy, x in itertools.product(gammas, stats, dys, xs):
        if len({r, dy, g, x}) == 4 and not ev.depends_on_gradient(r) and expr == expected_dx(
                ev, ev.value_of(dy), ev.value_of(x), ev.value_of(r) ** power, ev.value_of(g)):
            return NormMatch(node, dy, x, r, g, ev, rstd_power=power)
    return None


#: uses between a unit-axis dx and the computed dy or x it is made of (``dy * g``, ``* rstd``, the
#: second term's products, the subtraction, casts)
UNIT_ROLE_REACH = 8


def _computed_roles(ev: NormEvaluator, node: fx.Node, full) -> List[fx.Node]:
    """The evaluated nodes of shape ``full`` that ``node`` is computed from, within :data:`UNIT_ROLE_REACH` uses."""
    found, frontier = [], [node]
    for _ in range(UNIT_ROLE_REACH):
        frontier = list(dict.fromkeys(a for n in frontier for a in n.all_input_nodes
                                      if ev.memo.get(a) is not None and a.op != "placeholder"))
        found += [a for a in frontier if same_shape(shape(a), full) and ev.memo[a].lead_sum is None]
    return list(dict.fromkeys(found))


def statistic_powers(ev: NormEvaluator, term) -> List[tuple]:
    """The candidate rstds of ``term``: its factors that are powers of a leaf.

    ``(node, power)`` for each factor ``s**e`` of ``term`` constant along the normalized axes,
    ``s`` a leaf: the candidate rstd is ``s**e``, the node whose value that is where the program
    computed it (``power`` 1: an ``rsqrt``, a saved ``(mean(x*x) + eps) ** -0.5``), else ``s``'s
    node with ``power`` e (a root the program divides by: ``e`` -1); each of a keep-dim shape,
    as the fused op reads rstd (a statistic taken with ``keepdim=False`` is read where the program
    unsqueezes it)."""
    found = []
    for s, e in term:
        if s not in ev.node_of or s in ev.varying:
            continue
        computed = ev.keep_dim_node_with_value(Expr({((s, e),): 1}))
        node = ev.keep_dim_node_with_value(Expr.symbol(s))  # not a copy that drops the normalized axes
        if computed is not None or node is not None:
            found.append((computed, 1) if computed is not None else (node, e))
        if node is not None and e not in (1, -1):  # a power of rstd itself (dy reads y: r**2 in dy*g*r)
            found.append((node, 1 if e > 0 else -1))
    return found


def rstd_value(ev: NormEvaluator, site: "NormMatch") -> Expr:
    """The value of the fused op's rstd: the rstd role's to the site's :attr:`NormMatch.rstd_power`."""
    return ev.value_of(site.rstd) ** site.rstd_power if site.rstd is not None else Expr.number(1)


def _match_expression_roles(ev: NormEvaluator, node, expr: Expr, stats, gammas, sums) -> Optional[NormMatch]:
    """dy or x that are not leaves but any node of the right value: a gated norm's dy is
    ``grad * gate``, a post-norm's x the previous norm's output. The plain term gives dy's
    value, the summed body (what varies along the normalized axes of dy*g*x) x's varying
    part; each candidate is then checked against the whole formula."""
    (total,) = sums
    (plain, plain_coef), = [(m, c) for m, c in expr.split_terms() if total not in symbols_of(m)]
    full = shape(node)
    for (r, power), g in itertools.product(stats, gammas):
        gs, rs = ev.value_of(g), ev.value_of(r) ** power
        dy = ev.node_with_value(Expr({plain: plain_coef}) / (rs * gs), full)
        if dy is None or len(ev.value_of(dy).terms) != 1:
            continue
        known = Expr({ev.varying_part(next(iter((ev.value_of(dy) * gs).terms))): 1})
        x_body = Expr({ev.sum_body[total]: 1}) / known
        for x in ev.nodes_varying_as(next(iter(x_body.terms)), full):
            if len({r, dy, g, x}) == 4 and expr == expected_dx(ev, ev.value_of(dy), ev.value_of(x), rs, gs):
                return NormMatch(node, dy, x, r, g, ev, rstd_power=power)
    return None


def _match_gradient_sum(ev: NormEvaluator, node, expr: Expr, sums) -> Optional[NormMatch]:
    """dy a node whose value has several terms: the sum of the gradients of several readers of the
    norm's output (a final norm feeding a head and squared in an auxiliary loss: ``dy`` holds
    ``2 * y * c``, with y itself ``rstd * x * g``). Its value is the terms of dx free of the sum over
    the normalized axes, divided by ``rstd * g``; the sum over the normalized axes of ``dy * g * x``
    then expands into several sums, and the whole formula is checked."""
    plain = Expr({m: c for m, c in expr.split_terms() if not (symbols_of(m) & sums)})
    first = next(iter(plain.terms))
    full = shape(node)
    varying = lambda term, **kw: [ev.node_of[s] for s in symbols_of(term) if s in ev.node_of  # noqa: E731
                                  and s in ev.varying and _shape_fits(ev.node_of[s], **kw)]
    gammas = varying(first, rank=ev.k) + [None]
    xs = list(dict.fromkeys(n for m, _ in expr.split_terms() if symbols_of(m) & sums
                            for n in varying(m, full_shape=full)))
    # rstd * g divides every term of dy's: rstd is one of the statistic's powers there
    stats = list(dict.fromkeys(p for m in plain.terms for p in statistic_powers(ev, m)))
    for (r, power), g in itertools.product(stats, gammas):
        gs, rs = ev.value_of(g), ev.value_of(r) ** power
        try:
            dy = ev.node_with_value(plain / (rs * gs), full)
        except Unsupported:
            continue
        if dy is None or not ev.depends_on_gradient(dy):
            continue
        for x in xs:
            if len({r, dy, g, x}) == 4 and expr == expected_dx(ev, ev.value_of(dy), ev.value_of(x), rs, gs):
                return NormMatch(node, dy, x, r, g, ev, rstd_power=power)
    return None


def _shape_fits(node: fx.Node, full_shape=None, rank=None) -> bool:
    return (full_shape is None or same_shape(shape(node), full_shape)) and (rank is None or len(shape(node)) == rank)


def stat_leaves(ev: NormEvaluator, expr) -> frozenset:
    return frozenset(s for s in expr.free_symbols if s in ev.node_of and s not in ev.varying)


def match_root(ev: NormEvaluator, root: fx.Node, stop) -> Optional[NormMatch]:
    v = ev.memo.get(root)
    if v is not None and v.lead_sum is None:
        found = match_dx(ev, root, v.expr)
        if found is not None:
            found.parts = [root]
            return found
    summands, adds = gradient_accumulation(root, stop)
    if len(summands) < 3:
        return None
    # dx's terms are the summands with this norm's rstd in every term (another norm's rstd
    # may be there too: a post-norm's output is this norm's x)
    exprs = {n: ev.memo[n].expr for n in summands if isinstance(n, fx.Node) and ev.memo.get(n) is not None
             and ev.memo[n].lead_sum is None}
    stats = dict.fromkeys(s for e in exprs.values() for s in sorted(stat_leaves(ev, e)))
    for stat in stats:
        parts = [n for n, e in exprs.items() if all(stat in symbols_of(m) for m, _ in e.split_terms())]
        if len(parts) < 2:
            continue
        found = match_dx(ev, root, sum((exprs[n] for n in parts), Expr.number(0)))
        if found is not None:
            found.parts = parts
            found.rest = [n for n in summands if n not in parts]
            found.chain = adds
            return found
    return None


def dgamma_summand(ev: NormEvaluator, site: NormMatch) -> Expr:
    return ev.value_of(site.dy) * ev.value_of(site.x) * rstd_value(ev, site)


def match_dgamma(ev: NormEvaluator, node: fx.Node, site: NormMatch) -> bool:
    """``node`` sums ``dy * x * rstd`` over exactly the leading axes, to gamma's shape."""
    v = ev.memo.get(node)
    if v is None or v.lead_sum is None or site.gamma is None:
        return False
    summand, dims = v.lead_sum
    rank = len(shape(summand))
    return (same_shape(shape(node), shape(site.gamma)) and same_shape(shape(summand), shape(site.dx))
            and all(d in dims or static_int(shape(summand)[d]) == 1 for d in range(rank - ev.k))
            and v.expr == dgamma_summand(ev, site))


def site_region(site: NormMatch, outputs) -> List[fx.Node]:
    roles = {n for n in site.roles if n is not None}
    ev = site.ev
    interior = lambda n: (n in ev.interpreted and n not in roles and n not in site.rest  # noqa: E731
                          and ev.depends_on_gradient(n))
    region = region_of(list(site.parts) + [o for k, o in outputs.items() if k != "dx"], interior)
    return list(dict.fromkeys(region + site.chain + [site.dx]))
