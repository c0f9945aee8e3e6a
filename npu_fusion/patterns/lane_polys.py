"""The lanes domain's values: per-position polynomials (:class:`Lanes`), their arithmetic, shapes and index helpers."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from ..lowering.sizes import static_int
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


@dataclasses.dataclass
class Lanes:
    """A tensor value: ``inner`` are its tracked trailing sizes, ``polys`` one per position."""
    inner: Tuple[int, ...]
    polys: List[Poly]
    #: for a sum over leading axes: (summand node, reduced dims, keepdim), else None
    reduction: Optional[tuple] = None
    #: a complex tensor: the last tracked axis holds (real, imaginary)
    complex: bool = False

    def is_constant(self) -> bool:
        return all(all(m == () for m in p) for p in self.polys)


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


def index_of_position(inner, flat):
    out = []
    for stride in _strides(inner):
        out.append(flat // stride)
        flat %= stride
    return out


def position_of_index(inner, idx):
    return sum(i * s for i, s in zip(idx, _strides(inner)))


def degree_of(v: Lanes) -> int:
    return max((len(m) for p in v.polys for m in p), default=0)


def index_argument(x):
    """A slice bound; a symbolic one is fine only when it is known to be a constant."""
    if x is None or isinstance(x, int):
        return x
    s = static_int(x)
    if s is None:
        raise Unsupported("symbolic slice bound")
    return s
