"""Exact Laurent polynomials over numbered symbols, kept expanded.

The RMSNorm matcher needs just this much algebra: sums and products of leaves
with rational coefficients, integer powers (``rstd**3``, ``1/x``), fractional
powers of a single term whose symbols are known non-negative (``sqrt(rstd)``),
and equality. Values are kept in expanded,
canonical form, so equality is dictionary equality and no ``expand`` step is
needed. A general computer algebra system does the same symbolically at many
times the cost, and the pass evaluates thousands of nodes per graph.

Every rewrite rule holds for all real values where the original expression is
defined: ``(a*b)**n == a**n * b**n`` and ``(a**m)**n == a**(m*n)`` for integers,
but for a fractional ``q`` only when every factor is non-negative (``(x*x)**0.5``
is ``|x|``, not ``x``; ``(x**0.5)**2`` is undefined for negative ``x``). So a
fractional power is taken only of a term whose symbols the caller vouches for.

What falls outside (a power of a sum other than a small positive integer, a
division by a sum, an irrational coefficient, a fractional power of a symbol
not known to be non-negative) raises :class:`Unsupported`; the evaluator then
treats the node as an opaque leaf, which is always sound.
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import AbstractSet, Dict, FrozenSet, Iterator, Optional, Tuple, Union

from .evaluator import Unsupported

Number = Union[int, Fraction]  # integral values are ints: they hash and multiply faster
Monomial = Tuple[Tuple[int, Number], ...]  # sorted (symbol, nonzero exponent) pairs; () is 1

#: expanded forms larger than this are not RMSNorm algebra: give up rather than grow
MAX_TERMS = 64
MAX_INTEGER_POWER = 4


def exact_number(q) -> Number:
    """A rational as a :data:`Number` (an int when integral)."""
    q = Fraction(q)
    return q.numerator if q.denominator == 1 else q


#: a float constant stands for a fraction with a denominator up to this when it is that
#: fraction correctly rounded (``1/3`` written as ``0.333...``); else for its exact value
SIMPLE_DENOMINATOR = 1 << 20


def graph_constant(x) -> Optional[Number]:
    """A scalar argument of a graph node as an exact rational, or None if it is not a
    real number. A float is read as the simple fraction it is the nearest double of,
    which is exactly what the program means by ``1/N``; any other float as its own exact
    binary value, so no tolerance is ever involved in an equality. Anything else is None
    before the cache sees it: a symbolic size (``SymInt``, ``SymFloat``) is unhashable."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return _number_constant(x)


@functools.lru_cache(maxsize=4096, typed=True)  # True is not 1
def _number_constant(x) -> Optional[Number]:
    """:func:`graph_constant` of a plain int or float (cached)."""
    if isinstance(x, int):
        return x
    if not math.isfinite(x):
        return None
    simple = Fraction(x).limit_denominator(SIMPLE_DENOMINATOR)
    return exact_number(simple if float(simple) == x else Fraction(x))


def accumulate(totals: dict, key, amount: Number) -> None:
    """``totals[key] += amount``, dropping the key when the total is zero."""
    total = totals.get(key, 0) + amount
    if total:
        totals[key] = total
    else:
        totals.pop(key, None)


def _mono_mul(a: Monomial, b: Monomial) -> Monomial:
    if not a:
        return b
    if not b:
        return a
    exps = dict(a)
    for s, e in b:
        accumulate(exps, s, e)
    return tuple(sorted(exps.items()))


class Expr:
    """An expanded Laurent polynomial: ``{monomial: coefficient}`` with no zero coefficients."""

    __slots__ = ("terms", "_hash")

    def __init__(self, terms: Dict[Monomial, Number]):
        if len(terms) > MAX_TERMS:
            raise Unsupported("expression too large")
        self.terms = terms
        self._hash = None

    @staticmethod
    def number(c) -> "Expr":
        c = exact_number(c)
        return Expr({(): c} if c else {})

    @staticmethod
    def symbol(s: int) -> "Expr":
        return Expr({((s, 1),): 1})

    # -- inspection --------------------------------------------------------
    @property
    def free_symbols(self) -> FrozenSet[int]:
        return frozenset(s for mono in self.terms for s, _ in mono)

    def is_number(self) -> bool:
        return all(not mono for mono in self.terms)

    def as_symbol(self) -> Optional[int]:
        """The symbol, when the expression is exactly one symbol."""
        if len(self.terms) == 1:
            (mono, coef), = self.terms.items()
            if coef == 1 and len(mono) == 1 and mono[0][1] == 1:
                return mono[0][0]
        return None

    def split_terms(self) -> Iterator[Tuple[Monomial, Number]]:
        return iter(self.terms.items())

    # -- arithmetic --------------------------------------------------------
    @staticmethod
    def _coerce(other) -> "Expr":
        return other if isinstance(other, Expr) else Expr.number(other)

    def __add__(self, other) -> "Expr":
        other = Expr._coerce(other)
        out = dict(self.terms)
        for mono, c in other.terms.items():
            accumulate(out, mono, c)
        return Expr(out)

    __radd__ = __add__

    def __neg__(self) -> "Expr":
        return Expr({m: -c for m, c in self.terms.items()})

    def __sub__(self, other) -> "Expr":
        return self + (-Expr._coerce(other))

    def __rsub__(self, other) -> "Expr":
        return Expr._coerce(other) + (-self)

    def __mul__(self, other) -> "Expr":
        other = Expr._coerce(other)
        out: Dict[Monomial, Number] = {}
        for ma, ca in self.terms.items():
            for mb, cb in other.terms.items():
                accumulate(out, _mono_mul(ma, mb), ca * cb)
        return Expr(out)

    __rmul__ = __mul__

    def __truediv__(self, other) -> "Expr":
        return self * (Expr._coerce(other) ** -1)

    def __rtruediv__(self, other) -> "Expr":
        return Expr._coerce(other) * (self ** -1)

    def __pow__(self, q) -> "Expr":
        return self.power(q)

    def power(self, q, nonnegative: AbstractSet[int] = frozenset()) -> "Expr":
        """``self ** q``; a fractional ``q`` needs every symbol of the (single) term in
        ``nonnegative``, the symbols known to be >= 0 (or NaN) for every input."""
        q = exact_number(q)
        if q == 0:
            return Expr.number(1)
        integral = isinstance(q, int)
        if len(self.terms) == 1:  # c * m  ->  c**q * m**q, when c**q is rational
            (mono, coef), = self.terms.items()
            if not integral and coef != 1:
                raise Unsupported("irrational coefficient")
            if not integral and any(s not in nonnegative for s, _ in mono):
                raise Unsupported("fractional power of a value that may be negative")
            coef = exact_number(Fraction(coef) ** q) if integral else coef
            return Expr({tuple((s, exact_number(e * q)) for s, e in mono): coef})
        if not self.terms:
            if q < 0:
                raise Unsupported("division by zero")
            return Expr({})
        if not integral or not 0 < q <= MAX_INTEGER_POWER:
            raise Unsupported("power of a sum")
        out = self
        for _ in range(int(q) - 1):
            out = out * self
        return out

    def sqrt(self, nonnegative: AbstractSet[int] = frozenset()) -> "Expr":
        return self.power(Fraction(1, 2), nonnegative)

    # -- comparison --------------------------------------------------------
    def __eq__(self, other) -> bool:
        if not isinstance(other, Expr):
            other = Expr._coerce(other) if isinstance(other, (int, Fraction)) else None
        return other is not None and self.terms == other.terms

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self.terms.items()))
        return self._hash

    def __repr__(self) -> str:
        if not self.terms:
            return "0"
        parts = []
        for mono, c in self.terms.items():
            factors = [f"s{s}" + (f"**{e}" if e != 1 else "") for s, e in mono]
            parts.append("*".join(([str(c)] if c != 1 or not factors else []) + factors))
        return " + ".join(parts)
