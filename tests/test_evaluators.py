"""The evaluators are exact: the lane evaluator's per-position polynomials and the RMSNorm
evaluator's expressions (sums over the normalized axis as symbols), evaluated on the leaves'
values, equal the tensors the graph computes wherever they do not make a node a leaf (a leaf
is its own value). Hand-picked programs first, then random ones over each evaluator's ops."""
import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from npu_fusion.patterns.lanes import LaneEvaluator


def real_view(t):
    return torch.view_as_real(t) if t.is_complex() else t


def lanes_value(ev, lanes, values):
    """The evaluator's value of one node, computed from the leaves' tensors (no leading axes)."""
    out = []
    for poly in lanes.polys:
        total = 0.0
        for mono, coef in poly.items():
            term = float(coef)
            for lid, position in mono:
                term *= real_view(values[ev.leaves[lid]]).reshape(-1)[position].item()
            total += term
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


def node_values(gm, inputs):
    """Every node's value in a run of ``gm``."""
    values = {}

    class Recording(fx.Interpreter):
        def run_node(self, node):
            values[node] = result = super().run_node(node)
            return result

    Recording(gm).run(*inputs)
    return values


PROGRAMS = {
    "complex plus a real constant": lambda z: torch.view_as_complex(z) + 1.5,
    "complex minus a real constant": lambda z: torch.view_as_complex(z) - 2.0,
    "complex plus a real tensor": lambda z, r: torch.view_as_complex(z) + r,
    "complex times a real constant": lambda z: torch.view_as_complex(z) * 3.0,
    "complex times complex": lambda z, w: torch.view_as_complex(z) * torch.view_as_complex(w),
    "real parts of a complex sum": lambda z, w: torch.view_as_real(torch.view_as_complex(z) + torch.view_as_complex(w)),
    "rotate half": lambda x: torch.cat((-x[2:], x[:2]), -1),
    "real plus a constant": lambda x: x + 0.5,
}
#: shapes without leading axes: every axis is tracked, so positions index the whole tensor
ARGS = {"x": (4,), "z": (2, 2), "w": (2, 2), "r": (2,)}


@pytest.mark.parametrize("name", PROGRAMS)
def test_lane_values_equal_what_the_graph_computes(name):
    program = PROGRAMS[name]
    names = program.__code__.co_varnames[:program.__code__.co_argcount]
    inputs = [torch.randn(ARGS[n], dtype=torch.float64, generator=torch.Generator().manual_seed(i))
              for i, n in enumerate(names)]
    gm = make_fx(program, tracing_mode="fake")(*inputs)
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    ev = LaneEvaluator(None)
    lanes = ev.value(output)
    assert lanes is not None
    values = node_values(gm, inputs)
    expected = real_view(values[output]).reshape(-1)
    torch.testing.assert_close(lanes_value(ev, lanes, values), expected.double())


# -- random programs: the evaluator is exact on whatever it does not make a leaf ----------

from hypothesis import given, settings, strategies as st  # noqa: E402

#: expressions over 4-element vectors ``x`` and ``y``, each ``{}`` an operand of the same shape
UNARY = [
    "-({})", "({}) * 2.0", "({}) * -0.5", "({}) / 4.0", "({}) + 1.0", "({}) - 0.25",
    "torch.cat((-({0})[2:], ({0})[:2]), -1)",                                     # rotate half
    "torch.stack((-({0})[1::2], ({0})[::2]), -1).flatten(-2)",                   # rotate pairs
    "torch.cat((({0})[::2], ({0})[1::2]), -1)",                                   # de-interleave
    "({}).view(2, 2).transpose(0, 1).reshape(4)",
    "({}).view(2, 2).flip(-1).reshape(4)",                                         # not in the table
    "torch.view_as_real(torch.view_as_complex(({}).view(2, 2)).conj().resolve_conj()).flatten()",
    "torch.view_as_real(torch.view_as_complex(({}).view(2, 2)) + 1.0).flatten()",
    "torch.view_as_real(torch.view_as_complex(({}).view(2, 2)) * 3.0).flatten()",
    "({}).view(2, 2).sum(-1, keepdim=True).expand(2, 2).reshape(4)",
    "torch.stack((({0})[0], ({0})[3], ({0})[1], ({0})[2]))",
]
BINARY = [
    "({}) + ({})", "({}) - ({})", "({}) * ({})",
    "torch.view_as_real(torch.view_as_complex(({}).view(2, 2)) * torch.view_as_complex(({}).view(2, 2))).flatten()",
    "torch.view_as_real(torch.view_as_complex(({}).view(2, 2)) - torch.view_as_complex(({}).view(2, 2))).flatten()",
    "torch.where(torch.tensor([True, False, True, False]), {}, {})",
]


def expressions(depth):
    leaf = st.sampled_from(["x", "y"])
    if depth == 0:
        return leaf
    below = expressions(depth - 1)
    unary = st.tuples(st.sampled_from(UNARY), below).map(lambda t: t[0].format(t[1]))
    binary = st.tuples(st.sampled_from(BINARY), below, below).map(lambda t: t[0].format(t[1], t[2]))
    return st.one_of(leaf, unary, binary)


@settings(max_examples=150, deadline=None)
@given(expressions(4))
def test_random_programs_evaluate_exactly(source):
    program = eval(f"lambda x, y: {source}", {"torch": torch})  # noqa: S307  (drawn from the lists above)
    inputs = [torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    gm = make_fx(program, tracing_mode="fake")(*inputs)
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if isinstance(output, (list, tuple)):
        (output,) = output
    ev = LaneEvaluator(None)
    lanes = ev.value(output)
    if lanes is None:
        return  # not a float tensor with tracked lanes: nothing to compare
    values = node_values(gm, inputs)
    expected = real_view(values[output]).reshape(-1)
    torch.testing.assert_close(lanes_value(ev, lanes, values), expected.double(), msg=source)


# -- the RMSNorm evaluator: symbolic over the normalized (last) axis, sums as symbols ------

from npu_fusion.patterns.rms_norm import NormEvaluator  # noqa: E402

ROWS, N = 3, 4


def symbol_value(ev, sym, values):
    """A symbol's tensor: a leaf's value, or a sum over the normalized axis of its body."""
    if sym in ev.node_of:
        return values[ev.node_of[sym]].double()
    body = ev.sum_body[sym]
    product = torch.ones(ROWS, N, dtype=torch.float64)
    for s, e in body:
        product = product * symbol_value(ev, s, values) ** float(e)
    return product.sum(-1, keepdim=True)


def norm_value(ev, expr, values):
    total = torch.zeros(ROWS, N, dtype=torch.float64)
    for mono, coef in expr.split_terms():
        term = torch.full((ROWS, N), float(coef), dtype=torch.float64)
        for s, e in mono:
            term = term * symbol_value(ev, s, values) ** float(e)
        total = total + term
    return total


#: expressions over ``x`` and ``y`` (``[3, 4]``, normalized over the last axis) and ``r``
#: (``[3, 1]``, positive), each ``{}`` a ``[3, 4]`` operand
NORM_UNARY = [
    "-({})", "({}) * 2.0", "({}) / 4.0", "({}) ** 2", "({}) ** 3", "({}) * r", "({}) / r",
    "({}) * torch.rsqrt(({0}).pow(2).mean(-1, keepdim=True) + 1e-6)",
    "({}) * torch.sqrt(torch.rsqrt(({0}).pow(2).mean(-1, keepdim=True) + 1e-6))",
    "({}).sum(-1, keepdim=True).expand(3, 4)", "({}).mean(-1, keepdim=True).expand(3, 4)",
    "({}) * ({}).sum(-1, keepdim=True)", "torch.sqrt(({}) * ({}))", "torch.reciprocal(r).expand(3, 4) * ({})",
    "({}).view(12).view(3, 4)", "({}).clone()",  # (a rounding cast is an identity, its rounding tracked apart)
]
NORM_BINARY = ["({}) + ({})", "({}) - ({})", "({}) * ({})", "({}) / ({})"]


def norm_expressions(depth):
    leaf = st.sampled_from(["x", "y"])
    if depth == 0:
        return leaf
    below = norm_expressions(depth - 1)
    unary = st.tuples(st.sampled_from(NORM_UNARY), below).map(lambda t: t[0].replace("{0}", t[1]).format(t[1], t[1]))
    binary = st.tuples(st.sampled_from(NORM_BINARY), below, below).map(lambda t: t[0].format(t[1], t[2]))
    return st.one_of(leaf, unary, binary)


@settings(max_examples=150, deadline=None)
@given(norm_expressions(3))
def test_random_norm_programs_evaluate_exactly(source):
    program = eval(f"lambda x, y, r: {source}", {"torch": torch})  # noqa: S307  (drawn from the lists above)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(ROWS, N, dtype=torch.float64, generator=gen),
              torch.randn(ROWS, N, dtype=torch.float64, generator=gen),
              torch.rand(ROWS, 1, dtype=torch.float64, generator=gen) + 0.5]
    gm = make_fx(program, tracing_mode="fake")(*inputs)
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if isinstance(output, (list, tuple)):
        (output,) = output
    ev = NormEvaluator((N,), None)
    value = ev.value(output)
    if value is None or value.lead_sum is not None or tuple(output.meta["val"].shape) != (ROWS, N):
        return
    values = node_values(gm, inputs)
    expected = values[output].double()
    got = norm_value(ev, value.expr, values)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9, equal_nan=True, msg=source)
