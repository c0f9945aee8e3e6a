"""RMSNorm backward sites: dx sites, dgamma-only sites, near misses, and a site found again around shared nodes."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.fx as fx

from ...lowering import RMS_NORM_GRAD as OP
from ...lowering.sizes import same_shape, static_int
from ..evaluator import Provenance, Unsupported
from ..norm_algebra import NormEvaluator, size_key
from ..nodes import (aten, calls_to, downstream, gradient_dependent, gradient_product, is_float_cast, normalize_dim,
                     outermost, shape, val)
from ..rewrite import Miss, RuleContext, gradient_accumulation
from ..rule import RoundReport
from .per_norm import (accumulated_suspects, backward_alone, clamped_gate, clamped_gate_reason, one_per_norm,
                       other_axes_gate_reason, other_axes_gates, other_axes_term_reason, other_axes_terms, subject,
                       sum_origins)
from .match import NormMatch, dgamma_summand, match_root, site_region, stat_leaves, symbols_of, match_dgamma
from ..rms_statistic import (SAME_VALUES, exact_source, fused_statistic_operand, norm_evaluator, normalized_operand,
                             eps_outside_reason, resembling_operand, resembling_reason, rms_statistic_operand,
                             root_plus_eps, unmatched_spelling)


#: uses between a sum over the normalized axes and the root of dx (with its accumulation)
DX_DEPTH = 9


def _norm_reductions(graph: fx.Graph, provenance: Optional[Provenance] = None):
    """[(normalized trailing shape, [keep-dim sum/mean nodes over exactly those axes])]; with a
    ``provenance``, less a joint graph's forward reductions over axes not all of size 1.

    A dx is a few uses after its own sum over the normalized axes (``sum(dy*g*x)``, a backward
    node); a joint graph's forward mean square is read only through the saved values it feeds,
    and seeding from it walked the forward. Over axes of size 1 autograd elides the backward's sum,
    and the forward's reduction is the hint that stays."""
    found: Dict[tuple, tuple] = {}
    for node in calls_to(graph, aten.sum.dim_IntList, aten.mean.dim):
        src = node.args[0]
        s = shape(src) if isinstance(src, fx.Node) else None
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if not s or not keepdim or not node.args[1]:
            continue
        dims = sorted(normalize_dim(d, len(s)) for d in node.args[1])
        if dims != list(range(len(s) - len(dims), len(s))):
            continue
        tail = tuple(s[len(s) - len(dims):])
        if provenance is not None and provenance.is_forward(node) and not all(static_int(x) == 1 for x in tail):
            continue
        found.setdefault(tuple(size_key(x) for x in tail), (tail, []))[1].append(node)
    return found.values()


def _unit_axis_seeds(graph: fx.Graph, provenance: Optional[Provenance], gradient) -> list:
    """[(normalized trailing shape, [gradient products by an RMS statistic])] of norms over unit axes.

    Autograd writes the backward of a norm over axes of static size 1 with no sum over them (a sum
    over unit axes is elided), so :func:`_norm_reductions` finds none; dx is a few uses after the product."""
    found: Dict[tuple, tuple] = {}
    for node in calls_to(graph, aten.mul.Tensor) if gradient is not None else ():
        product = gradient_product(node, gradient)
        stat = product and (rms_statistic_operand(product[1], provenance)
                            or fused_statistic_operand(product[1], provenance))
        if not stat or not isinstance(val(stat[0]), torch.Tensor):
            continue
        tail = tuple(shape(stat[0])[len(shape(stat[0])) - stat[1]:])
        if stat[1] and all(static_int(x) == 1 for x in tail):
            found.setdefault(tail, (tail, []))[1].append(node)
    return list(found.values())


#: uses between a site's roles and its dgamma's sum (``sum(dy * (x * rstd))``, casts between)
DGAMMA_REACH = 6


def _lead_sums(graph: fx.Graph, rank: int, near: Optional[List[fx.Node]] = None) -> List[fx.Node]:
    """Sums over leading axes (dgamma) and the views and casts right after them (with ``near``,
    only sums at most :data:`DGAMMA_REACH` uses from those nodes)."""
    seeds = []
    for node in calls_to(graph, aten.sum.dim_IntList) if near is None else downstream(graph, near, DGAMMA_REACH):
        if node.op == "call_function" and node.target is aten.sum.dim_IntList and isinstance(node.args[0], fx.Node):
            s = shape(node.args[0])
            if s and all(normalize_dim(d, len(s)) < len(s) - rank for d in node.args[1] or ()):
                seeds.append(node)
    # a sum over leading axes keeps its value (a weight's gradient) only through reshapes and casts
    found, frontier = list(seeds), seeds
    for _ in range(3):
        frontier = [u for n in frontier for u in n.users if u.op == "call_function"
                    and (u.target in _RESHAPES or is_float_cast(u))]
        found += frontier
    return sorted(set(found))


#: the reshapes the norm domain reads a sum over leading axes through (:meth:`~..norm_algebra.NormEvaluator._view`)
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def find_sites(graph: fx.Graph, rewrites: RuleContext) -> RoundReport:
    """This round's RMSNorm backward sites of the graph, near misses and pending candidates;
    an internal error while examining one candidate is a miss in ``rewrites``."""
    provenance = rewrites.provenance
    matches: List[NormMatch] = []
    near = RoundReport()
    rewrites.subjects.clear()  # the subjects of this round's near misses, the ones recorded
    gradient = gradient_dependent(graph)
    with_dx = set()  # the statistics of the norms whose dx the graph computes (matched or not)
    seeds = {tuple(size_key(x) for x in tail): (tail, list(nodes)) for tail, nodes in _norm_reductions(graph, provenance)}
    for tail, nodes in _unit_axis_seeds(graph, provenance, gradient):  # one evaluator per normalized shape
        seeds.setdefault(tuple(size_key(x) for x in tail), (tail, []))[1].extend(nodes)
    for norm_shape, reductions in seeds.values():
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
            if ev.is_full(shape(n)) and ev.depends_on_gradient(n):
                m = rewrites.examine(n, match_root, ev, n, stop)
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
                                               and ev.memo.get(n) is not None for s in stat_leaves(ev, ev.memo[n].expr)}
        rewrites.evaluated(ev)
    if backward_alone(provenance):  # a clamped norm over other axes: no sum over the last axes to start from
        recorded = {m.node for m in near.misses}
        gates = [g for g in other_axes_gates(graph, gradient) if g[0].name not in recorded]
        rewrites.subjects.update({n.name: about for n, _, about in gates})
        near += RoundReport([], [Miss(OP.name, n.name, other_axes_gate_reason(n, axes)) for n, axes, _ in gates])
        terms = [t for t in other_axes_terms(graph, gradient) if t[0].name not in recorded]
        rewrites.subjects.update({n.name: about for n, _, about in terms})
        near += RoundReport([], [Miss(OP.name, n.name, other_axes_term_reason(n, axes)) for n, axes, _ in terms])
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
    leaves = frozenset(dgamma_summand(ev, site).free_symbols)
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
    suspects, pending, accumulated = [], 0, []
    for n in nodes:
        verdict = rewrites.examine(n, _near_miss_verdict, ev, n, done, inside)
        if verdict == "pending":
            pending += 1
        elif verdict == "suspect":
            suspects.append(n)
        elif verdict in ("accumulated", "term"):
            accumulated.append(n)
    origin = sum_origins(ev)
    suspects += accumulated_suspects(ev, suspects, accumulated, origin)
    outer = one_per_norm(ev, outermost(sorted(suspects)), origin)
    gates = [n for n in nodes if backward_alone(ev.provenance) and rewrites.examine(n, clamped_gate, ev, n, outer, origin)]
    rewrites.subjects.update({n.name: subject(ev, n) for n in outer})
    rewrites.subjects.update({n.name: subject(ev, n.args[1]) for n in gates})  # clamp_min's backward passes dx's term
    return RoundReport([], [Miss(OP.name, n.name, _spelling_above(n, rewrites.provenance) or _two_copies(ev, n) or (
        "normalizes over the last axes like an RMSNorm dx, but its terms differ from rstd*dy*g - "
        "rstd**3*x*sum(dy*g*x)/N (eps outside the root, another statistic or a missing term)")) for n in outer]
        + [Miss(OP.name, n.name, clamped_gate_reason(n)) for n in gates], pending)


def _two_copies(ev: NormEvaluator, node: fx.Node) -> Optional[str]:
    """Why a dx-shaped ``node`` is unproven when its rstd reaches it as two saved tensors, or None.

    A backward graph alone (no forward graph to read saved tensors' definitions from) where the
    partition saved a norm's rstd twice, as it is and detached (AOTAutograd's ``rsqrt`` and
    ``detach``): ``rstd*dy*g`` reads one and ``rstd**3*x*sum(dy*g*x)/N`` the other, two leaves the
    algebra cannot prove equal."""
    plain, cubed = _saved_copies(ev, ev.memo[node].expr)
    if not cubed or plain and plain <= cubed:
        return None
    copies = ", ".join(n.name for n in [*sorted(plain - cubed)[:1], *sorted(cubed)[:1]])
    return (f"normalizes over the last axes like an RMSNorm dx whose rstd reaches the backward as saved tensors "
            f"({copies}: the partition saves the statistic as it is and detached), which a backward graph alone cannot "
            f"prove to be one statistic: give the pass this partition's forward graph (fuse_backward(gm, options, "
            f"forward=fw), or torchair's hook with the forward compiled in the same process), or compile with "
            f"backend='npu_fusion', which fuses the norm on the joint graph")


def _saved_copies(ev: NormEvaluator, expr) -> tuple:
    """(placeholders read to the power 1 in terms without a sum, placeholders cubed beside a sum) of ``expr``,
    on a backward graph without its forward (none where the pass has the forward: it reads their definitions)."""
    plain, cubed = set(), set()
    if ev.provenance is not None and ev.provenance.forward is not None:
        return plain, cubed
    for mono, _ in expr.split_terms():
        has_sum = any(s in ev.sum_body for s, _ in mono)
        for s, e in mono:
            leaf = ev.node_of.get(s)
            if s in ev.varying or leaf is None or leaf.op != "placeholder":
                continue
            if has_sum and e == 3:
                cubed.add(leaf)
            elif not has_sum and e == 1:
                plain.add(leaf)
    return plain, cubed


def _spelling_above(node: fx.Node, provenance: Optional[Provenance]) -> Optional[str]:
    """The :func:`unmatched_spelling` of an operand of a product or quotient at most
    :data:`DX_DEPTH` steps above ``node`` (the reason a dx-shaped node matched no form)."""
    frontier, seen = [node], {node}
    for _ in range(DX_DEPTH):
        above = []
        for n in frontier:
            if n.op == "call_function" and n.target in (aten.mul.Tensor, aten.div.Tensor):
                reason = next(filter(None, (unmatched_spelling(a, provenance) or _resembling_reason(a, provenance)
                                            for a in (n, *n.args[:2]) if isinstance(a, fx.Node))), None)
                if reason is not None:
                    return reason
            above += [a for a in n.all_input_nodes if a not in seen]
        seen.update(above)
        frontier = above
    return None


def _resembling_reason(node: fx.Node, provenance: Optional[Provenance]) -> Optional[str]:
    """Why a norm whose statistic is ``node`` matched no form: it resembles an RMS statistic, or adds eps to the root; or None."""
    found = resembling_operand(node, provenance)
    if found is not None:
        return resembling_reason(found[2])
    written = root_plus_eps(node, provenance)
    return eps_outside_reason(written) if written is not None else None


def _sums_and_region(ev: NormEvaluator, site: NormMatch) -> tuple:
    """The symbols of a matched site's sum over the normalized axes, and the nodes of its dx."""
    summand = ev.value_of(site.dy) * ev.value_of(site.gamma) * ev.value_of(site.x)
    return ev.sum_over_normalized(summand).free_symbols, site_region(site, {"dx": site.dx})


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
    if len(sums) > 1 and not sums & done and stat_leaves(ev, v.expr) and len(v.expr.terms) >= 2:
        return "accumulated"  # several unmatched norms' dx summed (:func:`_accumulated_suspects`)
    if len(sums) == 1 and not sums & done and len(v.expr.terms) == 1 and _saved_copies(ev, v.expr)[1]:
        return "term"  # a dx's summed term whose rstd a backward alone cannot read (:func:`_two_copies`)
    # a norm's dx scales by a saved statistic and has a term x * sum(product) with the
    # product of degree >= 2 (dy*g*x): (log-)softmax's backward has no statistic or sums
    # the gradient alone, normalizing by a plain sum (MoE routing weights) has no x there
    if len(sums) != 1 or not stat_leaves(ev, v.expr) or sum(
            abs(e) for _, e in ev.sum_body[next(iter(sums))]) < 2:
        return None
    summed_terms = [symbols_of(m) for m, _ in v.expr.split_terms() if symbols_of(m) & sums]
    if not any(t & ev.varying for t in summed_terms):
        return None
    if not sums & done and len(v.expr.terms) >= 2:
        return "suspect"
    if sums & done and n not in inside:
        return "pending"
    return None


def _statistic_candidates(graph: fx.Graph, provenance, gradient) -> Dict[tuple, tuple]:
    """{norm shape key: (norm shape, [(node, y, has_rstd)])}: backward nodes (forward values)
    that are an RMS statistic of y (has_rstd) or y normalized by it."""
    found: Dict[tuple, tuple] = {}
    # a statistic or a normalized value is, through what it keeps its values through, a root or a product
    for node in sorted(graph.find_nodes(op="placeholder", sort=False) + calls_to(graph, *_STATISTIC_SPELLINGS)):
        if gradient is not None and node in gradient:
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


#: what :func:`rms_statistic_operand` and :func:`normalized_operand` read a node as, directly or through
#: the ops a value keeps its values through (:func:`~..rms_statistic.definition_of`): no other call is either
_STATISTIC_SPELLINGS = SAME_VALUES | {aten.rsqrt.default, aten.pow.Tensor_Scalar, aten.mul.Tensor}


def _untaken_statistics(graph: fx.Graph, provenance, taken: set) -> bool:
    """Whether some RMS statistic's input is not among ``taken``.

    Every candidate of :func:`_statistic_candidates` is read, through what keeps its values, off a
    root (an ``rsqrt`` or a ``** -0.5``) of the graph or of the forward graph its saved tensors
    name: when each root's statistic is of a taken norm, no candidate survives the filter."""
    graphs = [graph] + ([provenance.forward] if provenance is not None and provenance.forward is not None else [])
    roots = [n for g in graphs for n in calls_to(g, aten.rsqrt.default, aten.pow.Tensor_Scalar)]
    stats = (rms_statistic_operand(n, provenance) for n in roots)
    return any(exact_source(stat[0], provenance) not in taken for stat in stats if stat is not None)


def taken_norms(graph: fx.Graph, provenance, matches: List[NormMatch]) -> set:
    """The normalized inputs (exact sources) of the norms a dx site covers: matched this round,
    or fused by an earlier one (whose dgamma may be left to the program deliberately)."""
    rstds = [m.rstd for m in matches] + [n.args[2] for n in calls_to(graph, OP.overload)]
    taken = set()
    for rstd in rstds:
        stat = rms_statistic_operand(rstd, provenance) or fused_statistic_operand(rstd, provenance) \
            if isinstance(rstd, fx.Node) else None
        if stat is not None:
            taken.add(exact_source(stat[0], provenance))
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
    source = exact_source(y, ev.provenance)
    for s in sorted(symbols & ev.varying):
        node = ev.node_of.get(s)
        if node is not None and same_shape(shape(node), shape(y)) and exact_source(node, ev.provenance) is source:
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
    taken = taken_norms(graph, provenance, matches)
    taken |= {exact_source(stat[0], provenance) for stat in (rms_statistic_operand(n, provenance) for n in with_dx) if stat}
    claimed = {m.dgamma for m in matches}
    found = []
    if not _untaken_statistics(graph, provenance, taken):  # every norm's dx is here: no candidate is left
        return found
    for key, (norm_shape, candidates) in _statistic_candidates(graph, provenance, gradient).items():
        candidates = [c for c in candidates if exact_source(c[1], provenance) not in taken]
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
        found += [m for m in outermost(sites, node=lambda m: m.dx)
                  if not _statistic_scales_another_gradient(graph, provenance, gradient, m)]
        rewrites.evaluated(ev)
    return found


def _statistic_scales_another_gradient(graph: fx.Graph, provenance: Optional[Provenance], gradient,
                                       site: NormMatch) -> bool:
    """Whether the statistic of a dgamma-only ``site`` scales a gradient that its dgamma does not sum.

    Such a norm's input takes a gradient that is no RMSNorm dx (its statistic detached: ``dy * g *
    rstd``): the norm is no dgamma-only site, or it would be judged twice, its dgamma fused and the
    product that scales x's gradient recorded as a miss (:func:`.misses.unexplained` records it once)."""
    found = (rms_statistic_operand(site.rstd, provenance) if site.rstd is not None
             else normalized_operand(site.x, provenance))
    if found is None or gradient is None:
        return False
    normalized = exact_source(found[0], provenance)  # the norm's input: one key per norm, as the scans key it
    for node in calls_to(graph, aten.mul.Tensor):  # the only products gradient_product reads
        product = gradient_product(node, gradient)
        stat = rms_statistic_operand(product[1], provenance) if product is not None else None
        if stat is not None and exact_source(stat[0], provenance) is normalized \
                and site.dgamma not in downstream(graph, [node], DX_DEPTH):
            return True
    return False


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
        again = match_root(ev, site.dx, set()) if ev.spans(shape(site.dx)) and ev.depends_on_gradient(site.dx) \
            else None
        rewrites.raise_if_strict(ev)
        if again is not None:
            near = [n for n in again.roles if n is not None]
            again.dgamma = _dgamma_of(lambda node, fn, *args: fn(*args), ev, again,
                                      _lead_sums_by_leaves(ev, _lead_sums(graph, ev.k, near)))
            return again if again.dgamma is site.dgamma else None
    return None
