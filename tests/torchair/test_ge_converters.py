"""The fused ops' GE converters, through torchair's real graph construction."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import npu_fusion  # noqa: F401  (registers torch.ops.npu_fusion)
from npu_fusion.lowering import FUSED_OPS
from npu_fusion_testing.torchair import cann_stub

ROPE = torch.ops.npu_fusion.rotary_position_embedding_grad
RMS = torch.ops.npu_fusion.rms_norm_grad


def rope_inputs(dtype, b=2, s=16, n=4, d=64):
    """BSND dy and x, 1S1D cos/sin (valid for every mode and target)."""
    torch.manual_seed(0)
    dy, x = torch.randn(b, s, n, d, dtype=dtype), torch.randn(b, s, n, d, dtype=dtype)
    cos, sin = torch.randn(1, s, 1, d, dtype=dtype), torch.randn(1, s, 1, d, dtype=dtype)
    return dy, cos, sin, x


def rms_inputs(dtype, gamma_dtype, keepdim=True, shape=(4, 16, 64)):
    torch.manual_seed(0)
    dy, x = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    lead = shape[:-1]
    rstd = torch.rand(lead + ((1,) if keepdim else ()), dtype=torch.float32) + 0.5
    return dy, x, rstd, torch.randn(shape[-1:], dtype=gamma_dtype)


def mode_attr(graph, op):
    """torchair omits an attribute equal to the IR default; GE then applies mode=0."""
    return graph.attrs(op).get("mode", 0)


def compat_queries(op_type):
    return [args for name, args in cann_stub.CALLS if name == "check_cann_compat" and args[0] == op_type]


# -- RotaryPositionEmbeddingGrad ----------------------------------------------

@pytest.mark.parametrize("mode,dtype", [(0, torch.float32), (1, torch.float16), (2, torch.bfloat16),
                                        (3, torch.float32)])
def test_rope_grad_becomes_one_ge_op_with_mode(ge, mode, dtype):
    def f(dy, cos, sin, x):
        return ROPE(dy, cos, sin, x, mode)

    args = rope_inputs(dtype)
    got = ge.compile(f)(*args)
    for a, b in zip(got, f(*args)):  # run eagerly: the reference kernel
        torch.testing.assert_close(a, b)

    g = ge.graph()
    op = g.one("RotaryPositionEmbeddingGrad")
    assert g.input_names(op) == ["dy", "cos", "sin", "x"]
    assert [g.source_index(op, name) for name in ("dy", "cos", "sin", "x")] == [0, 1, 2, 3]
    assert mode_attr(g, op) == mode
    assert ("mode" in g.attrs(op)) == (mode != 0)
    assert g.output_names(op) == ["dx", "dcos", "dsin"]
    assert [g.output_dtype(op, i) for i in range(3)] == [dtype] * 3
    # the three graph outputs are the op's three outputs, nothing recomputed around it
    assert [(o.name, i) for o, i in g.net_outputs()] == [(op.name, 0), (op.name, 1), (op.name, 2)]
    assert set(g.types()) <= {"Data", "RotaryPositionEmbeddingGrad", "NetOutput"}
    # torchair asked (the stubbed) CANN whether it supports the optional input x and, off default, mode
    assert compat_queries("RotaryPositionEmbeddingGrad") == [
        ("RotaryPositionEmbeddingGrad", ("x",), ("mode",) if mode else ())]


@pytest.mark.parametrize("mode", [0, 1])
def test_rope_grad_without_x_leaves_x_unfed(ge, mode):
    def f(dy, cos, sin):
        return ROPE(dy, cos, sin, None, mode)

    dy, cos, sin, _ = rope_inputs(torch.float16)
    dx, dcos, dsin = ge.compile(f)(dy, cos, sin)
    assert dcos.shape == dsin.shape == (0,) and dcos.dtype == torch.float16

    g = ge.graph()
    op = g.one("RotaryPositionEmbeddingGrad")
    assert g.input_names(op) == ["dy", "cos", "sin"]
    assert len(g.data_inputs(op)) == 3
    assert [g.source_index(op, i) for i in range(3)] == [0, 1, 2]
    assert mode_attr(g, op) == mode
    assert compat_queries("RotaryPositionEmbeddingGrad") == [
        ("RotaryPositionEmbeddingGrad", (), ("mode",) if mode else ())]
    # dx from the op; dcos/dsin are empty [0] tensors of dy's dtype, not GE's unwritten outputs
    (dx_op, dx_idx), (dcos_op, _), (dsin_op, _) = g.net_outputs()
    assert (dx_op.name, dx_idx) == (op.name, 0)
    assert g.consumers(op, 1) == [] and g.consumers(op, 2) == []
    for fill in (dcos_op, dsin_op):
        assert fill.type == "Fill"
        dims, _ = g.producer(fill, "dims")
        assert g.const_value(dims).tolist() == [0]
        assert g.output_dtype(fill) == torch.float16
    assert dcos_op.name != dsin_op.name


def test_rope_grad_broadcast_layouts(ge):
    """BNSD dy with B1SD cos/sin and a graph with two sites (q and k)."""
    def f(dq, dk, cos, sin, q, k):
        return ROPE(dq, cos, sin, q, 0)[0], ROPE(dk, cos, sin, k, 1)[0]

    torch.manual_seed(0)
    dq, dk, q, k = (torch.randn(2, 4, 16, 32) for _ in range(4))
    cos, sin = torch.randn(2, 1, 16, 32), torch.randn(2, 1, 16, 32)
    ge.compile(f)(dq, dk, cos, sin, q, k)
    g = ge.graph()
    ops = g.of_type("RotaryPositionEmbeddingGrad")
    assert len(ops) == 2
    assert sorted(mode_attr(g, op) for op in ops) == [0, 1]
    for op in ops:
        assert g.input_shape(op, "cos") == [2, 1, 16, 32]
        assert g.input_shape(op, "dy") == [2, 4, 16, 32]


# -- RmsNormGrad --------------------------------------------------------------

# every dtype combination's node is held to the wheel's IR by tests/test_op_conformance.py; here,
# compiled through torchair, one combination with each rstd form
@pytest.mark.parametrize("dtype,gamma_dtype,keepdim", [
    (torch.float16, torch.float32, True),
    (torch.bfloat16, torch.bfloat16, False),
])
def test_rms_norm_grad_is_one_ge_op_rstd_before_gamma(ge, dtype, gamma_dtype, keepdim):
    def f(dy, x, rstd, gamma):
        return RMS(dy, x, rstd, gamma)

    args = rms_inputs(dtype, gamma_dtype, keepdim)
    got = ge.compile(f)(*args)
    for a, b in zip(got, f(*args)):
        torch.testing.assert_close(a, b)

    g = ge.graph()
    op = g.one("RmsNormGrad")
    # GE's order is (dy, x, rstd, gamma); the FX op's arguments are in the same order
    assert g.input_names(op) == ["dy", "x", "rstd", "gamma"]
    assert [g.source_index(op, name) for name in ("dy", "x", "rstd", "gamma")] == [0, 1, 2, 3]
    assert g.input_dtype(op, "rstd") == torch.float32
    assert g.input_dtype(op, "gamma") == gamma_dtype
    assert g.input_shape(op, "rstd") == ([4, 16, 1] if keepdim else [4, 16])
    assert g.output_names(op) == ["dx", "dgamma"]
    assert g.output_dtype(op, 0) == dtype
    assert g.output_dtype(op, 1) == torch.float32
    assert "Cast" not in g.types()  # GE already yields the declared dtypes
    (dx_op, dx_idx), (dg_op, dg_idx) = g.net_outputs()
    assert [(dx_op.name, dx_idx), (dg_op.name, dg_idx)] == [(op.name, 0), (op.name, 1)]
    out = g.one("NetOutput")
    assert [g.input_dtype(out, i) for i in range(2)] == [dtype, torch.float32]


def test_rms_norm_grad_over_two_axes(ge):
    def f(dy, x, rstd, gamma):
        return RMS(dy, x, rstd, gamma)

    dy, x = torch.randn(4, 8, 32), torch.randn(4, 8, 32)
    ge.compile(f)(dy, x, torch.rand(4, 1, 1), torch.randn(8, 32))
    g = ge.graph()
    op = g.one("RmsNormGrad")
    assert g.input_shape(op, "gamma") == [8, 32]
    assert g.input_shape(op, "rstd") == [4, 1, 1]


# -- dynamic shapes -----------------------------------------------------------

def test_dynamic_shapes(ge):
    """Batch and sequence symbolic, head count and D static: one GE graph serves both shapes."""
    def f(dy, cos, sin, x, gdy, gx, rstd, gamma):
        return ROPE(dy, cos, sin, x, 1), RMS(gdy, gx, rstd, gamma)

    compiled = ge.compile(f, dynamic=None)
    for b, s in ((2, 16), (3, 8)):
        dy, cos, sin, x = rope_inputs(torch.float16, b=b, s=s)
        gdy, gx, rstd, gamma = rms_inputs(torch.bfloat16, torch.float32, shape=(b, s, 64))
        for t in (dy, x, gdy, gx, rstd):
            torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(t, 1)
        for t in (cos, sin):
            torch._dynamo.mark_dynamic(t, 1)
        outs = compiled(dy, cos, sin, x, gdy, gx, rstd, gamma)
        assert outs[0][0].shape == (b, s, 4, 64) and outs[1][0].shape == (b, s, 64)
    graphs = ge.graphs()
    assert len(graphs) == 1, "the second shape must reuse the symbolic graph"
    g = graphs[0]
    rope, rms = g.one("RotaryPositionEmbeddingGrad"), g.one("RmsNormGrad")
    assert g.input_shape(rope, "dy") == [-1, -1, 4, 64]
    assert g.input_shape(rope, "x") == [-1, -1, 4, 64]
    assert g.input_shape(rope, "cos") == [1, -1, 1, 64]
    assert g.input_shape(rms, "dy") == [-1, -1, 64]
    assert g.input_shape(rms, "rstd") == [-1, -1, 1]
    assert g.input_shape(rms, "gamma") == [64]
    assert [g.output_dtype(rms, i) for i in range(2)] == [torch.bfloat16, torch.float32]
    assert re.search(r"Size\(\[s\d+, s\d+, 4, 64\]\)", g.output_meta_shape(rope, 0))


def test_graph_handed_to_ge(ge):
    """Without run_eagerly torchair loads the GE graph into GE (the stub) and would run it."""
    def f(dy, x, rstd, gamma, dq, cos, sin):
        return RMS(dy, x, rstd, gamma), ROPE(dq, cos, sin, None, 0)[0]

    dq, cos, sin, _ = rope_inputs(torch.float32)
    with pytest.raises(cann_stub.CannUnavailableError):
        ge.compile(f, config=ge.config(run_eagerly=False), dynamic=True)(
            *rms_inputs(torch.float16, torch.float32), dq, cos, sin)
    (loaded,) = ge.loaded()
    rms = loaded.one("RmsNormGrad")
    assert loaded.input_names(rms) == ["dy", "x", "rstd", "gamma"]
    rope = loaded.one("RotaryPositionEmbeddingGrad")
    assert loaded.input_names(rope) == ["dy", "cos", "sin"]
    # torchair's final pass records the IR input names GE matches optional inputs by
    assert [s.decode() for s in rope.attr["_input_name_key"].list.s] == ["dy", "cos", "sin"]
    # the graph-level output dtypes torchair tells GE: dx fp16, dgamma fp32, rope dx fp32
    from torchair.ge import DataType

    assert list(loaded.graph.attr["_output_dtypes"].list.i) == [
        DataType.DT_FLOAT16, DataType.DT_FLOAT, DataType.DT_FLOAT]
    assert ("compile", (loaded.name,)) in cann_stub.CALLS


# -- declarations and builders ------------------------------------------------

def _declared():
    from torchair._ge_concrete_graph.fx2ge_converter import _declare_supported_converters

    return _declare_supported_converters()


def _materialize(arg):
    from torchair._ge_concrete_graph.supported_declaration import _TypedTensor

    if isinstance(arg, _TypedTensor):
        return (torch.rand(arg.dims, dtype=torch.float32) + 0.5).to(arg.dtype)
    return arg


@pytest.mark.parametrize("fused", FUSED_OPS, ids=lambda op: op.name)
def test_declared_supported_cases_compile(torchair, tmp_path, fused):
    """Each ``Support`` case declared for a converter builds its GE op, as torchair's converter tests do."""
    from npu_fusion_testing.torchair.ge_graph_view import GeCapture

    op, ge_type = fused.overload, fused.ge_op
    converter = _declared()[op]
    assert converter.supported_cases
    for number, case in enumerate(converter.supported_cases):
        torch._dynamo.reset()
        capture = GeCapture(torchair, tmp_path / f"case{number}")
        args = [_materialize(a) for a in case.args]
        capture.compile(lambda *a: op(*a, **case.kwargs))(*args)
        g = capture.graph()
        fused = g.one(ge_type)
        assert g.output_dtype(fused, 0) == args[0].dtype, str(case)


@pytest.mark.parametrize("op", FUSED_OPS, ids=lambda op: op.name)
def test_own_builders_match_torchair_generated(torchair, op):
    """The builder written from each op's declared IR builds what torchair's generated one does."""
    from torchair._ge_concrete_graph import ge_apis as ge
    from torchair.ge import DataType
    from torchair.ge._ge_graph import GeGraph

    from npu_fusion.lowering.ge_converters.builders import ir_builder

    def build(builder):
        with GeGraph(name="builders") as graph:
            data = [ge.Data(index=i, dtype=DataType.DT_FLOAT, shape=[2, 8, 4, 16], placement="CPU")
                    for i in range(len(op.ge.inputs))]
            required = data[:len(op.ge.required())]
            optional = {item.name: d for item, d in zip(op.ge.optional(), data[len(required):])}
            attrs = {a.name: {"Int": 1, "Float": 0.5}[a.kind] for a in op.ge.attrs}
            builder(*required, **optional, **attrs)
        return [(n.type, list(n.input), [d.name for d in n.input_desc], dict(n.attr),
                 [d.name for d in n.output_desc]) for n in graph.op if n.type != "Data"]

    assert build(ir_builder(op.ge)) == build(getattr(ge, op.ge.op))


def test_cast_to_declared_dtype(torchair):
    """The converter's dtype guard: a GE output of another dtype than declared gets a Cast."""
    from torchair._ge_concrete_graph import ge_apis as ge
    from torchair.ge import DataType
    from torchair.ge._ge_graph import GeGraph

    from npu_fusion.lowering.ge_converters.builders import as_dtype as _as_dtype

    with GeGraph(name="casts") as graph:
        t = ge.Data(index=0, dtype=DataType.DT_FLOAT, shape=[4], placement="CPU")
        assert _as_dtype(t, DataType.DT_FLOAT, DataType.DT_FLOAT) is t
        cast = _as_dtype(t, DataType.DT_FLOAT, DataType.DT_FLOAT16)
    assert [op.type for op in graph.op] == ["Data", "Cast"]
    assert cast.node.attr["dst_type"].i == DataType.DT_FLOAT16


def test_import_without_or_with_broken_torchair(tmp_path):
    """``import npu_fusion`` never fails because of torchair: absent, or present but unimportable."""
    broken = tmp_path / "broken" / "torchair"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('no CANN here')\n")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = textwrap.dedent("""
        import npu_fusion, npu_fusion.lowering as lowering
        print(lowering.GE_CONVERTERS)
    """)
    for extra in ([], [str(broken.parent)]):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo] + extra))
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "False"
