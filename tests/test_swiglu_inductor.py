"""SwiGLU through ``npu_fusion.install_inductor``: Inductor's table decomposes ``silu`` and
``silu_backward`` before its joint passes, the pass recomposes exactly those decompositions, and
Phi-3's MLP fuses both ways (outputs and gradients by the float64 criterion); a near miss
compiles unfused, right, with one recorded miss per fused op."""
import pytest
import torch
import torch.nn.functional as F

import npu_fusion
from npu_fusion.compat import no_compile_caches
from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_grads, float64_output, run_grads
from npu_fusion.plugin.inductor import uninstall_inductor
from npu_fusion_testing.aliasing import views_checked
from npu_fusion.plugin.pass_manager import HISTORY

from test_swiglu import BACKWARD, FORWARD, H, ON, Phi3Mlp


@pytest.fixture
def installed():
    """The pass installed with SwiGLU on, and the compile caches off (a hit skips the pass)."""
    npu_fusion.install_inductor(target="generic", **ON)
    torch._dynamo.reset()
    with no_compile_caches(), views_checked() as unaliased:
        yield
    assert all(views == [] for views in unaliased), unaliased  # the pass's views alias their inputs
    uninstall_inductor()
    torch._dynamo.reset()


class SwappedPhi3Mlp(Phi3Mlp):
    """Phi-3's MLP with the halves swapped: silu gates the second half (a near miss)."""

    def forward(self, x):
        up_states, gate = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up_states * F.silu(gate))


def _compiled_check(mlp, dtype):
    """Compile ``mlp`` with Inductor; its output and gradients pass the float64 criterion. Returns the pass's joint result."""
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    params = list(mlp.parameters())
    mark = HISTORY.mark()
    compiled = torch.compile(mlp)  # backend="inductor"
    with torch.no_grad():
        got, eager, exact = compiled(x), mlp(x), float64_output(mlp, [x], params)
    assert got.dtype == eager.dtype and got.shape == eager.shape
    assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)
    fused, grad_outputs = run_grads(compiled, [x], params)
    unfused, _ = run_grads(mlp, [x], params, grad_outputs)
    for f, e, w in zip(fused, unfused, float64_grads(mlp, [x], params, grad_outputs)):
        assert f.dtype == e.dtype and f.shape == e.shape
        assert_close_as_unfused(f, e, w, factor=MODEL_FACTOR)
    results = HISTORY.since(mark)
    (joint,) = [r for r in results if r.graph == "joint"]
    (inference,) = [r for r in results if r.graph == "inference"]
    return joint, inference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_phi3_mlp_fuses_both_ways_through_inductor(installed, dtype):
    joint, inference = _compiled_check(Phi3Mlp(dtype), dtype)
    assert (joint.fused(FORWARD), joint.fused(BACKWARD)) == (1, 1), joint.misses
    assert inference.fused(FORWARD) == 1 and not joint.misses and not inference.misses


def test_swapped_halves_compile_unfused_and_right_through_inductor(installed):
    joint, _ = _compiled_check(SwappedPhi3Mlp(torch.bfloat16), torch.bfloat16)
    assert (joint.fused(FORWARD), joint.fused(BACKWARD)) == (0, 0)
    for op in (FORWARD, BACKWARD):
        misses = [m for m in joint.misses if m.op == op]
        assert len(misses) == 1 and "silu gates the second half" in misses[0].reason, joint.misses


class LlamaMlp(Phi3Mlp):
    """Llama's MLP: a gate and an up of two projections, no site; its SiLU is put back and decomposed again."""

    def forward(self, x):
        gate, up_states = self.gate_up_proj(x)[..., :H], self.gate_up_proj(x * 2)[..., H:]
        return self.down_proj(up_states * F.silu(gate))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_outside_a_site_compiles_and_stays_right_through_inductor(installed, dtype):
    joint, inference = _compiled_check(LlamaMlp(dtype), dtype)
    assert (joint.fused(FORWARD), joint.fused(BACKWARD), inference.fused(FORWARD)) == (0, 0, 0)
    assert not joint.misses and not inference.misses


def test_phi3_mlp_fuses_under_dynamic_shapes_through_inductor(installed):
    """``dynamic=True`` (symbolic batch and sequence): one graph for two shapes, fused both ways and right."""
    mlp = Phi3Mlp(torch.bfloat16)
    params, mark = list(mlp.parameters()), HISTORY.mark()
    compiled = torch.compile(mlp, dynamic=True)
    for seed, lead in enumerate(((2, 3), (4, 5))):
        x = torch.randn(*lead, 16, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).requires_grad_()
        fused, grad_outputs = run_grads(compiled, [x], params)
        unfused, _ = run_grads(mlp, [x], params, grad_outputs)
        for f, e, w in zip(fused, unfused, float64_grads(mlp, [x], params, grad_outputs)):
            assert_close_as_unfused(f, e, w, factor=MODEL_FACTOR)
    (joint,) = [r for r in HISTORY.since(mark) if r.graph == "joint"]
    assert (joint.fused(FORWARD), joint.fused(BACKWARD)) == (1, 1) and not joint.misses, joint.misses


def _decomposed_silu_graph():
    """``silu(x) * y`` traced through Inductor's table on fake values of a fake mode of its own (one compile's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from npu_fusion.compat import inductor_decompositions, traced_decomposition

    with FakeTensorMode() as fake:
        values = [torch.empty(3, 8), torch.empty(3, 8)]
        return traced_decomposition(lambda x, y: torch.ops.aten.silu.default(x) * y, values, inductor_decompositions())


def _calls(gm):
    """The graph's calls as (target, arguments by position of the node read or constant), in order."""
    place = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [(n.target, tuple(place[a] if isinstance(a, torch.fx.Node) else a for a in n.args))
            for n in gm.graph.nodes if n.op == "call_function"]


def test_a_second_graph_recomposes_from_the_kept_structure_and_decomposes_back():
    """The second graph of one geometry recomposes SiLU as the first did, without tracing it (the trace's
    structure is kept across graphs), and decompose_again, with this graph's traces, puts back the table's trace."""
    from npu_fusion.compat import inductor_decompositions
    from npu_fusion.plugin.options import FusionOptions
    from npu_fusion.plugin.recompose import decompose_again, known_structures, recompose_decomposed

    table, options = inductor_decompositions(), FusionOptions.from_mapping({"target": "generic", **ON})
    first, second = _decomposed_silu_graph(), _decomposed_silu_graph()
    decomposed = _calls(second)
    assert [t for t, _ in decomposed].count(torch.ops.aten.exp.default) == 1
    assert [c.target for c in recompose_decomposed(first, options, table)] == [torch.ops.aten.silu.default]
    assert any(key[0][0] is torch.ops.aten.silu.default for key in known_structures(table))
    traces = {}
    calls = recompose_decomposed(second, options, table, traces, recompile=False)
    assert [c.target for c in calls] == [torch.ops.aten.silu.default] and not traces  # matched, not traced
    assert _calls(second) == _calls(first) and len(_calls(second)) == 2
    assert decompose_again(second, calls, table, traces, recompile=False) == 1 and len(traces) == 1
    assert _calls(second) == decomposed
    second.recompile()
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    assert torch.equal(second(x, y), x / (1 + torch.exp(-x)) * y)
