"""The lanes domain's values over one tracked axis, written once per run of positions instead of once per position.

A value of :mod:`.lanes` is one polynomial per position ``i`` of the tracked axis. Along a RoPE
site the polynomials repeat with a shift: position ``i`` of a leaf reads ``leaf[i]``, a slice from
``start`` reads ``leaf[i + start]``, ``rotate_half`` reads ``-x[i + D/2]`` on the first half and
``x[i - D/2]`` on the second. A :data:`Pieces` value says that once per run: a few intervals
``[lo, hi)`` of positions, each with one *template*, a polynomial whose variables are
``(leaf id, offset)``, read at position ``i`` as the leaf element ``(leaf id, i + offset)``.

Reading a template at a position renames its variables one to one (distinct offsets of one leaf
stay distinct positions, and sorting by ``(leaf id, offset)`` sorts by ``(leaf id, i + offset)``),
so the sums and products of :mod:`.lanes` compute on templates exactly what they compute on the
polynomials of every position of the run, and :func:`materialize` gives back those polynomials,
equal to the ones the per-position evaluation builds. An op this module does not write on runs
(a broadcast of a size-1 axis, several tracked axes, complex values) reads the materialized
polynomials, as before: the pieces are a faster spelling of the same value, never a second domain.
"""
from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

#: (lo, hi, template): positions lo <= i < hi read ``template`` at i
Piece = Tuple[int, int, Dict[tuple, object]]
Pieces = Tuple[Piece, ...]


def leaf_pieces(lid: int, d: int) -> Pieces:
    """A leaf's value over ``d`` positions: position i is the leaf's element i."""
    return ((0, d, {((lid, 0),): 1}),)


def constant_pieces(value, d: int) -> Pieces:
    """The value ``value`` (0 included) at every one of ``d`` positions."""
    return ((0, d, {(): value} if value else {}),)


def _shift_mono(mono: tuple, by: int) -> tuple:
    return tuple((lid, off + by) for lid, off in mono)


def shifted(template: Dict[tuple, object], by: int) -> Dict[tuple, object]:
    """The template read ``by`` positions further: variable offsets plus ``by`` (the order is kept)."""
    if not by:
        return template
    return {_shift_mono(m, by): c for m, c in template.items()}


def materialize(pieces: Pieces) -> List[dict]:
    """The per-position polynomials of :mod:`.lanes`: each run's template read at each of its positions."""
    polys: List[dict] = []
    for lo, hi, template in pieces:
        items = list(template.items())
        if all(not m for m, _ in items):  # constants: one polynomial read everywhere
            polys.extend(template for _ in range(lo, hi))
            continue
        for i in range(lo, hi):
            polys.append({tuple((lid, i + off) for lid, off in m): c for m, c in items})
    return polys


def at(pieces: Pieces, i: int) -> dict:
    """The polynomial of position ``i``."""
    for lo, hi, template in pieces:
        if lo <= i < hi:
            return {tuple((lid, i + off) for lid, off in m): c for m, c in template.items()}
    raise IndexError(i)


def combine(operands: Sequence[Pieces], fn: Callable) -> Pieces:
    """``fn`` of the operands' templates on each run where every operand reads one template.

    ``fn`` is one of :mod:`.lanes`' position-wise combinations (a sum, a product, a scaling): it
    renames nothing, so applied to templates it is applied to every position of the run."""
    cuts = sorted({b for pieces in operands for lo, hi, _ in pieces for b in (lo, hi)})
    cursors = [0] * len(operands)
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        templates = []
        for k, pieces in enumerate(operands):
            while pieces[cursors[k]][1] <= lo:
                cursors[k] += 1
            templates.append(pieces[cursors[k]][2])
        out.append((lo, hi, fn(*templates)))
    return tuple(out)


def window(pieces: Pieces, start: int, end: int) -> Pieces:
    """Positions ``start <= i < end`` as positions ``0 .. end - start`` (a slice of step 1)."""
    out = []
    for lo, hi, template in pieces:
        a, b = max(lo, start), min(hi, end)
        if a < b:
            out.append((a - start, b - start, shifted(template, start)))
    return tuple(out)


def placed(base: Pieces, src: Pieces, start: int) -> Pieces:
    """``base`` with its positions ``start .. start + len(src)`` replaced by ``src``'s (a scatter of step 1)."""
    end = start + length(src)
    out = [p for p in window(base, 0, start)]
    out += [(lo + start, hi + start, shifted(t, -start)) for lo, hi, t in src]
    out += [(lo + end, hi + end, t) for lo, hi, t in window(base, end, length(base))]
    return tuple(out)


def length(pieces: Pieces) -> int:
    return pieces[-1][1] if pieces else 0


def max_degree(pieces: Pieces) -> int:
    return max((len(m) for _, _, t in pieces for m in t), default=0)


def is_constant(pieces: Pieces) -> bool:
    return all(m == () for _, _, t in pieces for m in t)


def equal(a: Pieces, b: Pieces) -> bool:
    """Whether two values are equal at every position, compared once a run where both read one template.

    Reading a template at a position renames its variables one to one, so equal polynomials at a
    position are equal templates: the comparison is exact both ways."""
    if length(a) != length(b):
        return False
    return all(ta == tb for _, _, (ta, tb) in combine([a, b], lambda ta, tb: (ta, tb)))


def reads_run(pieces: Pieces, lid: int, positions: Sequence[int]) -> bool:
    """Whether position ``i`` holds exactly the leaf element ``(lid, positions[i])``, for every i."""
    if length(pieces) != len(positions):
        return False
    for lo, hi, template in pieces:
        if len(template) != 1:
            return False
        ((mono, coef),) = template.items()
        if coef != 1 or len(mono) != 1 or mono[0][0] != lid:
            return False
        if lo < hi and run_offset(positions, lo, hi) != mono[0][1]:
            return False
    return True


#: the most runs a formula's term table may have to be read on runs (interleaved modes have one
#: per position: those are read position by position)
MAX_TERM_RUNS = 16


def term_runs(terms) -> Optional[Pieces]:
    """A formula's per-position terms as runs on which they read at fixed offsets; None past :data:`MAX_TERM_RUNS` runs.

    Each term ``(coef, a, role, b)`` at position ``i`` pairs the anchor's index ``a`` with ``role``'s
    index ``b``; a run keeps ``(coef, a - i, role, b - i)`` constant."""
    runs: List[list] = []
    for i, lane in enumerate(terms):
        relative = tuple((c, a - i, role, b - i) for c, a, role, b in lane)
        if runs and runs[-1][2] == relative:
            runs[-1][1] = i + 1
        else:
            if len(runs) == MAX_TERM_RUNS:
                return None
            runs.append([i, i + 1, relative])
    return tuple((lo, hi, relative) for lo, hi, relative in runs)


class Positions(tuple):
    """A role's leaf positions, a tuple of ints equal to any other with the same ints, that knows its runs.

    ``runs`` are the maximal ``(lo, hi, offset)`` with ``self[k] == k + offset`` for ``lo <= k < hi``,
    in order and covering every index: :func:`run_offset` reads them in a few steps, where a plain
    tuple is compared element by element, so matching a formula along runs costs no more at a wide
    head dim. A slice of it, or a copy, is a plain tuple or knows no runs: read element by element."""

    def __new__(cls, positions=(), runs=None):
        self = super().__new__(cls, positions)
        self.runs = runs
        return self


def consecutive(start: int, n: int) -> Positions:
    """The positions ``start, start + 1, ..., start + n - 1``."""
    return Positions(range(start, start + n), ((0, n, start),) if n > 0 else ())


def _from_runs(runs) -> Positions:
    """The positions that maximal ``(lo, hi, offset)`` runs, in order and covering ``0 .. n``, say."""
    return Positions(itertools.chain.from_iterable(range(lo + off, hi + off) for lo, hi, off in runs), tuple(runs))


def is_consecutive(positions: Sequence[int], start: int, n: int) -> bool:
    """Whether ``positions`` are ``start .. start + n - 1``, that is ``tuple(range(start, start + n))``."""
    expected = range(start, start + n)
    runs = getattr(positions, "runs", None)
    if runs is not None:
        return len(positions) == len(expected) and (not expected or runs == ((0, n, start),))
    return tuple(positions) == tuple(expected)


def run_offset(positions: Sequence[int], lo: int, hi: int) -> Optional[int]:
    """``o`` when ``positions[k] == k + o`` for every ``lo <= k < hi``, else None."""
    if not 0 <= lo < hi <= len(positions):
        return None
    runs = getattr(positions, "runs", None)
    if runs is not None:  # maximal runs: [lo, hi) is inside one, or its positions change offset
        for a, b, off in runs:
            if a <= lo < b:
                return off if hi <= b else None
    o = positions[lo] - lo
    return o if tuple(positions[lo:hi]) == tuple(range(lo + o, hi + o)) else None


def read_partners(pieces: Pieces, runs: Pieces, anchor: Tuple[int, Sequence[int]], roles: Sequence[str], d: int,
                  squares: bool = True):
    """Which leaf positions play each role, read off the monomials that pair them with the anchor.

    ``runs`` are :func:`term_runs` of the formula; at each position every term's monomial must be
    the only one with the anchor's element, its other variable (the anchor's own when squared, unless
    ``squares`` is False: then no partner) the role's element. Returns ``({role: (leaf id, positions)}, {role: coefficients seen})``, or None
    when a position has no such single monomial, a role's index is read at two different positions,
    is not read at all, or reads two leaves: what reading position by position finds, found once a run."""
    # each role's indices read so far, as runs (start, end, offset): index k is the leaf's position k + offset
    assigned = {r: [] for r in roles}
    lids = {r: set() for r in roles}
    coefs = {r: set() for r in roles}
    for lo, hi, (template, terms) in combine([pieces, runs], lambda t, terms: (t, terms)):
        for c, a, role, b in terms:
            offset = run_offset(anchor[1], lo + a, hi + a)
            if offset is None:
                return None
            y = (anchor[0], offset + a)  # position i reads the anchor's index i + a: leaf position i + a + offset
            monos = [m for m in template if y in m]
            if len(monos) != 1:
                return None
            partners = [var for var in monos[0] if var != y] or ([y] if squares else [])
            if len(partners) != 1:
                return None
            (other,) = partners
            lids[role].add(other[0])
            coefs[role].add((c, template[monos[0]]))
            # indices lo + b .. hi + b read positions lo + other[1] ..: an index read before at another
            # offset is read at two different positions (overlapping runs of two offsets differ everywhere)
            new = (lo + b, hi + b, other[1] - b)
            if any(s < new[1] and new[0] < e and o != new[2] for s, e, o in assigned[role]):
                return None
            assigned[role].append(new)
    if any(len(l) != 1 for l in lids.values()):
        return None
    found = {}
    for r in roles:
        merged = _covering(assigned[r], d)
        if merged is None:  # an index no term reads
            return None
        found[r] = (next(iter(lids[r])), _from_runs(merged))
    return found, coefs


def _covering(runs, d: int):
    """Runs ``(start, end, offset)`` that agree where they overlap as maximal runs covering ``0 .. d``, or None
    when they leave an index of ``0 .. d`` unread."""
    out = []
    reached = 0
    for s, e, o in sorted(runs):
        if s > reached:
            return None
        if e <= reached:
            continue
        s = max(s, reached)
        if out and out[-1][2] == o and out[-1][1] == s:
            out[-1] = (out[-1][0], e, o)
        else:
            out.append((s, e, o))
        reached = e
    return out if reached >= d else None


def equals_formula(pieces: Pieces, runs: Pieces, anchor: Tuple[int, Sequence[int]], roles, coefficient) -> Optional[bool]:
    """Whether the value is the formula's sum at every position, compared once a run; None when a role is not read along runs.

    The formula's sum at a position: over its terms, ``coefficient(coef, role)`` times the anchor's
    element times the role's element (``roles`` maps a role to ``(leaf id, positions)``). None asks
    the caller to compare position by position. Exact both ways: equal templates on a run are equal
    polynomials at each of its positions."""
    for lo, hi, (template, terms) in combine([pieces, runs], lambda t, terms: (t, terms)):
        expected = {}
        for c, a, role, b in terms:
            y, (lid, where) = run_offset(anchor[1], lo + a, hi + a), roles[role]
            r = run_offset(where, lo + b, hi + b)
            if y is None or r is None:
                return None
            mono = tuple(sorted(((anchor[0], y + a), (lid, r + b))))
            if mono in expected:  # two terms of one monomial: ask position by position
                return None
            expected[mono] = coefficient(c, role)
        if template != expected:
            return False
    return True
