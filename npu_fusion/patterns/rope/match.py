"""RoPE forward matching: y recognised by value in the lanes domain, with the roles of x and the tables."""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch.fx as fx

from ...lowering.ops.rope_grad import ROPE_MODES, rope_divisor
from ...lowering.sizes import same_shape
from ..lanes import LaneEvaluator, shape as lane_shape
from .. import lane_pieces
from ..lane_polys import Lanes, position_forms
from ..nodes import region_of, shape
from ..rotation import TABLE_SIGNS, table_terms, y_runs


#: (leaf id, the leaf position that plays each position of the fused op's operand)
Role = Tuple[int, Tuple[int, ...]]


@dataclasses.dataclass
class ForwardRopeMatch:
    y: fx.Node
    mode: int
    x: Role
    cos: Role
    sin: Role
    signs: Tuple[int, int]
    ev: LaneEvaluator

    @property
    def dx(self) -> fx.Node:
        """The node a transaction runs under (the rules' common key)."""
        return self.y


def expected_y(mode: int, d: int, x: Role, cos: Role, sin: Role, signs=(1, 1)):
    """y's polynomials: ``x[a(i)] * cos[i] + s(i) * x[b(i)] * sin[i]``, each table times its sign."""
    polys = []
    for i, ((_, a), (s, b)) in enumerate(zip(table_terms(mode, d, "cos"), table_terms(mode, d, "sin"))):
        poly = {}
        for coef, xp, table, sign in ((1, a, cos, signs[0]), (s, b, sin, signs[1])):
            mono = tuple(sorted(((x[0], x[1][xp]), (table[0], table[1][i]))))
            poly[mono] = poly.get(mono, 0) + coef * sign
        polys.append(poly)
    return polys


def _equals_expected_y(v: Lanes, mode: int, d: int, x: Role, cos: Role, sin: Role, signs) -> bool:
    """``v.polys == expected_y(...)``, once a run of positions where the value and the formula have runs."""
    runs = y_runs(mode, d) if v.pieces is not None and d else None
    if runs is not None:
        sign = {"cos": signs[0], "sin": signs[1]}
        equal = lane_pieces.equals_formula(v.pieces, runs, x, {"cos": cos, "sin": sin}, lambda c, t: c * sign[t])
        if equal is not None:
            return equal
    return v.polys == expected_y(mode, d, x, cos, sin, signs)


def _read_roles(v: Lanes, mode: int, x: Role):
    """(cos, sin, signs) read off the products with x's elements, or None."""
    d = v.inner[0] if len(v.inner) == 1 else len(v.polys)
    runs = y_runs(mode, d) if v.pieces is not None and d else None
    if runs is not None:  # read once a run of positions: the same roles and signs
        read = lane_pieces.read_partners(v.pieces, runs, x, ("cos", "sin"), d)
        if read is None:
            return None
        roles, coefs = read
        if any(coef not in (c, -c) for t in coefs for c, coef in coefs[t]):
            return None
        signs = {t: {coef * c for c, coef in coefs[t]} for t in coefs}
        if any(len(s) != 1 for s in signs.values()):
            return None
        return roles["cos"], roles["sin"], (next(iter(signs["cos"])), next(iter(signs["sin"])))
    found = {"cos": [], "sin": []}
    signs = {"cos": set(), "sin": set()}
    for i, ((_, a), (s, b)) in enumerate(zip(table_terms(mode, d, "cos"), table_terms(mode, d, "sin"))):
        poly = v.polys[i]
        for which, xp, base in (("cos", a, 1), ("sin", b, s)):
            var = (x[0], x[1][xp])
            monos = [m for m in poly if var in m]
            if len(monos) != 1 or poly[monos[0]] not in (base, -base):
                return None
            (other,) = [u for u in monos[0] if u != var] or [var]
            found[which].append(other)
            signs[which].add(poly[monos[0]] * base)
    if any(len(s) != 1 for s in signs.values()) or any(len({o[0] for o in found[t]}) != 1 for t in found):
        return None
    cos, sin = ((found[t][0][0], tuple(p for _, p in found[t])) for t in ("cos", "sin"))
    return cos, sin, (next(iter(signs["cos"])), next(iter(signs["sin"])))


def match_y(ev: LaneEvaluator, node: fx.Node) -> Optional[ForwardRopeMatch]:
    """The rotation ``node``'s value is, or None; found once per evaluator (the rules ask again for the
    same node: the backward rule's tables of a site of table gradients alone, each check the forward
    rule makes). A fresh copy each time, as a new search would give."""
    key = ("y", node)
    if key not in ev.found:
        if node not in ev.memo:
            return None
        ev.found[key] = _match_y(ev, node)
    found = ev.found[key]
    return None if found is None else dataclasses.replace(found)


def _match_y(ev: LaneEvaluator, node: fx.Node) -> Optional[ForwardRopeMatch]:
    v = ev.memo.get(node)
    if v is None or v.reduction is not None or v.complex or len(v.inner) != 1 or v.inner[0] < 2 or v.inner[0] % 2:
        return None
    if any(len(p) != 2 or any(len(m) != 2 for m in p) for p in position_forms(v)):
        return None
    d = v.inner[0]
    lids = set.intersection(*({lid for lid, _ in m} for m in v.poly_at(0)))
    # a complex product is symmetric: x is the leaf over y's leading axes, not the broadcast table
    for x_lid in sorted(lids, key=lambda lid: (not _leads_like(ev.leaves[lid], node), lid)):
        offset = v.lowest_position(x_lid)
        x = (x_lid, lane_pieces.consecutive(offset, d))
        for mode in ROPE_MODES:
            if d % rope_divisor(mode):
                continue
            roles = _read_roles(v, mode, x)
            if roles is None or x_lid in (roles[0][0], roles[1][0]):
                continue
            cos, sin, signs = roles
            if signs in TABLE_SIGNS and _equals_expected_y(v, mode, d, x, cos, sin, signs):
                return ForwardRopeMatch(node, mode, x, cos, sin, signs, ev)
    return None


def _leads_like(leaf: fx.Node, y: fx.Node) -> bool:
    """``leaf`` has ``y``'s leading sizes (its trailing ones are the tracked lanes)."""
    a, b = lane_shape(leaf), shape(y)
    return a is not None and b is not None and len(a) >= len(b) and same_shape(a[:len(b) - 1], b[:-1])


def looks_like_y(v: Optional[Lanes]) -> bool:
    """Two products of two leaf elements per position, one leaf read at two positions (over
    one tracked axis, or several: see :func:`_axis_makers`)."""
    if not (v is not None and v.reduction is None and not v.complex and v.inner and v.inner[-1] >= 2
            and all(len(p) == 2 and all(len(m) == 2 for m in p) for p in position_forms(v))):
        return False
    a, b = v.poly_at(0)
    return any(l1 == l2 and p1 != p2 for l1, p1 in a for l2, p2 in b)


# -- the rewrite --------------------------------------------------------------

def site_region(site: ForwardRopeMatch) -> List[fx.Node]:
    ev = site.ev
    role_ids = {site.x[0], site.cos[0], site.sin[0]}
    leaves = {ev.leaves[i] for i in role_ids}
    return region_of([site.y], lambda n: n in ev.interpreted and n not in leaves)
