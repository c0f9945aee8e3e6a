"""RoPE backward matching: dx and the table gradients recognised by value in the lanes domain."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch.fx as fx

from ...lowering.ops.rope_grad import ROPE_MODES, rope_divisor
from ...lowering.sizes import same_shape
from .. import lane_pieces
from ..lane_polys import Lanes, position_forms
from ..lanes import LaneEvaluator
from ..nodes import region_of, shape
from ..rotation import Role, TABLE_SIGNS, monomial, contiguous, dx_runs, dx_terms, table_runs, table_terms


def expected_dx(mode: int, d: int, dy: Role, cos: Role, sin: Role, signs=(1, 1)):
    """dx's polynomials with the tables' leaf positions (each table times its sign)."""
    roles, sign = {"cos": cos, "sin": sin}, {"cos": signs[0], "sin": signs[1]}
    return [{monomial((dy[0], dy[1][yp]), (roles[t][0], roles[t][1][tp])): c * sign[t] for c, yp, t, tp in lane}
            for lane in dx_terms(mode, d)]


def expected_table(mode: int, d: int, which: str, dy: Role, x: Role):
    return [{monomial((dy[0], dy[1][i]), (x[0], x[1][xp])): c}
            for i, (c, xp) in enumerate(table_terms(mode, d, which))]


def _polys_equal(a, b) -> bool:
    """Exact equality: the coefficients are rationals, never compared with a tolerance."""
    return len(a) == len(b) and all(pa == pb for pa, pb in zip(a, b))


def _equals_expected_dx(v: Lanes, mode: int, d: int, dy: Role, cos: Role, sin: Role, signs) -> bool:
    """``_polys_equal(v.polys, expected_dx(...))``, once a run of positions where the value and the
    formula have runs, else position by position, stopping at the first difference."""
    if v.inner != (d,):
        return False
    roles, sign = {"cos": cos, "sin": sin}, {"cos": signs[0], "sin": signs[1]}
    runs = dx_runs(mode, d) if v.pieces is not None else None
    if runs is not None:
        equal = lane_pieces.equals_formula(v.pieces, runs, dy, roles, lambda c, t: c * sign[t])
        if equal is not None:
            return equal
    dy_lid, dy_pos = dy
    for poly, lane in zip(v.polys, dx_terms(mode, d)):
        if poly != {monomial((dy_lid, dy_pos[yp]), (roles[t][0], roles[t][1][tp])): c * sign[t]
                    for c, yp, t, tp in lane}:
            return False
    return True


# -- matching -----------------------------------------------------------------

@dataclasses.dataclass
class RopeMatch:
    mode: int
    dx: fx.Node
    dy: Role
    cos: Role
    sin: Role
    dcos: Optional[fx.Node] = None
    dsin: Optional[fx.Node] = None
    x: Optional[Role] = None
    #: (cos, sin): -1 where the fused op's table is the leaf negated
    signs: Tuple[int, int] = (1, 1)
    #: the evaluator whose leaf numbering the roles use
    ev: Optional[LaneEvaluator] = None
    #: other gradients of x summed with dx in ``dx``'s node (x also read outside the rotation,
    #: or rotated twice): added back to the fused dx
    rest: List[fx.Node] = dataclasses.field(default_factory=list)
    #: x takes no gradient (learned tables of a constant q): ``dx`` is the site's dcos or dsin node,
    #: the node it runs under, and the fused op's dx goes unused
    table_only: bool = False

    @property
    def key(self):
        return (self.mode, self.dy, self.cos, self.sin, self.signs)


def _offsets(v: Lanes, lid: int) -> int:
    return v.lowest_position(lid)


def _read_tables(v: Lanes, mode: int, dy: Role) -> Optional[Tuple[Role, Role]]:
    """Which leaf position plays cos[i] and sin[i], read off the observed products with dy.

    Tables may be any leaf positions: half-width tables repeated, or the real and
    imaginary parts of a complex ``freqs_cis`` (Llama 4) both come out of one leaf.
    The caller still compares the whole polynomial, so this only proposes.
    """
    d = v.inner[0] if len(v.inner) == 1 else len(v.polys)
    runs = dx_runs(mode, d) if v.pieces is not None else None
    if runs is not None:  # read once a run of positions: the same proposal
        read = lane_pieces.read_partners(v.pieces, runs, dy, ("cos", "sin"), d)
        return None if read is None else (read[0]["cos"], read[0]["sin"])
    found = {"cos": [None] * d, "sin": [None] * d}
    lids = {"cos": set(), "sin": set()}
    for poly, lane in zip(v.polys, dx_terms(mode, d)):
        for coef, yp, table, tp in lane:
            y = (dy[0], dy[1][yp])
            others = [m for m in poly if y in m]
            if len(others) != 1:
                return None
            (other,) = [var for var in others[0] if var != y] or [y]
            if found[table][tp] not in (None, other):
                return None
            found[table][tp] = other
            lids[table].add(other[0])
    if any(len(l) != 1 for l in lids.values()) or any(p is None for t in found.values() for p in t):
        return None
    return tuple((next(iter(lids[t])), tuple(p for _, p in found[t])) for t in ("cos", "sin"))


def match_dx(ev: LaneEvaluator, node: fx.Node, v: Optional[Lanes] = None) -> Optional[RopeMatch]:
    """A match when ``node``'s value (or ``v``, a part of it) is a RoPE dx."""
    v = ev.memo.get(node) if v is None else v
    if v is None or v.reduction is not None or len(v.inner) != 1:
        return None
    d = v.inner[0]
    if d < 2 or d % 2:
        return None
    if any(len(p) != 2 or any(len(m) != 2 for m in p) for p in position_forms(v)):
        return None
    common = set.intersection(*({l for l, _ in m} for poly in (v.poly_at(0), v.poly_at(d - 1)) for m in poly))
    # dy and the tables enter a product symmetrically (a complex product most of all): try
    # first the leaves that carry the gradient in dx's own shape, the only ones dy can be
    for dy_lid in sorted(common, key=lambda lid: (not _can_be_dy(ev, ev.leaves[lid], node), lid)):
        dy = contiguous(dy_lid, _offsets(v, dy_lid), d)
        for mode in ROPE_MODES:
            if d % rope_divisor(mode):
                continue
            tables = _read_tables(v, mode, dy)
            if tables is None or dy_lid in (tables[0][0], tables[1][0]):
                continue
            cos, sin = tables
            for signs in TABLE_SIGNS:
                if _equals_expected_dx(v, mode, d, dy, cos, sin, signs):
                    return RopeMatch(mode, node, dy, cos, sin, signs=signs)
    return None


def _can_be_dy(ev: LaneEvaluator, leaf: fx.Node, dx: fx.Node) -> bool:
    return ev.depends_on_gradient(leaf) and same_shape(shape(leaf)[:-1], shape(dx)[:-1])


def match_table(ev: LaneEvaluator, node: fx.Node, site: RopeMatch, which: str) -> Optional[Role]:
    """x's role when ``node`` is the site's dcos (``which="cos"``) or dsin, else None."""
    v = ev.memo.get(node)
    d = site_width(ev, site)
    if v is None or v.inner != (d,) or any(len(p) != 1 for p in position_forms(v)):
        return None
    mono = next(iter(v.poly_at(0)))
    if len(mono) != 2:
        return None
    others = [var for var in mono if var != (site.dy[0], site.dy[1][0])]
    if len(others) != 1:
        return None
    x_lid = others[0][0]
    if x_lid in (site.cos[0], site.sin[0]):  # dy * cos is part of dx, not dcos
        return None
    runs = table_runs(site.mode, d, which) if v.pieces is not None else None
    if runs is not None:  # read and compared once a run of positions: the same x, the same verdict
        read = lane_pieces.read_partners(v.pieces, runs, site.dy, ("x",), d, squares=False)
        if read is None or read[0]["x"][0] != x_lid:
            return None
        x = read[0]["x"]
        equal = lane_pieces.equals_formula(v.pieces, runs, site.dy, {"x": x}, lambda c, _: c)
        if equal is None:  # x not read along runs: compared position by position
            equal = _polys_equal(v.polys, expected_table(site.mode, d, which, site.dy, x))
        return x if equal and _is_reduced_table(ev, node, v, site, which) else None
    # which x position each lane reads (mode 3's tables read x de-interleaved, and a
    # partitioner may save that de-interleaved copy instead of x)
    positions = [None] * d
    for poly, (_, xp), i in zip(v.polys, table_terms(site.mode, d, which), range(d)):
        (mono,) = poly
        other = [var for var in mono if var != (site.dy[0], site.dy[1][i])]
        if len(other) != 1 or other[0][0] != x_lid or positions[xp] not in (None, other[0][1]):
            return None
        positions[xp] = other[0][1]
    if None in positions:
        return None
    x = (x_lid, tuple(positions))
    if not _polys_equal(v.polys, expected_table(site.mode, d, which, site.dy, x)):
        return None
    return x if _is_reduced_table(ev, node, v, site, which) else None


def _is_reduced_table(ev: LaneEvaluator, node: fx.Node, v: Lanes, site: RopeMatch, which: str) -> bool:
    table = ev.leaves[(site.cos if which == "cos" else site.sin)[0]]
    return _reduces_to(node, v, ev.leaves[site.dy[0]], table)


def site_width(ev: LaneEvaluator, site: RopeMatch) -> int:
    return ev.memo[site.dx].inner[0] if not site.table_only else len(site.dy[1])


def _reduces_to(node: fx.Node, v: Lanes, dy_node: fx.Node, table: fx.Node) -> bool:
    """The node's shape is the table's, and it sums exactly over the axes the table was broadcast on."""
    out, table_shape, dy_shape = shape(node), shape(table), shape(dy_node)
    if not same_shape(out, table_shape):
        return False
    if v.reduction is None:
        return same_shape(out, dy_shape)
    summand, dims, keepdim = v.reduction
    s = shape(summand)
    if not same_shape(s, dy_shape):
        return False
    kept = [1 if i in dims else size for i, size in enumerate(s)]
    padded = (1,) * (len(s) - len(table_shape)) + tuple(table_shape)
    return same_shape(kept, padded)


def site_region(site: RopeMatch, outputs) -> List[fx.Node]:
    """The interpreted nodes between the site's outputs and its role leaves (not the other
    gradients summed with dx)."""
    ev = site.ev
    roles = {ev.leaves[r[0]] for r in (site.dy, site.cos, site.sin, site.x) if r is not None} | set(site.rest)
    return region_of(outputs.values(), lambda n: n in ev.interpreted and n not in roles
                     and ev.depends_on_gradient(n))


def site_outputs(site: RopeMatch) -> Dict[str, fx.Node]:
    dx = None if site.table_only else site.dx
    return {k: n for k, n in (("dx", dx), ("dcos", site.dcos), ("dsin", site.dsin)) if n is not None}


def keeps_tables(first: RopeMatch, again: RopeMatch) -> bool:
    """The match found again keeps every table gradient the first one had."""
    return all(getattr(first, t) is None or getattr(first, t) is getattr(again, t) for t in ("dcos", "dsin"))
