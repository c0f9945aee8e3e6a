"""The exact algebra the RMSNorm matcher evaluates nodes in (patterns/algebra.py)."""
from fractions import Fraction

import pytest

from npu_fusion.patterns.algebra import Expr
from npu_fusion.patterns.evaluator import Unsupported

x, y, r = (Expr.symbol(i) for i in (1, 2, 3))


def test_expanded_form_is_canonical():
    assert (x + y) * (x - y) == x ** 2 - y ** 2
    assert (x + y) ** 2 == x * x + 2 * x * y + y * y
    assert x * y - y * x == 0
    assert (x + y) - y == x
    assert x / 2 == Fraction(1, 2) * x
    assert x != x + 1


def test_laurent_monomials():
    assert r ** 3 * r ** -2 == r
    assert 1 / (2 * r) == Fraction(1, 2) * r ** -1
    assert (r ** 2).sqrt(nonnegative={3}) == r
    assert (x * r).sqrt(nonnegative={1, 3}) * (x * r).sqrt(nonnegative={1, 3}) == x * r


@pytest.mark.parametrize("build", [
    lambda: (x * x).sqrt(),                   # |x|, not x
    lambda: (x * y).sqrt(nonnegative={1}),    # sqrt(x)*sqrt(y) needs both non-negative
    lambda: x.power(Fraction(1, 2)),          # (x**0.5)**2 is undefined for x < 0
    lambda: (x * x).power(Fraction(-1, 2)),   # 1/|x|
], ids=["sqrt-square", "sqrt-product", "root", "rsqrt-square"])
def test_fractional_powers_need_non_negative_symbols(build):
    with pytest.raises(Unsupported):
        build()


def test_graph_constants_are_exact():
    from npu_fusion.patterns.algebra import graph_constant

    assert graph_constant(0.5) == Fraction(1, 2) and graph_constant(1 / 3) == Fraction(1, 3)
    assert graph_constant(3) == 3 and graph_constant(True) is None and graph_constant(float("inf")) is None
    near = 1 / 3 + 1e-12  # not the nearest double of any simple fraction: its own exact value
    assert graph_constant(near) == Fraction(near) != Fraction(1, 3)


def test_inspection():
    assert (x * y + r).free_symbols == {1, 2, 3}
    assert x.as_symbol() == 1 and (2 * x).as_symbol() is None and (x ** 2).as_symbol() is None
    assert Expr.number(3).is_number() and not x.is_number()


@pytest.mark.parametrize("build", [
    lambda: 1 / (x + y),           # division by a sum
    lambda: (x + y).sqrt(),        # root of a sum
    lambda: (2 * x).sqrt(),        # irrational coefficient
    lambda: (x + y) ** 5,          # large power of a sum
], ids=["div-sum", "sqrt-sum", "sqrt-2", "pow-5"])
def test_outside_the_algebra_is_unsupported(build):
    with pytest.raises(Unsupported):
        build()


def test_growth_is_bounded():
    many = sum((Expr.symbol(i) for i in range(10, 20)), Expr.number(0))
    with pytest.raises(Unsupported):
        many * many * many
