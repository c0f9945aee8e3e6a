"""The lanes domain's values: per-position polynomials (:class:`Lanes`), their arithmetic, shapes and index helpers."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from ..lowering.sizes import static_int
from . import lane_pieces
from .algebra import Number, accumulate
from .evaluator import Unsupported
from .nodes import VIEWS, aten, val, shape as node_shape


def shape(node):
    """A node's shape, complex tensors seen as their real view ``[..., n, 2]``."""
    s = node_shape(node)
    if s is not None and val(node).dtype.is_complex:
        return tuple(s) + (2,)
    return s


Var = Tuple[int, int]            # (leaf id, flattened position in the leaf's trailing axes)
Mono = Tuple[Var, ...]           # sorted product of vars; () is the constant monomial
Poly = Dict[Mono, Number]

MAX_DEGREE = 2
#: one-input ops that only move (or negate) elements: a wide factor is cut above them
MOVES_LANES = VIEWS | {aten.reshape.default, aten.neg.default}
MAX_TERMS = 8
#: whether values over one tracked axis are kept as runs of positions (:mod:`.lane_pieces`); off,
#: every value is built position by position (the tests compare the two)
RUNS = True


class Lanes:
    """A tensor value: ``inner`` are its tracked trailing sizes, ``polys`` one per position.

    A value may be given as :mod:`.lane_pieces` runs over its flat (row-major) positions instead
    (``flat``): its ``polys`` are then built from them when first read, equal to the per-position ones.
    Over one tracked axis of a real tensor those runs are also ``pieces``, which the interpreters and
    matchers compute on; over several axes (a head dim viewed as heads, a complex value's pairs) they
    only defer building the polynomials, which a value read as a leaf further on never needs."""

    __slots__ = ("inner", "_polys", "reduction", "complex", "pieces", "flat")

    def __init__(self, inner: Tuple[int, ...], polys: Optional[List[Poly]] = None, reduction: Optional[tuple] = None,
                 complex: bool = False, pieces: Optional[lane_pieces.Pieces] = None):
        self.inner = inner
        self._polys = polys
        #: for a sum over leading axes: (summand node, reduced dims, keepdim), else None
        self.reduction = reduction
        #: a complex tensor: the last tracked axis holds (real, imaginary)
        self.complex = complex
        #: the value as runs of flat positions (any tracked axes), or None
        self.flat = pieces if RUNS else None
        #: the value as runs of positions (one tracked axis of a real tensor only), or None
        self.pieces = self.flat if len(inner) == 1 and not complex else None
        if polys is None and self.flat is None:
            if pieces is None:
                raise ValueError("a lane value needs its polynomials or its runs")
            self._polys = lane_pieces.materialize(pieces)

    @property
    def polys(self) -> List[Poly]:
        if self._polys is None:
            self._polys = lane_pieces.materialize(self.flat)
        return self._polys

    def poly_at(self, i: int) -> Poly:
        """The polynomial of position ``i`` (flat), without building the others."""
        if self._polys is None:
            return lane_pieces.at(self.flat, i)
        return self._polys[i]

    def __eq__(self, other) -> bool:
        if not isinstance(other, Lanes):
            return NotImplemented
        if (self.inner, self.reduction, self.complex) != (other.inner, other.reduction, other.complex):
            return False
        if self.flat is not None and other.flat is not None:
            return lane_pieces.equal(self.flat, other.flat)
        return self.polys == other.polys

    __hash__ = None

    def lowest_position(self, lid: int) -> int:
        """The lowest position of the leaf ``lid`` that the value reads."""
        if self.flat is not None:  # a run's first position reads each of its variables' lowest
            return min(lo + p for lo, _, t in self.flat for mono in t for (l, p) in mono if l == lid)
        return min(p for poly in self.polys for mono in poly for (l, p) in mono if l == lid)

    def reads(self, lid: int, positions) -> bool:
        """Whether the value is the leaf ``lid``'s elements at ``positions``, position by position."""
        if self.flat is not None:
            return lane_pieces.reads_run(self.flat, lid, positions)
        return self.polys == [{((lid, p),): 1} for p in positions]

    def __repr__(self) -> str:
        return f"Lanes(inner={self.inner}, reduction={self.reduction}, complex={self.complex}, polys={self.polys})"

    def is_constant(self) -> bool:
        if self.flat is not None:
            return lane_pieces.is_constant(self.flat)
        return all(all(m == () for m in p) for p in self.polys)


def position_forms(v: Lanes) -> List[Poly]:
    """Polynomials standing for every position's: each run's template, else every polynomial.

    For checks of how many terms a polynomial has, their degrees, coefficients and leaf ids, never
    positions: a run renames its variables one to one at every position, so those are its positions'."""
    if v.flat is not None:
        return [t for _, _, t in v.flat]
    return v.polys


def zeros(inner) -> Lanes:
    """Zero at every position of trailing sizes ``inner``."""
    if len(inner) == 1:
        return Lanes(tuple(inner), pieces=lane_pieces.constant_pieces(0, inner[0]))
    return Lanes(tuple(inner), [{} for _ in range(math.prod(inner))])


def uniform(v: Lanes) -> bool:
    """Whether every position holds the same polynomial."""
    if v.flat is not None and lane_pieces.is_constant(v.flat):  # a constant template reads alike everywhere
        return all(t == v.flat[0][2] for _, _, t in v.flat)
    return all(p == v.polys[0] for p in v.polys)


def step_one(picks) -> bool:
    """Whether ``picks`` are a non-empty run of consecutive positions given as a range."""
    return isinstance(picks, range) and picks.step == 1 and len(picks) > 0


def _bounded(p: Poly) -> Poly:
    if len(p) > MAX_TERMS:
        raise Unsupported("too many terms")
    return p


def add_polys(a: Poly, b: Poly, scale: Number = 1) -> Poly:
    out = dict(a)
    for m, c in b.items():
        accumulate(out, m, scale * c)
    return _bounded(out)


class DegreeExceeded(Unsupported):
    """A product of degree above :data:`MAX_DEGREE`: no RoPE backward term is that wide."""


def mul_polys(a: Poly, b: Poly) -> Poly:
    out: Poly = {}
    for ma, ca in a.items():
        for mb, cb in b.items():
            m = tuple(sorted(ma + mb))
            if len(m) > MAX_DEGREE:
                raise DegreeExceeded("degree")
            accumulate(out, m, ca * cb)
    return _bounded(out)


def _strides(inner):
    strides, acc = [], 1
    for size in reversed(inner):
        strides.append(acc)
        acc *= size
    return list(reversed(strides))


def strides(inner):
    """Row-major strides of trailing sizes ``inner``."""
    return _strides(inner)


def gather(out_inner, source_strides) -> List[int]:
    """For each flat position of a tensor of trailing sizes ``out_inner`` (row-major), the flat
    position it reads: the sum over axes of its index times that axis's ``source_strides`` entry.
    Built axis by axis, so no position is decoded from its flat index one at a time."""
    flats = [0]
    for size, stride in zip(out_inner, source_strides):
        flats = [base + k * stride for base in flats for k in range(size)]
    return flats


def along_axis(inner, axis: int, picks) -> List[int]:
    """The flat positions of ``inner`` at ``picks`` along ``axis``, every other axis whole, in the
    row-major order of the tensor the picks make (axis ``axis`` of length ``len(picks)``)."""
    size, inside = inner[axis], math.prod(inner[axis + 1:])
    return [(outer * size + p) * inside + b
            for outer in range(math.prod(inner[:axis])) for p in picks for b in range(inside)]


def degree_of(v: Lanes) -> int:
    if v.flat is not None:
        return lane_pieces.max_degree(v.flat)
    return max((len(m) for p in v.polys for m in p), default=0)


def index_argument(x):
    """A slice bound; a symbolic one is fine only when it is known to be a constant."""
    if x is None or isinstance(x, int):
        return x
    s = static_int(x)
    if s is None:
        raise Unsupported("symbolic slice bound")
    return s
