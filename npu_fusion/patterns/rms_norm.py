"""Fuse RMSNorm backward subgraphs into ``npu_fusion.rms_norm_grad``.

Unfused, as AOTAutograd writes the backward of HF ``LlamaRMSNorm``
(``weight * (x32 * rsqrt(mean(x32**2) + eps)).to(dtype)``)::

    g32    = _to_copy(mul(dy, weight), float32)
    s      = sum(mul(g32, x32), [-1], keepdim)
    dvar   = div(expand(mul(mul(s, -0.5), pow(rstd, 3))), D)
    dx     = _to_copy(add(mul(g32, rstd), mul(dvar, mul(pow(x32, 1), 2))), dtype)
    dgamma = view(sum(mul(dy, x_hat), leading axes), [D])

Fused::

    dx, dgamma = npu_fusion.rms_norm_grad(dy, x, rstd, gamma)

How a match is found: nodes are evaluated symbolically in the norm domain
(:mod:`.norm_algebra`, with RMSNorm's bounds: :func:`norm_evaluator`; exact Laurent
polynomials, :mod:`.algebra`; one small interpreter per aten op, in the tables
:attr:`NormEvaluator.FORWARD_SAFE` and :attr:`NormEvaluator.BACKWARD_ONLY`, with
any other op a leaf) with the normalized axes as an abstract index: a
leaf is a symbol, ``x_i`` when it spans the normalized axes and ``r`` when it is
constant along them (``rstd``), and a sum over the normalized axes becomes a
symbol ``S[monomial]`` after expanding its summand. A node is dx when its expression equals, for some leaves,
``r*dy*g - r**3 * x * S[dy*g*x] / N`` (docs/fused-ops.md#rms_norm_grad), and dgamma when it is
``dy * x * r`` summed over exactly the leading axes to gamma's shape. Equality is
algebraic, so eps outside the square root, a wrong exponent or a missing term
do not match.

A norm whose input takes no gradient (applied to a model input) has no dx: its
backward is only ``dgamma = sum(dy * x_hat)`` over the leading axes, and the
algebra cannot tell rstd from any other factor there. So the statistic is proven
by its definition (:func:`rms_statistic_operand`, through casts, reshapes and
saved tensors' forward definitions): rstd is ``rsqrt(mean(x*x, last k axes) + eps)``
with a number eps inside the root, of the very tensor x the product reads (not a
centred LayerNorm value). The backward holds either x and rstd (min-cut, or
recomputed): dgamma is ``sum(dy * x * rstd)``; or only the saved normalized value
``x_hat = x * rstd`` (default partitioner), proven so by its forward definition
(:func:`normalized_operand`): dgamma is ``sum(dy * x_hat * 1)``, and the fused op
reads x_hat as x with an rstd of ones. Either way the site is ``rms_norm_grad``
with only its dgamma output used, through the dx form's emit path (dtype table,
chip limits, gamma of ones, rounding rules). A norm a dx site covers (this round,
or fused by an earlier one whose dgamma may be left to the program on purpose) is
never read again as a dgamma-only site.

The whole ops (last section). torch 2.13 routes ``F.rms_norm`` to
``aten._fused_rms_norm``, which decomposes (CompositeImplicitAutograd) except on a
device with its own kernel (CUDA, MPS, XPU); there autograd's backward is
``aten._fused_rms_norm_backward(dy, x, normalized_shape, rstd, weight,
output_mask) -> (dx, dweight)`` and AOTAutograd keeps it whole. Its rstd is
``rsqrt(mean(x**2) + eps)`` (float32 for fp16/bf16/fp32 x, keep-dim shaped; the
plain ``x.shape[:n]`` is taken too), the same 1/RMS as RmsNormGrad's, so each call
is rewritten into ``rms_norm_grad(dy, x, rstd, weight or ones)`` with the outputs
``output_mask`` asks for, cast back to the call's dtypes and shapes, under the same
dtype table and chip limits, or left whole as a miss with the reason. No torch_npu
line from 2.6.0 to 2.14.0 registers an NPU kernel for either op (read in the
wheels; docs/compatibility.md has the table), so on torch_npu the decomposed form is what the
pass sees today. A whole forward ``_fused_rms_norm`` is not rewritten (and has no torchair
converter): each one is recorded as a miss, by the forward rule where it runs.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from typing import Dict, List, Optional

import torch
import torch.fx as fx

from ..compat import FUSED_RMS_NORM, FUSED_RMS_NORM_BACKWARD
from ..lowering import RMS_NORM as FORWARD_OP, RMS_NORM_GRAD as OP
from ..lowering.ops.rms_norm_grad import RMS_NORM_DTYPES, rms_norm_target_problem
from ..lowering.sizes import same_shape, static_int
from .algebra import Expr, graph_constant
from .evaluator import JointProvenance, Provenance, Unsupported, kept_precision, rounding_problem
from .norm_algebra import NormEvaluator, size_key
from .nodes import (CAST_TARGETS, VIEWS, aten, downstream, dtype, gradient_dependent, gradient_product,
                    is_value_preserving_cast, last_of, normalize_dim, outermost, region_of, shape, val)
from .rewrite import (Edit, Insertion, Miss, RuleContext, Site, add_back_accumulated, commit, emit_fused_op,
                      exact_common_dtype, gradient_accumulation)
from .pairing import NORM_SITE, site_key
from .rule import Form, FusionRule, RoundReport, SiteProbe
#: RMSNorm's backward involves dy, x, gamma, rstd and one sum, where x may be a chain of
#: earlier norms' outputs (two symbols each): anything with many more leaves is some other
#: computation, and expanding it would only cost time
MAX_SYMBOLS = 16
#: rstd is an input of the fused op: the evaluator keeps it a leaf
POLICY_LEAVES = frozenset({aten.rsqrt.default})


def norm_evaluator(norm_shape, provenance: Optional[Provenance] = None, forced_leaves=()) -> NormEvaluator:
    """The norm domain's evaluator with RMSNorm's bounds."""
    return NormEvaluator(norm_shape, provenance, forced_leaves, max_symbols=MAX_SYMBOLS, policy_leaves=POLICY_LEAVES)


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


def _symbols(mono) -> set:
    return {s for s, _ in mono}


def match_dx(ev: NormEvaluator, node: fx.Node, expr: Expr) -> Optional[NormMatch]:
    """Read the roles off the two terms of ``r*dy*g - r**3*x*S[dy*g*x]/N``, then check equality."""
    sums = {s for s in expr.free_symbols if s in ev.sum_body}
    terms = [mono for mono, _ in expr.split_terms()]
    plain = [m for m in terms if not (_symbols(m) & sums)]
    summed = [m for m in terms if _symbols(m) & sums]
    if len(sums) != 1 or len(plain) != 1 or len(summed) != 1:
        return _match_gradient_sum(ev, node, expr, sums) if sums and plain and summed else None

    def leaves(term, varying, full_shape=None, rank=None):
        nodes = [ev.node_of[s] for s in _symbols(term) if s in ev.node_of]
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
    (plain, plain_coef), = [(m, c) for m, c in expr.split_terms() if total not in _symbols(m)]
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
    plain = Expr({m: c for m, c in expr.split_terms() if not (_symbols(m) & sums)})
    first = next(iter(plain.terms))
    full = shape(node)
    varying = lambda term, **kw: [ev.node_of[s] for s in _symbols(term) if s in ev.node_of  # noqa: E731
                                  and s in ev.varying and _shape_fits(ev.node_of[s], **kw)]
    gammas = varying(first, rank=ev.k) + [None]
    xs = list(dict.fromkeys(n for m, _ in expr.split_terms() if _symbols(m) & sums
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


def _stat_leaves(ev: NormEvaluator, expr) -> frozenset:
    return frozenset(s for s in expr.free_symbols if s in ev.node_of and s not in ev.varying)


def _match_root(ev: NormEvaluator, root: fx.Node, stop) -> Optional[NormMatch]:
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
    stats = dict.fromkeys(s for e in exprs.values() for s in sorted(_stat_leaves(ev, e)))
    for stat in stats:
        parts = [n for n, e in exprs.items() if all(stat in _symbols(m) for m, _ in e.split_terms())]
        if len(parts) < 2:
            continue
        found = match_dx(ev, root, sum((exprs[n] for n in parts), Expr.number(0)))
        if found is not None:
            found.parts = parts
            found.rest = [n for n in summands if n not in parts]
            found.chain = adds
            return found
    return None


def _dgamma_summand(ev: NormEvaluator, site: NormMatch) -> Expr:
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
            and v.expr == _dgamma_summand(ev, site))


#: uses between a sum over the normalized axes and the root of dx (with its accumulation)
DX_DEPTH = 9


def _norm_reductions(graph: fx.Graph):
    """[(normalized trailing shape, [keep-dim sum/mean nodes over exactly those axes])]."""
    found: Dict[tuple, tuple] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (aten.sum.dim_IntList, aten.mean.dim):
            continue
        src = node.args[0]
        s = shape(src) if isinstance(src, fx.Node) else None
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if not s or not keepdim or not node.args[1]:
            continue
        dims = sorted(normalize_dim(d, len(s)) for d in node.args[1])
        if dims != list(range(len(s) - len(dims), len(s))):
            continue
        tail = tuple(s[len(s) - len(dims):])
        found.setdefault(tuple(size_key(x) for x in tail), (tail, []))[1].append(node)
    return found.values()


#: uses between a site's roles and its dgamma's sum (``sum(dy * (x * rstd))``, casts between)
DGAMMA_REACH = 6


def _lead_sums(graph: fx.Graph, rank: int, near: Optional[List[fx.Node]] = None) -> List[fx.Node]:
    """Sums over leading axes (dgamma) and the views and casts right after them (with ``near``,
    only sums at most :data:`DGAMMA_REACH` uses from those nodes)."""
    seeds = []
    for node in graph.nodes if near is None else downstream(graph, near, DGAMMA_REACH):
        if node.op == "call_function" and node.target is aten.sum.dim_IntList and isinstance(node.args[0], fx.Node):
            s = shape(node.args[0])
            if s and all(normalize_dim(d, len(s)) < len(s) - rank for d in node.args[1] or ()):
                seeds.append(node)
    return downstream(graph, seeds, 3)


def find_sites(graph: fx.Graph, rewrites: RuleContext) -> RoundReport:
    """This round's RMSNorm backward sites of the graph, near misses and pending candidates;
    an internal error while examining one candidate is a miss in ``rewrites``."""
    provenance = rewrites.provenance
    matches: List[NormMatch] = []
    near = RoundReport()
    gradient = gradient_dependent(graph)
    with_dx = set()  # the statistics of the norms whose dx the graph computes (matched or not)
    for norm_shape, reductions in _norm_reductions(graph):
        try:
            ev = norm_evaluator(norm_shape, provenance)
        except Unsupported:  # a symbolic N that is not a product of sizes
            continue
        ev.gradient_nodes = gradient
        # dx is a few uses after a sum over the normalized axes; evaluation is lazy from there
        nodes = [n for n in downstream(graph, reductions, DX_DEPTH) if n.op == "call_function"
                 and val(n) is not None and val(n).dtype.is_floating_point]
        for n in nodes:
            ev.value(n)
        lead_sums = _lead_sums_by_leaves(ev, _lead_sums(graph, len(norm_shape)))
        found, stop = [], set()
        for n in nodes:
            if ev.spans(shape(n)) and ev.depends_on_gradient(n):
                m = rewrites.examine(n, _match_root, ev, n, stop)
                if m is not None:
                    found.append(m)
                    stop.add(n)
        # keep the outermost of a chain of matches of one site (dx, then its cast)
        found = outermost(found, node=lambda m: m.dx, same=lambda a, b: a.roles == b.roles)
        seen = set()
        for site in found:
            if site.rstd in seen:  # one RMSNorm, one site: an accumulation root found twice
                continue
            seen.add(site.rstd)
            site.dgamma = _dgamma_of(rewrites.examine, ev, site, lead_sums)
            matches.append(site)
        missed = _near_misses(rewrites, ev, nodes, [m for m in matches if m.ev is ev])
        near += missed
        # a norm whose dx is here, matched or recorded as a near miss, is no dgamma-only site: its
        # dgamma fused alone would judge one norm twice (fused and missed; a (ms + eps) ** -0.5
        # statistic, whose dx reads ms + eps ** -1.5, no cube of the statistic)
        suspects = {m.node for m in missed.misses}
        with_dx |= _statistics_with_dx(ev) | {ev.node_of[s] for n in nodes if n.name in suspects
                                               and ev.memo.get(n) is not None for s in _stat_leaves(ev, ev.memo[n].expr)}
        rewrites.evaluated(ev)
    matches += dgamma_only_sites(graph, rewrites, matches, with_dx)
    return RoundReport(matches, near.misses, near.pending)


def _lead_sums_by_leaves(ev: NormEvaluator, nodes: List[fx.Node]) -> Dict[frozenset, List[fx.Node]]:
    """dgamma candidates by the leaves they sum (dy, x, rstd): one lookup per site."""
    lead_sums: Dict[frozenset, List[fx.Node]] = {}
    for n in nodes:
        v = ev.value(n) if val(n) is not None else None
        if v is not None and v.lead_sum is not None:
            lead_sums.setdefault(frozenset(v.expr.free_symbols), []).append(n)
    return lead_sums


def _dgamma_of(examine, ev: NormEvaluator, site: NormMatch, lead_sums) -> Optional[fx.Node]:
    """The one sum among ``lead_sums`` that is the site's dgamma, or None (none, or several).
    ``examine(node, fn, *args)`` runs ``fn(*args)`` for the candidate ``node``."""
    leaves = frozenset(_dgamma_summand(ev, site).free_symbols)
    grads = outermost([n for n in lead_sums.get(leaves, ()) if examine(n, match_dgamma, ev, n, site)])
    return grads[0] if len(grads) == 1 else None


def _statistics_with_dx(ev: NormEvaluator) -> set:
    """Leaves cubed beside a sum over the normalized axes in a gradient's value: the rstd of a
    norm whose dx the graph computes (``r**3 * x * sum(dy*g*x) / N``), matched, pending or not.
    (A norm feeding another norm as its x enters that one's dx with its rstd squared.)"""
    found = set()
    for node, v in ev.memo.items():
        if v is None or v.lead_sum is not None or not ev.depends_on_gradient(node):
            continue
        for mono, _ in v.expr.split_terms():
            if any(s in ev.sum_body for s, _ in mono):
                found.update(ev.node_of[s] for s, e in mono if e == 3 and s in ev.node_of and s not in ev.varying)
    return found


def _near_misses(rewrites: RuleContext, ev: NormEvaluator, nodes, matched: List[NormMatch]) -> RoundReport:
    """Nodes that sum over the normalized axes once, as an RMSNorm dx does, yet matched nothing.
    One built on a matched site's sum outside that site (a post-norm whose dy is the next
    norm's dx, or the sum of several norms' dx) is pending: the next round, with those sites
    fused, decides it. A failure while reading one node is a miss at that node."""
    done, inside = set(), set()
    for site in matched:
        sums_and_region = rewrites.examine(site.dx, _sums_and_region, ev, site)
        if sums_and_region is not None:
            done |= sums_and_region[0]
            inside.update(sums_and_region[1])
    suspects, pending = [], 0
    for n in nodes:
        verdict = rewrites.examine(n, _near_miss_verdict, ev, n, done, inside)
        if verdict == "pending":
            pending += 1
        elif verdict == "suspect":
            suspects.append(n)
    outer = outermost(suspects)
    return RoundReport([], [Miss(OP.name, n.name, _spelling_above(n, rewrites.provenance) or (
        "normalizes over the last axes like an RMSNorm dx, but its terms differ from rstd*dy*g - "
        "rstd**3*x*sum(dy*g*x)/N (eps outside the root, another statistic or a missing term)")) for n in outer], pending)


def _spelling_above(node: fx.Node, provenance: Optional[Provenance]) -> Optional[str]:
    """The :func:`unmatched_spelling` of an operand of a product or quotient at most
    :data:`DX_DEPTH` steps above ``node`` (the reason a dx-shaped node matched no form)."""
    frontier, seen = [node], {node}
    for _ in range(DX_DEPTH):
        above = []
        for n in frontier:
            if n.op == "call_function" and n.target in (aten.mul.Tensor, aten.div.Tensor):
                reason = next(filter(None, (unmatched_spelling(a, provenance) for a in (n, *n.args[:2])
                                            if isinstance(a, fx.Node))), None)
                if reason is not None:
                    return reason
            above += [a for a in n.all_input_nodes if a not in seen]
        seen.update(above)
        frontier = above
    return None


def _sums_and_region(ev: NormEvaluator, site: NormMatch) -> tuple:
    """The symbols of a matched site's sum over the normalized axes, and the nodes of its dx."""
    summand = ev.value_of(site.dy) * ev.value_of(site.gamma) * ev.value_of(site.x)
    return ev.sum_over_normalized(summand).free_symbols, _region(site, {"dx": site.dx})


def _near_miss_verdict(ev: NormEvaluator, n: fx.Node, done: set, inside: set) -> Optional[str]:
    """Whether ``n`` is a suspect RMSNorm dx, a pending one, or neither.

    ``"suspect"``: ``n`` normalizes like an RMSNorm dx and matched nothing; ``"pending"``: it is
    built on a site this round matched; None: neither."""
    v = ev.memo.get(n)
    if v is None or v.lead_sum is not None or not ev.spans(shape(n)) or not same_shape(
            shape(n)[len(shape(n)) - ev.k:], ev.norm_shape) or len(shape(n)) <= ev.k:
        return None
    sums = {s for s in v.expr.free_symbols if s in ev.sum_body}
    if len(sums) > 1 and sums & done and sums - done and n not in inside:
        # its own sum over a gradient that expands into matched sites' dx (a norm whose dy
        # is several norms' dx summed): the next round reads that dy as their fused outputs
        return "pending"
    # a norm's dx scales by a saved statistic and has a term x * sum(product) with the
    # product of degree >= 2 (dy*g*x): (log-)softmax's backward has no statistic or sums
    # the gradient alone, normalizing by a plain sum (MoE routing weights) has no x there
    if len(sums) != 1 or not _stat_leaves(ev, v.expr) or sum(
            abs(e) for _, e in ev.sum_body[next(iter(sums))]) < 2:
        return None
    summed_terms = [_symbols(m) for m, _ in v.expr.split_terms() if _symbols(m) & sums]
    if not any(t & ev.varying for t in summed_terms):
        return None
    if not sums & done and len(v.expr.terms) >= 2:
        return "suspect"
    if sums & done and n not in inside:
        return "pending"
    return None


def unexplained(graph: fx.Graph, provenance: Optional[Provenance], misses: List[Miss]) -> List[Miss]:
    """Record each RMSNorm the pass left in the graph that no form matched and no miss explains.

    No silent misses: a gradient multiplied by an RMS statistic (``rsqrt(mean(x*x) + eps)``,
    saved or recomputed), or by a normalized value and summed as a weight's gradient (a norm
    whose input takes no gradient), that is left in the graph after the pass, and that no
    recorded miss accounts for, is an RMSNorm no form matched. One norm is one miss: its dx's
    product (by the statistic) and its weight gradient's (by the normalized value) are grouped
    by the norm's statistic, and a recorded miss any of them reaches accounts for all."""
    gradient = gradient_dependent(graph)
    if gradient is None:
        return []
    missed = {m.node for m in misses}
    norms: Dict[object, list] = {}  # the norm's statistic (or the product itself) -> [node, reason, reach]
    reached = set()
    weight_gradient = _unfused_weight_gradient(graph, provenance, missed)
    for node in graph.nodes:
        operand = _forward_operand(node, gradient) if node not in reached else None
        spelled = node if node.target is aten.div.Tensor else operand
        reason = unmatched_spelling(spelled, provenance) if operand is not None else None
        if operand is None or not (reason or _is_rms_statistic(operand, provenance)
                                   or fused_statistic_operand(operand, provenance) is not None
                                   or weight_gradient(node, operand)):
            continue
        reach = set(downstream(graph, [node], 2 * DX_DEPTH))
        reached |= reach
        entry = norms.setdefault(_statistic_key(operand, spelled, provenance) or node, [node, reason, set()])
        entry[1] = entry[1] or reason
        entry[2] |= reach
    return [Miss(OP.name, n.name, reason or (
        "a gradient scaled by an RMS statistic rsqrt(mean(x*x) + eps), or by the normalized value "
        "x*rsqrt(mean(x*x) + eps) and summed as a weight's gradient, that no RMSNorm form matched (run with "
        "TORCH_LOGS=npu_fusion and dump_graphs to see it)")) for n, reason, reach in norms.values()
        if not any(r.name in missed for r in reach)]


def _statistic_key(operand: fx.Node, spelled: fx.Node, provenance: Optional[Provenance]):
    """The norm a backward product belongs to, as one key per norm.

    One key per norm for the products of its backward: its statistic (the exact source, one key
    for a forward value and its saved or recomputed copy) where ``operand`` is the statistic or a
    value normalized by it, decomposed or fused; the root of a spelling no form reads (``spelled``:
    the product's node where it divides, else ``operand``); None where it is none of them. Two norms
    of one input with statistics of their own are two keys."""
    def statistic(node):
        if rms_statistic_operand(node, provenance) is not None:
            return _source(node, provenance)
        fused = fused_statistic_operand(node, provenance)
        return ("fused", _source(fused[0], provenance)) if fused is not None else None
    key = statistic(operand)
    if key is not None:
        return key
    node = _definition(operand, provenance)
    if node.op == "call_function" and node.target is aten.mul.Tensor:
        key = next((k for k in (statistic(a) for a in node.args[:2] if isinstance(a, fx.Node)) if k is not None), None)
        if key is not None:
            return key
    fused = fused_normalized_operand(operand, provenance)  # a fused y with a weight of ones
    if fused is not None:
        return ("fused", _source(fused[0], provenance))
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


def _unfused_weight_gradient(graph: fx.Graph, provenance: Optional[Provenance], missed: set):
    """Test whether a product is an unaccounted weight gradient of an RMSNorm.

    A test of (product, forward operand): a gradient times a normalized value
    ``y * rsqrt(mean(y*y) + eps)`` summed over leading axes (a weight's gradient, as a norm
    whose input takes no gradient has), of a norm neither a fused op in the graph covers (a
    fused dx whose dgamma the rewrite left to the program, with a note) nor a recorded miss
    (one at a node its statistic reaches: the norm's dx left unfused with the reason)."""
    @functools.lru_cache(maxsize=None)  # computed once, and only where such a product is left
    def covered() -> frozenset:
        taken = _taken_norms(graph, provenance, [])
        for node in graph.nodes:
            stat = rms_statistic_operand(node, provenance) if node.op in ("placeholder", "call_function") else None
            if stat is not None and any(n.name in missed for n in downstream(graph, [node], 2 * DX_DEPTH)):
                taken.add(_source(stat[0], provenance))
        return frozenset(taken)

    def summed_over_leading_axes(node: fx.Node, k: int) -> bool:
        rank = len(shape(node))
        return any(s.op == "call_function" and s.target is aten.sum.dim_IntList and s.args[1]
                   and len(shape(s.args[0])) == rank and all(normalize_dim(d, rank) < rank - k for d in s.args[1])
                   for s in downstream(graph, [node], 2))

    def test(node: fx.Node, operand: fx.Node) -> bool:
        stat = normalized_operand(operand, provenance) or fused_normalized_operand(operand, provenance)
        return (stat is not None and summed_over_leading_axes(node, stat[1])
                and _source(stat[0], provenance) not in covered())
    return test


#: ops an RMS statistic may pass through on its way to the backward: casts, copies and views
_STAT_PASSTHROUGH = CAST_TARGETS | VIEWS


def _is_rms_statistic(node: fx.Node, provenance: Optional[Provenance]) -> bool:
    """``rsqrt(mean(y*y) + eps)`` or ``(mean(y*y) + eps) ** -0.5``, seen through casts, views and
    saved tensors' forward definitions: the statistic of an RMSNorm, not of a LayerNorm (whose
    mean is of a centred square)."""
    for _ in range(8):
        if node.op == "placeholder" and provenance is not None:
            node = provenance.forward_definition(node) or node
        if node.op != "call_function" or node.target not in _STAT_PASSTHROUGH:
            break
        node = node.args[0]
    root = node.op == "call_function" and (node.target is aten.rsqrt.default or (
        node.target is aten.pow.Tensor_Scalar and node.args[1] == -0.5))
    if not root or not isinstance(node.args[0], fx.Node) or node.args[0].target not in (
            aten.add.Tensor, aten.add.Scalar):
        return False
    mean = next((a for a in node.args[0].args if isinstance(a, fx.Node)
                 and a.target in (aten.mean.dim, aten.sum.dim_IntList)), None)
    square = mean.args[0] if mean is not None else None
    return isinstance(square, fx.Node) and square.op == "call_function" and (
        (square.target is aten.pow.Tensor_Scalar and square.args[1] == 2)
        or (square.target is aten.mul.Tensor and square.args[0] is square.args[1]))


# -- dgamma alone: a norm whose input takes no gradient ----------------------------

#: ops a statistic or a normalized value keeps its values through (casts, copies, reshapes);
#: slices, selections and transposes move elements and are not among them
_SAME_VALUES = CAST_TARGETS | {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                               aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default}


def _definition(node: fx.Node, provenance: Optional[Provenance], exact: bool = False) -> fx.Node:
    """``node`` seen through casts, reshapes and saved tensors' forward definitions (with
    ``exact``, through the casts that change no value only)."""
    for _ in range(8):
        if node.op == "placeholder" and provenance is not None:
            node = provenance.forward_definition(node) or node
        if node.op != "call_function" or node.target not in _SAME_VALUES or not isinstance(node.args[0], fx.Node):
            break
        if exact and node.target in CAST_TARGETS and not is_value_preserving_cast(node):
            break
        node = node.args[0]
    return node


#: what the forward rule puts between the fused ``rms_norm`` and the program's values: casts,
#: reshapes and the permutations of a norm run in another memory order (each undone on the way out)
_FUSED_FORWARD_WRAPPING = _SAME_VALUES | {aten.permute.default}


def _fused_forward_output(node: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """Which output of a fused ``npu_fusion.rms_norm`` ``node`` is, if any.

    ``(index, x, k, gamma)`` when ``node`` is output ``index`` of a fused ``npu_fusion.rms_norm``
    of ``x`` over its last k axes (0: y, 1: rstd), seen through the casts, reshapes and
    permutations the forward rule wraps it in and saved tensors' forward definitions; ``x`` is
    the program's own node."""
    def unwrapped(n: fx.Node) -> fx.Node:
        for _ in range(12):
            if n.op == "placeholder" and provenance is not None:
                n = provenance.forward_definition(n) or n
            if n.op != "call_function" or n.target not in _FUSED_FORWARD_WRAPPING \
                    or not isinstance(n.args[0], fx.Node):
                break
            n = n.args[0]
        return n
    node = unwrapped(node)
    if not (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node) and node.args[0].target is FORWARD_OP.overload):
        return None
    x, gamma, _ = node.args[0].args[:3]
    return node.args[1], unwrapped(x), len(shape(gamma)), gamma


def fused_statistic_operand(node: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """``(x, k)`` when ``node`` is the rstd output of a fused forward ``rms_norm`` of x: what
    :func:`rms_statistic_operand` reads in a decomposed statistic. The backward's scans read both:
    a forward fused before its backward hides no statistic from them."""
    found = _fused_forward_output(node, provenance)
    return found[1:3] if found is not None and found[0] == 1 else None


def fused_normalized_operand(node: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """The x and axes that ``node`` is normalized over by a fused forward ``rms_norm``, if any.

    ``(x, k)`` when ``node`` is x normalized by a fused forward ``rms_norm``: its y where the
    weight is ones (a norm without weight), or ``x * its rstd`` (the program's y the forward rule
    leaves to the backward's readers under min-cut); :func:`normalized_operand`'s fused twin."""
    found = _fused_forward_output(node, provenance)
    if found is not None:
        index, x, k, gamma = found
        return (x, k) if index == 0 and _is_ones(gamma, provenance) else None
    return normalized_operand(node, provenance, statistic=fused_statistic_operand)


def _is_ones(node, provenance: Optional[Provenance]) -> bool:
    """``node`` is a tensor of ones the program or the forward rule made (a norm without weight)."""
    node = _definition(node, provenance) if isinstance(node, fx.Node) else node
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in (
        aten.full.default, aten.ones.default) and (node.target is aten.ones.default or node.args[1] == 1)


def _source(node: fx.Node, provenance: Optional[Provenance]) -> fx.Node:
    """The tensor ``node`` holds exactly (through exact casts and reshapes), as a backward node
    where the backward has it: one key for a forward value and its saved or recomputed copy."""
    node = _definition(node, provenance, exact=True)
    saved = provenance.saved_in_backward(node) if provenance is not None and provenance.is_forward(node) else None
    return node if saved is None else _definition(saved, provenance, exact=True)


def rms_statistic_operand(node: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """``(y, k)`` when ``node`` is ``rsqrt(mean(y*y, last k axes, keepdim) + eps)`` (or its
    ``** -0.5``) with eps inside the root (a number >= 0, or a one-element tensor): the statistic
    of an RMSNorm of ``y`` over its last k axes. Structural, as the forward is no Laurent
    polynomial: a LayerNorm's centred square, eps outside the root or another axis is none."""
    found = _rms_root(_definition(node, provenance), provenance, _is_reciprocal_root)
    return found[:2] if found is not None and found[2] else None


def _is_reciprocal_root(node: fx.Node) -> bool:
    return node.target is aten.rsqrt.default or (node.target is aten.pow.Tensor_Scalar and node.args[1] == -0.5)


def _rms_root(node: fx.Node, provenance: Optional[Provenance], is_root) -> Optional[tuple]:
    """``(y, k, keepdim)`` when ``node`` is ``root(mean(y*y, last k axes) + eps)`` for a ``root``
    op ``is_root`` accepts, eps inside the root; ``keepdim`` whether the mean keeps its axes."""
    if node.op != "call_function" or not is_root(node):
        return None
    shifted = node.args[0]
    if not (isinstance(shifted, fx.Node) and shifted.target in (aten.add.Tensor, aten.add.Scalar)
            and shifted.kwargs.get("alpha", 1) == 1):
        return None
    operands = [a for a in shifted.args[:2]
                if isinstance(a, fx.Node) and _definition(a, provenance).target is aten.mean.dim]
    if len(operands) != 1:
        return None
    mean = _definition(operands[0], provenance)
    if not _is_scalar_eps(next(a for a in shifted.args[:2] if a is not operands[0])):
        return None
    square, dims = mean.args[0], mean.args[1]
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if not (isinstance(square, fx.Node) and dims and mean.kwargs.get("dtype") is None):
        return None
    if square.target is aten.pow.Tensor_Scalar and square.args[1] == 2:
        y = square.args[0]
    elif square.target is aten.mul.Tensor and square.args[0] is square.args[1]:
        y = square.args[0]
    else:
        return None
    rank = len(shape(y))
    dims = sorted(normalize_dim(d, rank) for d in dims)
    if dims != list(range(rank - len(dims), rank)) or len(dims) == rank or _is_centred(y, provenance):
        return None
    return y, len(dims), bool(keepdim)


#: why an RMSNorm spelled with a division by the root fuses in no form
DIVISION_REASON = ("an RMSNorm spelled x / sqrt(mean(x*x) + eps) (a division by the root): no form reads the "
                   "division; write x * torch.rsqrt(mean(x*x) + eps), the same value, to fuse it")
#: why an RMSNorm whose statistic drops the normalized axes fuses in no form
KEEPDIM_REASON = ("an RMSNorm statistic rsqrt(mean(x*x) + eps) taken with keepdim=False and unsqueezed after: "
                  "no form reads it; write x.pow(2).mean(-1, keepdim=True), the same value, to fuse it")


def unmatched_spelling(node: fx.Node, provenance: Optional[Provenance]) -> Optional[str]:
    """Why ``node`` is an RMSNorm spelling no form reads, or None.

    Why ``node`` (through casts, reshapes and saved tensors' definitions) is an RMSNorm
    spelling no form reads, or None: a value divided by the root ``sqrt(mean(y*y) + eps)``, or a
    statistic ``rsqrt(mean(y*y) + eps)`` whose mean drops its axes (``keepdim=False``)."""
    root = spelled_root(node, provenance)
    if root is None:
        return None
    return DIVISION_REASON if root.target is aten.sqrt.default else KEEPDIM_REASON


def spelled_root(node: fx.Node, provenance: Optional[Provenance]) -> Optional[fx.Node]:
    """The root node of an RMSNorm spelling no form reads (see :func:`unmatched_spelling`):
    ``node`` is a value divided by a ``sqrt`` root, or a statistic taken with ``keepdim=False``
    or a value times it."""
    node = _definition(node, provenance)
    candidates = [node]
    if node.op == "call_function" and node.target in (aten.div.Tensor, aten.mul.Tensor):
        candidates += [_definition(a, provenance) for a in node.args[:2] if isinstance(a, fx.Node)]
    for root in candidates:
        if _rms_root(root, provenance, lambda n: n.target is aten.sqrt.default) is not None and (
                node.target is aten.div.Tensor and root is _definition(node.args[1], provenance)):
            return root
        found = _rms_root(root, provenance, _is_reciprocal_root)
        if found is not None and not found[2]:
            return root
    return None


def _is_scalar_eps(eps) -> bool:
    """A number >= 0, or a one-element tensor (``dynamic=True`` passes a float as a graph input)."""
    if isinstance(eps, fx.Node):
        return val(eps) is not None and all(static_int(n) == 1 for n in shape(eps))
    value = graph_constant(eps)
    return value is not None and value >= 0


def _is_centred(y: fx.Node, provenance: Optional[Provenance]) -> bool:
    """``y`` is ``a - mean(a)`` (a LayerNorm's centred value: its statistic is a variance)."""
    y = _definition(y, provenance, exact=True)
    return y.op == "call_function" and y.target in (aten.sub.Tensor, aten.add.Tensor) and any(
        isinstance(a, fx.Node) and _definition(a, provenance).target is aten.mean.dim for a in y.args[:2])


def normalized_operand(node: fx.Node, provenance: Optional[Provenance],
                       statistic=rms_statistic_operand) -> Optional[tuple]:
    """``(y, k)`` when ``node`` is ``y * rms_statistic(y)`` (the normalized value the forward
    saves for the weight's gradient), the statistic read by ``statistic`` (by default as
    :func:`rms_statistic_operand` reads a decomposed one)."""
    node = _definition(node, provenance)
    if node.op != "call_function" or node.target is not aten.mul.Tensor:
        return None
    for a, b in (node.args[:2], node.args[1::-1]):
        stat = statistic(b, provenance) if isinstance(b, fx.Node) else None
        if stat is not None and isinstance(a, fx.Node) and _source(a, provenance) is _source(stat[0], provenance):
            return stat
    return None


def _statistic_candidates(graph: fx.Graph, provenance, gradient) -> Dict[tuple, tuple]:
    """{norm shape key: (norm shape, [(node, y, has_rstd)])}: backward nodes (forward values)
    that are an RMS statistic of y (has_rstd) or y normalized by it."""
    found: Dict[tuple, tuple] = {}
    for node in graph.nodes:
        if node.op not in ("placeholder", "call_function") or (gradient is not None and node in gradient):
            continue
        if val(node) is None or not val(node).dtype.is_floating_point:
            continue
        stat, has_rstd = rms_statistic_operand(node, provenance), True
        if stat is None:
            stat, has_rstd = normalized_operand(node, provenance), False
        if stat is None:
            continue
        y, k = stat
        tail = tuple(shape(y)[len(shape(y)) - k:])
        found.setdefault(tuple(size_key(x) for x in tail), (tail, []))[1].append((node, y, has_rstd))
    return found


def _taken_norms(graph: fx.Graph, provenance, matches: List[NormMatch]) -> set:
    """The normalized inputs (exact sources) of the norms a dx site covers: matched this round,
    or fused by an earlier one (whose dgamma may be left to the program deliberately)."""
    rstds = [m.rstd for m in matches] + [n.args[2] for n in graph.nodes
                                         if n.op == "call_function" and n.target is OP.overload]
    taken = set()
    for rstd in rstds:
        stat = rms_statistic_operand(rstd, provenance) or fused_statistic_operand(rstd, provenance) \
            if isinstance(rstd, fx.Node) else None
        if stat is not None:
            taken.add(_source(stat[0], provenance))
    return taken


def _statistic_input(ev: NormEvaluator, y: fx.Node, symbols) -> Optional[fx.Node]:
    """The leaf among ``symbols`` that holds ``y`` (the value an RMS statistic is of): the same
    value to the evaluator, or the same tensor through exact casts and reshapes to y's shape."""
    try:
        value = ev.value(y)
    except Unsupported:  # a forward value the backward cannot read (a view of a saved input)
        value = None
    if value is not None and value.lead_sum is None and value.expr.as_symbol() in symbols:
        return ev.node_of.get(value.expr.as_symbol())
    source = _source(y, ev.provenance)
    for s in sorted(symbols & ev.varying):
        node = ev.node_of.get(s)
        if node is not None and same_shape(shape(node), shape(y)) and _source(node, ev.provenance) is source:
            return node
    return None


def _match_dgamma_only(ev: NormEvaluator, node: fx.Node, candidates) -> Optional[NormMatch]:
    """``node`` is ``sum(dy * x * rstd)`` over exactly the leading axes, with rstd proven the RMS
    statistic of x (or ``sum(dy * x_hat)`` with x_hat proven x normalized by it: then x is x_hat
    and rstd is 1, which the rewrite passes as ones)."""
    v = ev.value(node)
    if v is None or v.lead_sum is None:
        return None
    summand, dims = v.lead_sum
    rank = len(shape(summand))
    squeezed = lambda s: [x for x in s if static_int(x) != 1]  # noqa: E731
    if not (all(d in dims or static_int(shape(summand)[d]) == 1 for d in range(rank - ev.k))
            and same_shape(squeezed(shape(node)), squeezed(ev.norm_shape))):
        return None
    symbols = v.expr.free_symbols
    for leaf, y, has_rstd in candidates:
        if ev.symbol_of.get(leaf) not in symbols:
            continue
        x = _statistic_input(ev, y, symbols) if has_rstd else leaf
        if x is None or not same_shape(shape(x), shape(summand)):
            continue
        rstd = leaf if has_rstd else None
        norm = ev.value_of(x) * ev.value_of(rstd)
        dy = ev.node_with_value(v.expr / norm, shape(summand))
        if dy is not None and dy not in (x, rstd) and ev.depends_on_gradient(dy) and v.expr == ev.value_of(dy) * norm:
            return NormMatch(node, dy, x, rstd, None, ev, dgamma=node)
    return None


def dgamma_only_sites(graph: fx.Graph, rewrites: RuleContext, matches: List[NormMatch],
                      with_dx=()) -> List[NormMatch]:
    """Sites of norms whose input takes no gradient: only dgamma is computed, no dx (no
    statistic of theirs in ``with_dx``); each becomes ``rms_norm_grad`` with only its dgamma
    output used."""
    provenance, gradient = rewrites.provenance, gradient_dependent(graph)
    taken = _taken_norms(graph, provenance, matches)
    taken |= {_source(stat[0], provenance) for stat in (rms_statistic_operand(n, provenance) for n in with_dx) if stat}
    claimed = {m.dgamma for m in matches}
    found = []
    for key, (norm_shape, candidates) in _statistic_candidates(graph, provenance, gradient).items():
        candidates = [c for c in candidates if _source(c[1], provenance) not in taken]
        if not candidates:
            continue
        try:
            ev = norm_evaluator(norm_shape, provenance)
        except Unsupported:
            continue
        ev.gradient_nodes = gradient
        grads = [n for n in _lead_sums(graph, len(norm_shape)) if n not in claimed and val(n) is not None
                 and ev.depends_on_gradient(n)]
        sites = [m for n in grads for m in [rewrites.examine(n, _match_dgamma_only, ev, n, candidates)] if m]
        for site in sites:
            site.candidates = candidates
        found += outermost(sites, node=lambda m: m.dx)
        rewrites.evaluated(ev)
    return found


# -- the rewrite --------------------------------------------------------------

def _widened_from(node: fx.Node, to: torch.dtype, provenance: Optional[Provenance]) -> bool:
    """Whether a saved tensor is a widening cast of a tensor of dtype ``to`` (so narrowing is exact)."""
    fw = provenance.forward_definition(node) if provenance is not None and node.op == "placeholder" else None
    return fw is not None and is_value_preserving_cast(fw) and dtype(fw.args[0]) == to


def _gamma_dtype(compute: torch.dtype, gamma: torch.dtype) -> torch.dtype:
    """gamma's dtype for the fused op: its own, or float32 when the op's dtype table has no
    (compute, gamma) row but has (compute, float32); the widening cast is exact."""
    if (compute, gamma) not in RMS_NORM_DTYPES and (compute, torch.float32) in RMS_NORM_DTYPES \
            and exact_common_dtype((gamma, torch.float32)) == torch.float32:
        return torch.float32
    return gamma


def _region(site: NormMatch, outputs) -> List[fx.Node]:
    roles = {n for n in site.roles if n is not None}
    ev = site.ev
    interior = lambda n: (n in ev.interpreted and n not in roles and n not in site.rest  # noqa: E731
                          and ev.depends_on_gradient(n))
    region = region_of(list(site.parts) + [o for k, o in outputs.items() if k != "dx"], interior)
    return list(dict.fromkeys(region + site.chain + [site.dx]))


def find_again(rewrites: RuleContext, site: NormMatch, leaves: List[fx.Node]) -> Optional[NormMatch]:
    """A dx site at ``site``'s node matched again with ``leaves`` as leaves, with the same dgamma
    (or the same dgamma-only site), or None. Reads the site's neighbourhood only: its
    accumulation's summands, in each norm shape the graph reduces over, in graph order (the
    first that matches, as a scan of the graph would find it: with a shared product cut, the
    sum at a root that two norms feed may read as the other norm's dx), and the sums near its
    roles for dgamma."""
    graph, gradient = rewrites.graph, gradient_dependent(rewrites.graph)
    if site.dgamma_only:
        ev = norm_evaluator(site.ev.norm_shape, rewrites.provenance, leaves)
        ev.gradient_nodes = gradient
        again = _match_dgamma_only(ev, site.dx, site.candidates)
        return again if again is not None and again.dx is site.dx else None
    summands, _ = gradient_accumulation(site.dx, ())
    around = [n for n in (*summands, site.dx) if n.op == "call_function" and val(n) is not None
              and val(n).dtype.is_floating_point]
    for norm_shape, _ in _norm_reductions(graph):
        try:
            ev = norm_evaluator(norm_shape, rewrites.provenance, leaves)
        except Unsupported:  # a symbolic N that is not a product of sizes
            continue
        ev.gradient_nodes = gradient
        for node in around:
            ev.value(node)
        again = _match_root(ev, site.dx, set()) if ev.spans(shape(site.dx)) and ev.depends_on_gradient(site.dx) \
            else None
        rewrites.raise_if_strict(ev)
        if again is not None:
            near = [n for n in again.roles if n is not None]
            again.dgamma = _dgamma_of(lambda node, fn, *args: fn(*args), ev, again,
                                      _lead_sums_by_leaves(ev, _lead_sums(graph, ev.k, near)))
            return again if again.dgamma is site.dgamma else None
    return None


def emit(rewrites: RuleContext, rule: FusionRule, site: NormMatch):
    """The site rewritten into one fused call (a :class:`Site`), or a :class:`Miss` saying why not."""
    current = rewrites.current
    site.rest = [current(n) for n in site.rest]
    site.dy, site.x, site.rstd, site.gamma = (current(n) for n in site.roles)
    if site.dgamma_only:
        outputs = {"dgamma": site.dgamma}
    else:
        outputs = {"dx": site.dx, **({"dgamma": site.dgamma} if site.dgamma is not None else {})}
    # a dgamma the program computes from a value it rounded more coarsely than it keeps dgamma
    # (autocast: a bf16 normalized x times an fp32 weight) is left to the program; dx still fuses
    dgamma_left = site.dgamma is not None and not site.dgamma_only and rounding_problem(
        site.ev, {"dgamma": site.dgamma}, [*site.roles, *site.rest])
    if dgamma_left:
        del outputs["dgamma"]
    resolved = rule.resolve_shared(rewrites, site, outputs)
    if isinstance(resolved, Miss):
        return resolved
    site, outputs, region = resolved
    done = _emit(rewrites, site, outputs, region)
    if dgamma_left and isinstance(done, Site):
        done.note = f"dgamma ({site.dgamma.name}) left to the program: {dgamma_left}"
    return done


def _emit(rewrites: RuleContext, site: NormMatch, outputs, region):
    graph, edit, target, provenance = rewrites.graph, rewrites.edit, rewrites.target, rewrites.provenance
    dy_dtype, x_dtype = dtype(site.dy), dtype(site.x)
    wide = exact_common_dtype((dy_dtype, x_dtype))
    compute = dy_dtype if (x_dtype == wide and _widened_from(site.x, dy_dtype, provenance)) else wide
    if "dx" in outputs:
        compute = exact_common_dtype((compute, kept_precision(site.dx)))  # dx is returned in this dtype
    gamma_dtype = _gamma_dtype(compute, dtype(site.gamma) if site.gamma is not None else compute)
    rounding = rounding_problem(site.ev, outputs, [*site.roles, *site.rest])
    problem = rms_norm_target_problem(target, compute, gamma_dtype, shape(site.x), site.ev.k) or rounding
    if site.rstd is not None and "dx" in outputs:
        # the norm's verdict binds its forward (the same chips, dtypes and roundings; the shape
        # limits the forward op's own, not RmsNormGrad's); a dgamma-only site's is its dgamma's,
        # which the forward leaves to the program where it cannot fuse
        forward_problem = rms_norm_target_problem(target, compute, gamma_dtype, shape(site.x), site.ev.k,
                                                  ge_op="RmsNorm")
        rewrites.context.judgements.record(site_key(NORM_SITE, site.rstd), forward_problem or rounding)
    if problem is not None:
        return Miss(OP.name, site.dx.name, problem)
    anchor = last_of(graph, [n for n in (site.dy, site.x, site.rstd, site.gamma) if n is not None])
    with Insertion(graph, anchor) as inserted:
        dy, x = edit.cast(site.dy, compute), edit.cast(site.x, compute)
        rstd = edit.cast(site.rstd, torch.float32) if site.rstd is not None else None
        if site.rstd_power != 1:  # the statistic the program holds, raised to rstd
            rstd = edit.call(aten.pow.Tensor_Scalar, (rstd, float(site.rstd_power)))
        gamma = edit.cast(site.gamma, gamma_dtype) if site.gamma is not None else None
        if gamma is None and site.dgamma_only:  # dx unused: any gamma; ones need no static size
            gamma = _ones_of_part(edit, x, site.ev.k, compute, gamma_part=True)
        if gamma is None:
            if not all(isinstance(x, int) for x in site.ev.norm_shape):
                return Miss(OP.name, site.dx.name, "a norm without weight over a symbolic size: mark the "
                                                   "hidden size static")
            gamma = edit.call(aten.full.default, (list(site.ev.norm_shape), 1.0),
                              {"dtype": compute, "device": val(site.dy).device})
        if rstd is None:  # dgamma from the saved normalized value alone: sum(dy * x_hat * 1)
            rstd = _ones_of_part(edit, x, site.ev.k, torch.float32, gamma_part=False)
        emitted = emit_fused_op(rewrites, OP, site.dx, (dy, x, rstd, gamma), outputs)
        if isinstance(emitted, Miss):
            return emitted
    fused, replacements = emitted
    added = inserted.nodes()
    if site.rest:
        added += add_back_accumulated(edit, site, replacements)
    return commit(edit, OP.name, None, region, outputs, replacements,
                  {"dy": site.dy, "x": site.x, "rstd": site.rstd, "gamma": site.gamma}, added, fused)


def _ones_of_part(edit: Edit, x: fx.Node, k: int, to: torch.dtype, gamma_part: bool) -> fx.Node:
    """Ones in the shape of rstd, or of a part of gamma, built from x.

    Ones of rstd's keep-dim shape ``x.shape[:n] + [1] * k`` (x sliced to one element along
    each normalized axis), or with ``gamma_part`` of gamma's ``x.shape[n:]`` (x's first element
    along each leading axis): views of x, so symbolic sizes need no size nodes."""
    part, n = x, len(shape(x)) - k
    for d in range(n) if gamma_part else range(n, n + k):
        part = edit.call(*((aten.select.int, (part, 0, 0)) if gamma_part
                                        else (aten.slice.Tensor, (part, d, 0, 1))))
    return edit.call(aten.full_like.default, (part, 1.0), {"dtype": to})


# -- aten._fused_rms_norm_backward: the whole backward torch keeps on some devices ----

@dataclasses.dataclass
class WholeBackwardMatch:
    """One ``aten._fused_rms_norm_backward`` call; ``dx`` is the call itself (the key the rule
    runs the site's transaction under)."""
    dx: fx.Node


def _is_call(node: fx.Node, target) -> bool:
    return target is not None and node.op == "call_function" and node.target is target


def whole_backward_sites(graph: fx.Graph) -> List[WholeBackwardMatch]:
    """Every ``aten._fused_rms_norm_backward`` call of the graph: each is one RMSNorm site."""
    return [WholeBackwardMatch(n) for n in graph.nodes if _is_call(n, FUSED_RMS_NORM_BACKWARD)]


def _whole_backward_outputs(node: fx.Node):
    """{"dx": getitem, "dgamma": getitem} of the outputs the program uses and its
    ``output_mask`` asks for, or a Miss when something else reads the call."""
    mask = node.args[5] if len(node.args) > 5 else node.kwargs["output_mask"]
    outputs = {}
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] not in (0, 1):
            return Miss(OP.name, node.name, f"{user.name} reads aten._fused_rms_norm_backward's result "
                                            f"other than by index")
        if mask[user.args[1]] and user.users:
            outputs[OP.outputs[user.args[1]]] = user
    return outputs


def emit_whole_backward(rewrites: RuleContext, match: WholeBackwardMatch):
    """Rewrite a whole ``aten._fused_rms_norm_backward`` into ``rms_norm_grad``.

    ``aten._fused_rms_norm_backward(dy, x, normalized_shape, rstd, weight, output_mask)``
    rewritten into ``rms_norm_grad(dy, x, rstd, gamma)``: the same formula, rstd the same
    float32 ``1/RMS(x)`` (eps inside it), gamma the weight or ones; each output the program
    uses cast back to the call's dtype and shape. A Miss when the target refuses."""
    node, graph, edit, target = match.dx, rewrites.graph, rewrites.edit, rewrites.target
    dy, x, normalized_shape, rstd, weight = (node.args + (None,) * 5)[:5]
    outputs = _whole_backward_outputs(node)
    if isinstance(outputs, Miss) or not outputs:
        return outputs or Miss(OP.name, node.name, "no output of aten._fused_rms_norm_backward is used")
    compute = exact_common_dtype((dtype(dy), dtype(x)))
    gamma_dtype = _gamma_dtype(compute, dtype(weight) if weight is not None else compute)
    problem = rms_norm_target_problem(target, compute, gamma_dtype, shape(x), len(normalized_shape))
    if problem is None and exact_common_dtype((torch.float32, dtype(rstd))) != torch.float32:
        problem = f"rstd dtype {dtype(rstd)} does not fit RmsNormGrad's float32 rstd"
    if problem is not None:
        return Miss(OP.name, node.name, f"aten._fused_rms_norm_backward: {problem}")
    with Insertion(graph, node.prev) as inserted:
        operands = [edit.cast(dy, compute), edit.cast(x, compute), edit.cast(rstd, torch.float32)]
        if weight is not None:
            operands.append(edit.cast(weight, gamma_dtype))
        else:  # a norm without weight: gamma of ones, as the decomposed form does
            operands.append(edit.call(aten.full.default, (list(normalized_shape), 1.0),
                                      {"dtype": compute, "device": val(x).device}))
        emitted = emit_fused_op(rewrites, OP, node, operands, outputs)
        if isinstance(emitted, Miss):
            return emitted
    fused, replacements = emitted
    region = [node] + [u for u in node.users if u.target is operator.getitem]
    return commit(edit, OP.name, None, region, outputs, replacements,
                  {"dy": dy, "x": x, "rstd": rstd, "gamma": weight}, inserted.nodes(), fused)


#: why a whole forward RMSNorm stays as it is
WHOLE_FORWARD_REASON = (
    "aten._fused_rms_norm (the whole forward torch keeps where the device has its own kernel) is not rewritten "
    "into npu-fusion's rms_norm (no torch_npu line routes F.rms_norm to it), and no torchair from torch_npu 2.6.0 "
    "to 2.14.0 has a converter for it (torchair stops with 'Failed to auto-generated converter'): decompose it, "
    "with the backend option decompositions='core' or torchair's custom_decompositions="
    "torch._decomp.get_decompositions([torch.ops.aten._fused_rms_norm]); its backward still fuses")


def whole_forward_misses(graph: fx.Graph, provenance: Optional[Provenance], op: str) -> List[Miss]:
    """A miss for ``op`` at every ``aten._fused_rms_norm`` call in the graph (recomputed there
    under activation checkpointing) or in the forward graph of its partition (named so): it
    stays as it is, never silently."""
    forward = provenance.forward if provenance is not None and provenance.forward is not None else None
    misses = [Miss(op, n.name, WHOLE_FORWARD_REASON) for n in graph.nodes if _is_call(n, FUSED_RMS_NORM)]
    return misses + [Miss(op, f"{n.name} (forward graph)", WHOLE_FORWARD_REASON)
                     for n in (forward.nodes if forward is not None else ()) if _is_call(n, FUSED_RMS_NORM)]


class RmsNormGradRule(FusionRule):
    """RMSNorm's backward, matched by value in exact symbolic expressions (:mod:`.algebra`),
    rewritten into ``rms_norm_grad``; also every whole ``aten._fused_rms_norm_backward``."""

    stage = "backward"
    domain = "norm_algebra"
    ops = (OP,)
    site_probe = SiteProbe(kind=OP.option, module_classes=r"RMSNorm",
                           source=r"rsqrt\(\s*\w+\.pow\(2\)\.mean\(|\.pow\(2\)\.mean\(-1, keepdim=True\)",
                           excluded=r"-\s*mean\b")
    forms = tuple(Form(*row) for row in (
        ("fp32 statistics, `weight * x.to(dtype)`", "HF `LlamaRMSNorm` and its copies"),
        ("`torch.nn.RMSNorm`, `F.rms_norm`, with or without weight", "PyTorch"),
        ("`x * (1 + weight)` in fp32", "Gemma"),
        ("normalized input cast to the weight's dtype", "T5"),
        ("per-head norms on 4-D tensors; gamma over several trailing axes", "Qwen3 q/k norms"),
        ("dx summed into the residual gradient (no cast in between)", "fp32 models"),
        ("rstd saved by the partitioner or recomputed in the backward", "default and min-cut partitioners"),
        ("output scaled by a constant before use", "MiniCPM3's logits scaling"),
        ("gated norms: `norm(x) * gate` (dy = grad * gate)", "Qwen3-Next, Qwen3.5, Kimi `o_norm`"),
        ("post- and sandwich norms: dy is another norm's dx (or the sum of several), x another norm's output", "Gemma 2/3, OLMo 2/3, GLM-4, EXAONE 4, nanochat, HRM"),
        ("x a computed value (`norm(relu(g)**2 * up)`)", "BitNet"),
        ("float32 statistics with a bf16 weight (gamma widened exactly, dgamma narrowed back)", "torchtitan Qwen3 qk-norms in bf16"),
        ("autocast with fp32 weights; a bf16 input's normalized value rounded to bf16 before an fp32 weight (dx fused, dgamma left to the program)", "Trainer `bf16=True`; Qwen3 q/k norms under autocast"),
        ("symbolic hidden size (`dynamic=True` with the size from an input)", "dynamic shapes"),
        ("`(mean(x*x) + eps) ** -0.5`, `x / sqrt(mean(x*x) + eps)`, a statistic taken with `keepdim=False` then `unsqueeze(-1)`", "hand-written norms"),
        ("the norm's output read by several readers (dy the sum of their gradients)", "a final norm feeding an extra head and an auxiliary loss"),
        ("inside training graphs: activation checkpointing (full, selective), compiled autograd, DDP, FSDP2", "torchtitan, transformers' `gradient_checkpointing_enable`"),
        ("`aten._fused_rms_norm_backward` kept whole (the outputs its `output_mask` asks for; with or without weight)", "`F.rms_norm` on a device with its own RMSNorm kernel (CUDA, XPU; none on torch_npu yet)"),
    ))

    def find(self, graph: fx.Graph, ctx: RuleContext) -> RoundReport:
        report = find_sites(graph, ctx)
        report.matches += whole_backward_sites(graph)
        return report

    def outputs(self, match: NormMatch) -> Dict[str, fx.Node]:
        if match.dgamma_only:
            return {"dgamma": match.dgamma}
        return {"dx": match.dx, **({"dgamma": match.dgamma} if match.dgamma is not None else {})}

    def region(self, match: NormMatch, outputs) -> List[fx.Node]:
        return _region(match, outputs)

    def find_again(self, ctx: RuleContext, match: NormMatch, leaves) -> Optional[NormMatch]:
        return find_again(ctx, match, leaves)

    def emit(self, ctx: RuleContext, match):
        if isinstance(match, WholeBackwardMatch):
            return emit_whole_backward(ctx, match)
        return emit(ctx, self, match)

    def unexplained(self, graph: fx.Graph, ctx: RuleContext, misses) -> List[Miss]:
        # the whole forward is a forward site: the forward rule's where it runs (a joint graph)
        owned = "rms_norm_forward" in ctx.context.enabled and isinstance(ctx.provenance, JointProvenance)
        whole = [] if owned else whole_forward_misses(graph, ctx.provenance, OP.name)
        return unexplained(graph, ctx.provenance, misses) + whole
