"""The exact algebra of the RMSNorm matcher (patterns/algebra.py) held against sympy, an independent oracle.

Hypothesis draws random expressions over four symbols (sums, differences, products, quotients,
integer powers, square roots of single terms) and builds each twice: as an :class:`Expr` and as a
sympy expression over positive symbols. Where the algebra accepts the expression (it raises
``Unsupported`` for what it does not model), its value at random positive rationals must equal
sympy's exactly, and two expressions are equal as ``Expr`` exactly when sympy finds their
difference zero: the canonical form is sound and complete on what it accepts.
"""
from __future__ import annotations

from fractions import Fraction

import pytest

sympy = pytest.importorskip("sympy")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from npu_fusion.patterns.algebra import Expr  # noqa: E402
from npu_fusion.patterns.evaluator import Unsupported  # noqa: E402

SYMBOLS = range(4)
#: every symbol is positive here, so every fractional power the algebra may take is defined
POSITIVE = frozenset(SYMBOLS)
ORACLE_SYMBOLS = sympy.symbols("s0:4", positive=True)

leaves = st.one_of(
    st.sampled_from(SYMBOLS).map(lambda s: ("symbol", s)),
    st.fractions(min_value=-5, max_value=5, max_denominator=6).map(lambda q: ("number", q)),
)


def _extend(children):
    return st.one_of(
        st.tuples(st.sampled_from(["add", "sub", "mul", "div"]), children, children),
        st.tuples(st.just("pow"), children, st.integers(min_value=-2, max_value=4)),
        st.tuples(st.just("sqrt"), children),
    )


expressions = st.recursive(leaves, _extend, max_leaves=8)


def build(tree):
    """``(Expr, sympy expression)`` of a drawn tree; ``Unsupported`` where the algebra refuses."""
    kind = tree[0]
    if kind == "symbol":
        return Expr.symbol(tree[1]), ORACLE_SYMBOLS[tree[1]]
    if kind == "number":
        return Expr.number(tree[1]), sympy.Rational(tree[1].numerator, tree[1].denominator)
    if kind == "sqrt":
        ours, theirs = build(tree[1])
        return ours.sqrt(nonnegative=POSITIVE), sympy.sqrt(theirs)
    if kind == "pow":
        ours, theirs = build(tree[1])
        if theirs == 0 and tree[2] < 0:
            raise Unsupported("division by zero")
        return ours ** tree[2], theirs ** tree[2]
    (ours_a, theirs_a), (ours_b, theirs_b) = build(tree[1]), build(tree[2])
    if kind == "add":
        return ours_a + ours_b, theirs_a + theirs_b
    if kind == "sub":
        return ours_a - ours_b, theirs_a - theirs_b
    if kind == "mul":
        return ours_a * ours_b, theirs_a * theirs_b
    if sympy.expand(theirs_b) == 0:
        raise Unsupported("division by zero")
    return ours_a / ours_b, theirs_a / theirs_b


def accepted(tree):
    try:
        return build(tree)
    except Unsupported:
        return None


def value(expr: Expr, roots) -> Fraction:
    """``expr`` at symbol values ``roots[s] ** 4``, exactly: its exponents have denominators of 4
    at most (square roots of square roots), so every power is rational."""
    total = Fraction(0)
    for monomial, coefficient in expr.split_terms():
        term = Fraction(coefficient)
        for symbol, exponent in monomial:
            power = Fraction(exponent) * 4
            assert power.denominator == 1, f"exponent {exponent} deeper than two square roots"
            term *= roots[symbol] ** int(power)
        total += term
    return total


roots = st.lists(st.fractions(min_value=Fraction(1, 4), max_value=3, max_denominator=5).filter(bool),
                 min_size=4, max_size=4)


def shallow(tree, depth=0) -> bool:
    """At most two square roots on any path, so :func:`value` stays rational."""
    if tree[0] == "sqrt":
        return depth < 2 and shallow(tree[1], depth + 1)
    return all(shallow(child, depth) for child in tree[1:] if isinstance(child, tuple))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(expressions.filter(shallow), roots)
def test_values_equal_sympys(tree, point):
    built = accepted(tree)
    if built is None:
        return
    ours, theirs = built
    substituted = theirs.subs({s: sympy.Rational(r.numerator, r.denominator) ** 4
                               for s, r in zip(ORACLE_SYMBOLS, point)})
    expected = sympy.expand(substituted)
    assert expected.is_Rational, (tree, expected)
    assert value(ours, point) == Fraction(int(expected.p), int(expected.q)), tree


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(expressions.filter(shallow), expressions.filter(shallow))
def test_equal_exactly_when_sympy_finds_the_difference_zero(tree_a, tree_b):
    a, b = accepted(tree_a), accepted(tree_b)
    if a is None or b is None:
        return
    assert (a[0] == b[0]) == (sympy.expand(a[1] - b[1]) == 0), (tree_a, tree_b)


def test_equal_forms_of_one_value_are_one_expression():
    """The comparison above must see equal pairs too, not only unequal ones."""
    x, y = Expr.symbol(0), Expr.symbol(1)
    sx, sy = ORACLE_SYMBOLS[:2]
    pairs = [((x + y) ** 2, x * x + 2 * x * y + y * y, (sx + sy) ** 2, sx * sx + 2 * sx * sy + sy * sy),
             ((x * x * y).sqrt(nonnegative=POSITIVE), x * y.sqrt(nonnegative=POSITIVE), sympy.sqrt(sx * sx * sy),
              sx * sympy.sqrt(sy))]
    for ours_a, ours_b, theirs_a, theirs_b in pairs:
        assert ours_a == ours_b
        assert sympy.expand(theirs_a - theirs_b) == 0
