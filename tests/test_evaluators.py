"""The evaluators are exact: the lane evaluator's per-position polynomials and the RMSNorm
evaluator's expressions (sums over the normalized axis as symbols), evaluated on the leaves'
values, equal the tensors the graph computes wherever they do not make a node a leaf (a leaf
is its own value). Hand-picked programs first, then random ones over each evaluator's ops."""
import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from npu_fusion.patterns.lanes import LaneEvaluator
from npu_fusion.patterns.rotation import MAX_LANES


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


def traced(program, inputs):
    """``program`` traced to ATen, its output node and every node's value on ``inputs``."""
    gm = make_fx(program, tracing_mode="fake")(*inputs)
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if isinstance(output, (list, tuple)):
        (output,) = output
    return output, node_values(gm, inputs)


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
    output, values = traced(program, inputs)
    ev = LaneEvaluator(None, max_lanes=MAX_LANES)  # RoPE's bound
    lanes = ev.value(output)
    assert lanes is not None
    expected = real_view(values[output]).reshape(-1)
    torch.testing.assert_close(lanes_value(ev, lanes, values), expected.double())


# -- random programs: the evaluator is exact on whatever it does not make a leaf ----------

from hypothesis import given, settings, strategies as st  # noqa: E402

#: expressions over 4-element vectors ``x`` and ``y``, ``{0}`` and ``{1}`` operands of the same shape
UNARY = [
    "-({0})", "({0}) * 2.0", "({0}) * -0.5", "({0}) / 4.0", "({0}) + 1.0", "({0}) - 0.25",
    "torch.cat((-({0})[2:], ({0})[:2]), -1)",                                     # rotate half
    "torch.stack((-({0})[1::2], ({0})[::2]), -1).flatten(-2)",                   # rotate pairs
    "torch.cat((({0})[::2], ({0})[1::2]), -1)",                                   # de-interleave
    "({0}).view(2, 2).transpose(0, 1).reshape(4)",
    "({0}).view(2, 2).flip(-1).reshape(4)",                                         # not in the table
    "torch.view_as_real(torch.view_as_complex(({0}).view(2, 2)).conj().resolve_conj()).flatten()",
    "torch.view_as_real(torch.view_as_complex(({0}).view(2, 2)) + 1.0).flatten()",
    "torch.view_as_real(torch.view_as_complex(({0}).view(2, 2)) * 3.0).flatten()",
    "({0}).view(2, 2).sum(-1, keepdim=True).expand(2, 2).reshape(4)",
    "torch.stack((({0})[0], ({0})[3], ({0})[1], ({0})[2]))",
]
BINARY = [
    "({0}) + ({1})", "({0}) - ({1})", "({0}) * ({1})",
    "torch.view_as_real(torch.view_as_complex(({0}).view(2, 2)) * torch.view_as_complex(({1}).view(2, 2))).flatten()",
    "torch.view_as_real(torch.view_as_complex(({0}).view(2, 2)) - torch.view_as_complex(({1}).view(2, 2))).flatten()",
    "torch.where(torch.tensor([True, False, True, False]), {0}, {1})",
]


def expressions(unary, binary, depth):
    """Programs over ``x`` and ``y`` nested ``depth`` deep: templates filled with ``format``."""
    leaf = st.sampled_from(["x", "y"])
    if depth == 0:
        return leaf
    below = expressions(unary, binary, depth - 1)
    return st.one_of(leaf, st.tuples(st.sampled_from(unary), below).map(lambda t: t[0].format(t[1])),
                     st.tuples(st.sampled_from(binary), below, below).map(lambda t: t[0].format(t[1], t[2])))


@settings(max_examples=150, deadline=None)
@given(expressions(UNARY, BINARY, 4))
def test_random_programs_evaluate_exactly(source):
    program = eval(f"lambda x, y: {source}", {"torch": torch})  # noqa: S307  (drawn from the lists above)
    inputs = [torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    output, values = traced(program, inputs)
    ev = LaneEvaluator(None, max_lanes=MAX_LANES)  # RoPE's bound
    lanes = ev.value(output)
    if lanes is None:
        return  # not a float tensor with tracked lanes: nothing to compare
    expected = real_view(values[output]).reshape(-1)
    torch.testing.assert_close(lanes_value(ev, lanes, values), expected.double(), msg=source)


# -- runs of positions (lane_pieces) are a spelling of the same values ---------------------

from npu_fusion.patterns import lane_polys  # noqa: E402
from npu_fusion.patterns.evaluator import JointProvenance, Provenance  # noqa: E402


def every_lane_value(graph, provenance, runs: bool, monkeypatch):
    """Each node's lane value (materialized polynomials), why it is opaque, and the leaves, with
    values over one axis kept as runs of positions (``runs``) or built position by position."""
    monkeypatch.setattr(lane_polys, "RUNS", runs)
    ev = LaneEvaluator(provenance, max_lanes=MAX_LANES)
    out = {}
    for node in graph.nodes:
        try:
            value = ev.value(node)
        except Exception as exc:  # what the evaluator raises must be the same either way
            out[node.name] = ("raised", type(exc).__name__)
            continue
        out[node.name] = None if value is None else (value.inner, value.polys, value.complex,
                                                     None if value.reduction is None else repr(value.reduction))
        if runs and value is not None and value.pieces is not None:
            assert len(value.inner) == 1 and not value.complex
    return out, dict(ev.unsupported), [n.name for n in ev.leaves], [(n.name, repr(e)) for n, e in ev.errors]


WIDE_UNARY = [
    "-({0})", "({0}) * 2.0", "({0}) / 4.0", "({0}) + 1.0",
    "torch.cat((-({0})[4:], ({0})[:4]), -1)",                                     # rotate half
    "torch.cat((-({0})[2:4], ({0})[:2], -({0})[6:], ({0})[4:6]), -1)",            # rotate quarters
    "torch.stack((-({0})[1::2], ({0})[::2]), -1).flatten(-2)",                   # rotate pairs
    "torch.cat((({0})[1:7], ({0})[:1], ({0})[7:]), -1)",
    "torch.nn.functional.pad(({0})[2:6], (2, 2))",
    "({0}).view(2, 4).transpose(0, 1).reshape(8)",
    "({0}).view(2, 4).sum(-1, keepdim=True).expand(2, 4).reshape(8)",
    "({0})[3:5].repeat(4)",
]
WIDE_BINARY = ["({0}) + ({1})", "({0}) - ({1})", "({0}) * ({1})",
               "torch.cat((({0})[:4], ({1})[4:]), -1) * ({1})"]


@settings(max_examples=120, deadline=None)
@given(expressions(WIDE_UNARY, WIDE_BINARY, 4))
def test_runs_of_positions_equal_the_per_position_values(source):
    """Every node of a random program over 8-wide vectors has the same value, leaves and opaque nodes
    whether the evaluator keeps values as runs of positions or builds them position by position."""
    program = eval(f"lambda x, y: {source}", {"torch": torch})  # noqa: S307  (drawn from the lists above)
    inputs = [torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    gm = make_fx(program, tracing_mode="fake")(*inputs)
    with pytest.MonkeyPatch.context() as monkeypatch:
        runs = every_lane_value(gm.graph, None, True, monkeypatch)
        positions = every_lane_value(gm.graph, None, False, monkeypatch)
    assert runs == positions, source
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    ev = LaneEvaluator(None, max_lanes=MAX_LANES)
    lanes = ev.value(output)
    if lanes is not None:  # and exact: the runs' values are the graph's
        values = node_values(gm, inputs)
        torch.testing.assert_close(lanes_value(ev, lanes, values), real_view(values[output]).reshape(-1).double(),
                                   msg=source)


@pytest.mark.parametrize("name", ["llama_fp32_backward", "llama_bf16_joint", "gptj_fp32_joint", "qwen3_bf16_joint"])
def test_runs_of_positions_on_captured_graphs(name, monkeypatch):
    """On captured training graphs (RoPE sites in half, pair and complex layouts, and everything around
    them), every node's lane value is the same with runs of positions as position by position."""
    import fx_corpus
    entry = fx_corpus.load(name)
    graph = entry.gm.graph
    if entry.forward is not None:
        provenance = Provenance(entry.forward, graph)
    else:
        from npu_fusion.plugin.joint import JointGraph
        provenance = JointProvenance(graph, JointGraph(graph).backward)
    assert every_lane_value(graph, provenance, True, monkeypatch) == \
        every_lane_value(graph, provenance, False, monkeypatch)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 3), st.integers(0, 12)), min_size=1, max_size=6))
def test_positions_known_by_runs_read_as_the_plain_tuple(assignments):
    """Indices read at runs of positions (``(start, length, position of start)``, as :func:`read_partners`
    finds them) give the positions position by position would give, or None where two runs disagree or an
    index stays unread; what knows its runs answers :func:`run_offset` as the plain tuple does."""
    from npu_fusion.patterns import lane_pieces

    d = max(start + length for start, length, _ in assignments)
    plain, runs, clash, run_clash = [None] * d, [], False, False
    for start, length, first in assignments:
        new = list(range(first, first + length))
        old = plain[start:start + length]
        clash = clash or any(p is not None and p != n for p, n in zip(old, new))
        plain[start:start + length] = new
        run = (start, start + length, first - start)
        run_clash = run_clash or any(s < run[1] and run[0] < e and o != run[2] for s, e, o in runs)
        runs.append(run)
    assert clash == run_clash
    merged = lane_pieces._covering(runs, d)
    if None in plain:
        assert merged is None
        return
    positions = lane_pieces._from_runs(merged)
    if not clash:
        assert positions == tuple(plain) and hash(positions) == hash(tuple(plain))
    for lo in range(-1, d + 1):
        for hi in range(lo, d + 2):
            if not clash:
                assert lane_pieces.run_offset(positions, lo, hi) == lane_pieces.run_offset(tuple(plain), lo, hi)
    for start in range(-1, 3):
        assert lane_pieces.is_consecutive(positions, start, d) == (tuple(positions) == tuple(range(start, start + d)))
    consecutive = lane_pieces.consecutive(3, d)
    assert consecutive == tuple(range(3, 3 + d)) and lane_pieces.is_consecutive(consecutive, 3, d)


# -- the RMSNorm evaluator: symbolic over the normalized (last) axis, sums as symbols ------

from npu_fusion.patterns.norm_algebra import NormEvaluator  # noqa: E402
from npu_fusion.patterns.rms_statistic import MAX_SYMBOLS, POLICY_LEAVES  # noqa: E402

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
#: (``[3, 1]``, positive), ``{0}`` and ``{1}`` ``[3, 4]`` operands
NORM_UNARY = [
    "-({0})", "({0}) * 2.0", "({0}) / 4.0", "({0}) ** 2", "({0}) ** 3", "({0}) * r", "({0}) / r",
    "({0}) * torch.rsqrt(({0}).pow(2).mean(-1, keepdim=True) + 1e-6)",
    "({0}) * torch.sqrt(torch.rsqrt(({0}).pow(2).mean(-1, keepdim=True) + 1e-6))",
    "({0}).sum(-1, keepdim=True).expand(3, 4)", "({0}).mean(-1, keepdim=True).expand(3, 4)",
    "({0}) * ({0}).sum(-1, keepdim=True)", "torch.sqrt(({0}) * ({0}))", "torch.reciprocal(r).expand(3, 4) * ({0})",
    "({0}).view(12).view(3, 4)", "({0}).clone()",  # (a rounding cast is an identity, its rounding tracked apart)
]
NORM_BINARY = ["({0}) + ({1})", "({0}) - ({1})", "({0}) * ({1})", "({0}) / ({1})"]


@settings(max_examples=150, deadline=None)
@given(expressions(NORM_UNARY, NORM_BINARY, 3))
def test_random_norm_programs_evaluate_exactly(source):
    program = eval(f"lambda x, y, r: {source}", {"torch": torch})  # noqa: S307  (drawn from the lists above)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(ROWS, N, dtype=torch.float64, generator=gen),
              torch.randn(ROWS, N, dtype=torch.float64, generator=gen),
              torch.rand(ROWS, 1, dtype=torch.float64, generator=gen) + 0.5]
    output, values = traced(program, inputs)
    ev = NormEvaluator((N,), None, max_symbols=MAX_SYMBOLS, policy_leaves=POLICY_LEAVES)  # RMSNorm's bounds
    value = ev.value(output)
    if value is None or value.lead_sum is not None or tuple(output.meta["val"].shape) != (ROWS, N):
        return
    expected = values[output].double()
    got = norm_value(ev, value.expr, values)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9, equal_nan=True, msg=source)
