"""RoPE backward sites: candidates, matches (accumulated ones too), table gradients, near misses, and a site found again."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import operator

import torch.fx as fx

from ...lowering import ROPE_GRAD as OP
from ...lowering.sizes import static_int
from ..evaluator import JointProvenance, Unsupported
from ..lane_polys import Lanes, add_polys, position_forms
from ..lanes import LaneEvaluator
from ..nodes import (CAST_TARGETS, VIEWS, aten, downstream, dtype, gradient_dependent, gradient_product, outermost,
                     region_of, shape)
from ..rewrite import Miss, RuleContext, gradient_accumulation
from ..pairing import calls, source
from ..rule import RoundReport
from ..rope.sites import forward_rotations
from ..lane_pieces import is_consecutive
from ..rotation import (DX_DEPTH, MAX_LANES, Role, contiguous, head_dim_mark, element_moves, lane_evaluator, rotation_sums,
                        sums_dx_terms, symbolic_head_dim_reason)
from .match import RopeMatch, keeps_tables, site_region, match_dx, match_table


# -- the pass -----------------------------------------------------------------

def _candidates(nodes):
    """The float calls among ``nodes`` whose last axis is static and no wider than any RoPE head dim."""
    for node in nodes:
        if node.op != "call_function":
            continue
        s, dt = shape(node), dtype(node)
        if not s or dt is None or not dt.is_floating_point:
            continue
        d = static_int(s[-1])
        if d is not None and 2 <= d <= MAX_LANES:
            yield node


def _symbolic_last_axis(ev: LaneEvaluator, seeds) -> List[Miss]:
    """Record the RoPE sites that a symbolic head dim keeps from fusing.

    Gradients moved along a symbolic last axis and summed with a rotation's terms, as a RoPE dx
    is (``dy * cos`` plus a move of ``dy * sin``), or multiplied as complex pairs (``freqs_cis``):
    the match is proved position by position, which needs a static head dim, so such a site
    cannot fuse; say so rather than leave it unexplained. A difference or a shift of a gradient
    (its moves summed with no product) is no RoPE."""
    sums = rotation_sums([s for s in seeds if ev.depends_on_gradient(s)], sums_dx_terms)
    return [Miss(OP.name, n.name, symbolic_head_dim_reason(SYMBOLIC_MOVES, head_dim_mark(n))) for n in sums]


#: what the backward scan finds along a symbolic last axis (:func:`_symbolic_last_axis`)
SYMBOLIC_MOVES = "gradients moved along a symbolic last axis, as a RoPE dx does"


def _looks_like_dx(v: Optional[Lanes], spanning: bool = False) -> bool:
    """Two products of two leaf elements per position, one leaf read at two positions
    (a rotation): the shape of a RoPE dx (with ``spanning``, over several tracked axes instead
    of one). Softmax's backward has two products but no rotation."""
    if not (v is not None and v.reduction is None and (len(v.inner) > 1 if spanning else len(v.inner) == 1)
            and v.inner[-1] >= 2 and v.inner[-1] % 2 == 0
            and all(len(p) == 2 and all(len(m) == 2 for m in p) for p in position_forms(v))):
        return False
    a, b = v.poly_at(0)
    return any(l1 == l2 and p1 != p2 for l1, p1 in a for l2, p2 in b)


def _looks_like_table(v: Optional[Lanes]) -> bool:
    """One product of two leaf elements per position: a dcos/dsin summand."""
    return (v is not None and len(v.inner) == 1 and v.inner[0] >= 2
            and all(len(p) == 1 and all(len(m) == 2 for m in p) for p in position_forms(v)))


def find_sites(graph: fx.Graph, rewrites: RuleContext) -> RoundReport:
    """This round's RoPE backward sites of the graph (each match with its evaluator), near
    misses and pending candidates; an internal error while examining one candidate is a miss
    in ``rewrites``."""
    seeds = element_moves(graph)
    nodes = list(_candidates(downstream(graph, seeds, DX_DEPTH)))
    ev = _evaluated(rewrites, graph, nodes)
    makers = _gradient_axis_makers(ev, nodes)
    if makers:
        rewrites.evaluated(ev)
        ev = _evaluated(rewrites, graph, nodes, makers)
    # a forward value recomputed in the backward (checkpointing) can look like a dx: it is none
    looks = [n for n in nodes if ev.depends_on_gradient(n) and _looks_like_dx(ev.memo.get(n))]
    matches, inside = _dx_matches(rewrites, ev, looks)
    matches += _accumulated_matches(rewrites, ev, nodes, {m.dx for m in matches} | inside, inside)
    _match_table_gradients(rewrites.examine, ev, graph, matches)
    matches += _table_only_matches(rewrites, ev, graph, matches)
    misses, pending = _near_misses(rewrites, ev, looks, matches, inside)
    rewrites.evaluated(ev)
    return RoundReport(matches, misses + _symbolic_last_axis(ev, seeds), pending)


def _evaluated(rewrites: RuleContext, graph: fx.Graph, nodes, forced=()) -> LaneEvaluator:
    """The evaluator that has read ``nodes``, with the ``forced`` nodes read as leaves."""
    ev = lane_evaluator(rewrites.provenance, forced)
    ev.gradient_nodes = gradient_dependent(graph)
    for node in nodes:
        ev.value(node)
    return ev


#: the lane evaluator's reshapes: a view that may split the tracked last axis into two
SPLITTING_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int}
#: the views that may insert axes of size 1 before a table's last axis (``cos[:, None]``)
UNIT_AXIS_VIEWS = SPLITTING_VIEWS | {aten.unsqueeze.default}


def _gradient_axis_makers(ev: LaneEvaluator, nodes) -> set:
    """The views of a gradient that give a dx-shaped value a second tracked axis, to be read as leaves.

    A rotation applied before the heads' transpose and flattened after it (``y.reshape(B, S, N * D)``)
    has a dy that is ``grad.view(B, S, N, D)`` of a gradient N*D wide: tracked as (N, D), its dx
    spans two axes and matches no mode (three for ``y.flatten(1)``, where its product with a table
    over (1, D) is no value at all). Read as a leaf (always sound: a leaf is its own value), that
    view is dy over the head dim, the fused op's 4-D layout. Only views of a gradient that split one
    tracked axis into several, that a dx-shaped value spanning several axes reads and no matched
    dx over one axis computes (DeepSeek's ``view(..., D/2, 2)`` stays read), or that a product
    refused for its broadcast reads. Also a table's view that only inserts axes of size 1 before its
    last (:func:`_unit_axis_table`), when a product with a gradient refused it."""
    spanning = [n for n in nodes if ev.depends_on_gradient(n) and _looks_like_dx(ev.memo.get(n), spanning=True)]
    # a product whose operands' tracked axes do not line up (dy over (S, N, D) times a table over
    # (1, D)): its operands are near too
    refused = [a for n, why in ev.unsupported.items() if why == "broadcast" and n.target is aten.mul.Tensor
               and ev.depends_on_gradient(n) for a in n.all_input_nodes]
    tables = refused_unit_axis_tables(ev)
    if not spanning and not refused:
        return tables
    # a dx over one axis that matches covers what it reads; one that matches no mode (the N * D wide
    # view of a rotation of N heads, flattened after it) does not
    flat = [n for n in nodes if ev.depends_on_gradient(n) and _looks_like_dx(ev.memo.get(n)) and match_dx(ev, n)]
    covered = set(region_of(flat, lambda r: r in ev.interpreted))
    near = {n for y in spanning if y not in covered for n in region_of([y], lambda r: r in ev.interpreted)}
    near.update(refused)
    makers = set()
    for n in near:
        v = ev.memo.get(n)
        source = ev.memo.get(n.args[0]) if n.target in SPLITTING_VIEWS and isinstance(n.args[0], fx.Node) else None
        # a split into pairs (complex numbers, interleaved lanes: ``view(..., D/2, 2)``) is the formula's
        if source is not None and ev.depends_on_gradient(n) and v is not None and len(v.inner) >= 2 \
                and len(source.inner) == 1 and v.inner[-2] > 1 and v.inner[-1] > 2:
            makers.add(n)
    return makers | tables


#: why the lanes refuse a gradient's product with a table view tracked over ``(1, D)``: the gradient's axis
#: before D is no axis of size 1 ("broadcast"), or is symbolic, so no second tracked axis ("inner sizes")
REFUSED_PRODUCT = {"broadcast", "inner sizes"}


def refused_unit_axis_tables(ev: LaneEvaluator) -> set:
    """The table views of :func:`_unit_axis_table` read by a product with a gradient the lanes refused
    (:data:`REFUSED_PRODUCT`: under ``dynamic=True`` the heads' axis is symbolic)."""
    return {a for n, why in ev.unsupported.items() if why in REFUSED_PRODUCT and n.target is aten.mul.Tensor
            and ev.depends_on_gradient(n) for a in n.all_input_nodes if _unit_axis_table(ev, a)}


def _unit_axis_table(ev: LaneEvaluator, n: fx.Node) -> bool:
    """Whether ``n`` is a view of a value that takes no gradient, tracked over one axis, with axes of
    size 1 inserted before it (``cos[:, None]``, ``[S, D]`` read as ``[S, 1, D]``).

    A BSND rotation's ``cos[:, None]`` is such a view where another rotation (BNSD) reads ``[S, D]``
    itself, which is then a leaf the view is read from: tracked over ``(1, D)``, the view times a
    gradient tracked over ``(D,)`` is refused (the gradient's axis before D is N, no axis of size
    1). Read as a leaf, the view is the table as the program broadcasts it: its shape, not the
    unviewed table's, is what the fused op is given, so which table row meets which element is the
    program's (a leaf is its own value)."""
    v = ev.memo.get(n)
    source = ev.memo.get(n.args[0]) if n.target in UNIT_AXIS_VIEWS and isinstance(n.args[0], fx.Node) else None
    return (source is not None and v is not None and not ev.depends_on_gradient(n) and v.reduction is None
            and source.reduction is None and not v.complex and len(source.inner) == 1 and len(v.inner) >= 2
            and all(s == 1 for s in v.inner[:-1]) and v.inner[-1] == source.inner[0])


def _dx_matches(rewrites: RuleContext, ev: LaneEvaluator, looks: List[fx.Node]):
    """The outermost dx matches among the dx-shaped nodes, and the nodes inside them."""
    matches = [m for m in (rewrites.examine(n, match_dx, ev, n) for n in looks) if m is not None]
    matches = outermost(matches, node=lambda m: m.dx, same=lambda a, b: a.key == b.key)
    # a match inside another's subgraph (mode 0 on DeepSeek's de-interleaved q, under
    # the mode 3 match of the whole) is part of the larger rewrite
    inside = set()
    for m in matches:
        roles = {ev.leaves[r[0]] for r in (m.dy, m.cos, m.sin)}
        inside.update(n for n in region_of([m.dx], lambda n: n in ev.interpreted and n not in roles)
                      if n is not m.dx)
    matches = [m for m in matches if m.dx not in inside]
    for m in matches:
        m.ev = ev
    return matches, inside


def _accumulated_matches(rewrites: RuleContext, ev: LaneEvaluator, nodes, matched: set, inside: set):
    """The sites whose dx autograd sums with other gradients of x in one accumulation.

    Sites whose dx autograd sums with other gradients of x in one accumulation (``rope(q) * q``:
    dx plus ``dy * rope(q)``; two rotations of one q: one dx plus the other): the root of a
    tree of single-use adds whose summands, all but one, sum to a RoPE dx. The one left out is
    added back to the fused dx (:attr:`RopeMatch.rest`); each is its own site."""
    found = []
    for root in nodes:
        if root in matched or root.target is not aten.add.Tensor or not ev.depends_on_gradient(root) or any(
                u.target is aten.add.Tensor and len(root.users) == 1 for u in root.users):
            continue
        summands, _ = gradient_accumulation(root, matched)
        values = [ev.memo.get(n) if isinstance(n, fx.Node) else None for n in summands]
        if len(summands) < 3 or ev.memo.get(root) is None or any(
                v is None or v.reduction is not None or v.complex or v.inner != ev.memo[root].inner for v in values):
            continue
        # a dx matched this round is summed here too (two rotations of one x): it is the rest
        done = [n for n in summands if n in matched]
        for rest in done if len(done) == 1 else () if done else summands:
            site = rewrites.examine(root, _match_without, ev, root, summands, values, rest)
            if site is not None:
                site.ev, site.rest = ev, [rest]
                inside.update(n for n in site_region(site, {"dx": root}) if n is not root)
                found.append(site)
                break
    return found


def _match_without(ev: LaneEvaluator, root: fx.Node, summands, values, rest) -> Optional[RopeMatch]:
    """A match at ``root`` when its summands but ``rest`` sum to a RoPE dx."""
    polys = [{} for _ in values[0].polys]
    try:
        for part, v in zip(summands, values):
            if part is not rest:
                polys = [add_polys(a, b) for a, b in zip(polys, v.polys)]
    except Unsupported:  # more terms than any dx has
        return None
    return match_dx(ev, root, Lanes(values[0].inner, polys))


def _match_table_gradients(examine, ev: LaneEvaluator, graph: fx.Graph, matches) -> None:
    """Set each match's dcos, dsin and x where the graph computes them: products with its dy,
    reduced, a few uses after dy."""
    dys = [ev.leaves[m.dy[0]] for m in matches]
    table_nodes = [n for n in downstream(graph, dys, 4) if n.op == "call_function"] if dys else []
    tables_by_leaf: Dict[int, List[fx.Node]] = {}
    for node in table_nodes:
        ev.value(node)
        v = ev.memo.get(node)
        if _looks_like_table(v):
            for lid in {var[0] for var in next(iter(v.poly_at(0)))}:
                tables_by_leaf.setdefault(lid, []).append(node)
    for site in matches:
        if not all(is_consecutive(r[1], 0, static_int(shape(ev.leaves[r[0]])[-1])) for r in (site.cos, site.sin)):
            continue  # dcos/dsin are grads of whole tables; rebuilt tables have none in the graph
        if site.signs != (1, 1):
            continue  # the graph's table gradients are of the leaves, not of the negated tables
        _choose_table_gradients(examine, ev, site, tables_by_leaf.get(site.dy[0], ()))


def _choose_table_gradients(examine, ev: LaneEvaluator, site: RopeMatch, candidates) -> None:
    """``examine(node, fn, *args)`` runs ``fn(*args)`` for the candidate ``node``."""
    tables: Dict[str, List[Tuple[fx.Node, Role]]] = {"cos": [], "sin": []}
    for node in candidates:
        for which in ("cos", "sin"):
            x = examine(node, match_table, ev, node, site, which)
            if x is not None:
                tables[which].append((node, x))
    for which, found in tables.items():
        tables[which] = outermost(found, node=lambda f: f[0])
    # Any product dy * T matches dcos for *some* x (all signs are +1), so dcos and dsin
    # are chosen together: the pair that reads the same x.
    pairs = [(c, s) for c in tables["cos"] for s in tables["sin"] if c[1] == s[1]]
    if len(pairs) == 1:
        (site.dcos, site.x), (site.dsin, _) = pairs[0]
    elif not pairs and len(tables["cos"]) + len(tables["sin"]) == 1:
        (node, site.x), which = (tables["cos"] or tables["sin"])[0], "cos" if tables["cos"] else "sin"
        setattr(site, "d" + which, node)


def _table_only_matches(rewrites: RuleContext, ev: LaneEvaluator, graph: fx.Graph, matches) -> List[RopeMatch]:
    """The sites whose x takes no gradient: a forward rotation's dcos and dsin with no dx.

    Learned tables (parameters, or computed from them) rotating a q that takes no gradient: the
    backward is only ``dcos = sum(dy * x)`` and ``dsin = sum(dy * rotate(x))``, which the fused op
    computes with x passed (its dx unused). Those values depend on cos and sin only through their
    shape; the fused op reads the forward rotation's own tables (matched by value in the forward,
    :func:`~..rope.match.match_y`), so both fused ops of the rotation name the same tables."""
    if not isinstance(rewrites.provenance, JointProvenance):
        return []
    gradient = ev.gradient_nodes or set()
    handled = {source(ev.leaves[r[0]]) for m in matches for r in (m.cos, m.sin)}
    handled |= _tables_of_a_dx(graph, gradient)
    # a rotation whose backward fused in an earlier round (its dx, perhaps not its table gradients) is done
    handled |= {source(op.args[i]) for op in calls(graph, OP) for i in (1, 2)}
    found = []
    for rotation in forward_rotations(graph, gradient):
        fev = rotation.ev
        x, cos, sin = (fev.leaves[r[0]] for r in (rotation.x, rotation.cos, rotation.sin))
        d = len(rotation.x[1])
        if rotation.signs != (1, 1) or source(cos) in handled or source(sin) in handled or any(
                not is_consecutive(r[1], 0, static_int(shape(fev.leaves[r[0]])[-1])) for r in (rotation.cos, rotation.sin)):
            continue
        candidates = [n for n in downstream(graph, [x], 2 * DX_DEPTH) if n in gradient and n.op == "call_function"]
        for node in candidates:
            ev.value(node)
        products = [n for n in candidates if _looks_like_table(ev.memo.get(n)) and ev.memo[n].inner == (d,)]
        for dy_lid in sorted({var[0] for n in products for var in next(iter(ev.memo[n].polys[0]))
                              if ev.depends_on_gradient(ev.leaves[var[0]])}):
            anchor = next(n for n in products if any(var[0] == dy_lid for var in next(iter(ev.memo[n].polys[0]))))
            site = RopeMatch(rotation.mode, anchor, contiguous(dy_lid, 0, d), contiguous(ev.leaf_id(cos), 0, d),
                             contiguous(ev.leaf_id(sin), 0, d), ev=ev, table_only=True)
            _choose_table_gradients(rewrites.examine, ev, site, products)
            if site.dcos is not None and site.dsin is not None:
                site.dx = site.dcos
                handled |= {source(cos), source(sin)}
                found.append(site)
                break
    return found


def _tables_of_a_dx(graph: fx.Graph, gradient: set) -> set:
    """The forward values (by :func:`~..pairing.source`) that an unreduced gradient multiplies.

    Those are the tables of a dx's terms (``dy * cos``, dy any gradient but a table's), whose rotation
    is no site of table gradients alone, even while its dx waits for a site below it to fuse; a
    reduced table gradient times the table (the chain rule into learned angles) is none of them."""
    tables = set()
    for node in graph.find_nodes(op="call_function", target=aten.mul.Tensor):  # the only products gradient_product reads
        product = gradient_product(node, gradient) if node in gradient else None
        if product is None:
            continue
        factor = product[0]
        while factor.op == "call_function" and (factor.target in VIEWS or factor.target in CAST_TARGETS):
            factor = factor.args[0]
        reduced = factor.op == "call_function" and (factor.target in (aten.sum.dim_IntList, aten.sum.default) or (
            factor.target is operator.getitem and getattr(factor.args[0], "target", None) is OP.overload
            and factor.args[1] in (1, 2)))
        if not reduced:
            tables.add(source(product[1]))
    return tables


def _near_misses(rewrites: RuleContext, ev: LaneEvaluator, looks, matches, inside) -> Tuple[List[Miss], int]:
    """dx-shaped nodes that are neither a match, inside one, nor built on one (misses), and how
    many are built on one (pending: decided next round, once the site below is fused). A
    failure while reading one node is a miss at that node."""
    matched = {m.dx for m in matches} | inside
    outputs = {n for m in matches for n in (m.dx, m.dcos, m.dsin) if n is not None}

    def built_on_match(n):  # e.g. q's dsin plus k's dsin: two products per element, legitimately
        region = region_of([n], lambda r: r is n or (r in ev.interpreted and r not in outputs))
        return any(a in outputs for r in region for a in r.all_input_nodes)

    verdicts = {n: rewrites.examine(n, built_on_match, n) for n in looks if n not in matched}
    built_on = [n for n, built in verdicts.items() if built is True]
    unmatched = [n for n, built in verdicts.items() if built is False]
    misses = []
    for n in outermost(unmatched):
        misses.append(Miss(OP.name, n.name, "two products per element like a RoPE dx, but no mode's formula "
                                            "(signs, split points or tables differ)"))
        rewrites.context.judgements.defer(misses[-1], _table_keys(ev, n))
    return misses, len(built_on)


def _table_keys(ev: LaneEvaluator, node: fx.Node) -> List[tuple]:
    """The site keys of the rotations ``node`` may be the backward of: each pair of the forward values
    (no gradient) its products read, as :func:`~..pairing.site_key` names a rotation's cos and sin."""
    v = ev.memo.get(node)
    tables = {source(ev.leaves[lid]) for poly in (v.polys if v is not None else ()) for mono in poly
              for lid, _ in mono if not ev.depends_on_gradient(ev.leaves[lid])}
    return [(OP.option, a, b) for a in tables for b in tables]


def find_again(rewrites: RuleContext, site: RopeMatch, leaves: List[fx.Node]) -> Optional[RopeMatch]:
    """``site`` matched again with ``leaves`` as leaves, in the same mode and with every table
    gradient it had (the new evaluator and its leaf numbering belong to this site only); None
    when it no longer matches so. Reads only the site's dx and the products near its dy."""
    if site.table_only:
        return None  # its intermediates shared: left as they are, a recorded miss
    ev = lane_evaluator(rewrites.provenance, leaves)
    ev.gradient_nodes = gradient_dependent(rewrites.graph)
    ev.value(site.dx)
    again = match_dx(ev, site.dx)
    if again is None or again.mode != site.mode:
        return None
    again.ev = ev
    _match_table_gradients(lambda node, fn, *args: fn(*args), ev, rewrites.graph, [again])
    rewrites.raise_if_strict(ev)
    return again if keeps_tables(site, again) else None
