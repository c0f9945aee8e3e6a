"""``aten._fused_rms_norm_backward``, the whole RMSNorm backward torch keeps where the device has
its own ``_fused_rms_norm`` kernel (CUDA, MPS, XPU; no torch_npu line registers one, see
docs/compatibility.md), rewritten into ``npu_fusion.rms_norm_grad`` or left with its reason.

The routing is simulated on the CPU as a device with its own kernels would have it
(:mod:`npu_fusion_testing.whole_rms_norm`: CPU kernels for the two ops, for this module's tests
only): autograd records ``_fused_rms_norm``'s own derivative and AOTAutograd keeps both ops whole.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import checkpoint

from npu_fusion.compat import FUSED_RMS_NORM, FUSED_RMS_NORM_BACKWARD
from npu_fusion.lowering import RMS_NORM_GRAD
from npu_fusion.patterns.rms_statistic import WHOLE_FORWARD_REASON
from npu_fusion.plugin.pass_manager import fuse_backward
from npu_fusion_testing.capture import Capture, compile_and_compare
from npu_fusion.measure.grads import assert_close_as_unfused, float64_grads, grad_failures, run_grads
from npu_fusion_testing.whole_rms_norm import (device_rms_norm_kernels, forward_decomposition, routes_whole,
                                                  unavailable)

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable())

PARTITIONERS = ("default", "min_cut")


@pytest.fixture(autouse=True, scope="module")
def device_kernels():
    """The routing of a device with its own kernels while this module runs, and not after."""
    with device_rms_norm_kernels():
        assert routes_whole()
        yield
    assert not routes_whole()


def whole_ops_left(capture):
    return [n.name for g in capture.after for n in g.nodes if n.op == "call_function"
            and n.target in (FUSED_RMS_NORM_BACKWARD, FUSED_RMS_NORM)]


def only_forward_misses(capture):
    """The misses other than the whole forward's (which stays whole, a recorded miss)."""
    forward = [m for m in capture.misses() if m.reason == WHOLE_FORWARD_REASON]
    assert forward, "the forward aten._fused_rms_norm left in the graph is recorded"
    return [m for m in capture.misses() if m.reason != WHOLE_FORWARD_REASON]


def norm_then_tanh(x, w):
    return F.rms_norm(x * 2, (x.shape[-1],), w, 1e-6).tanh()


@pytest.mark.parametrize("target", ["a2", "950"])
@pytest.mark.parametrize("partitioner", PARTITIONERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_whole_backward_fuses(partitioner, dtype, target):
    x = torch.randn(2, 8, 64, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(64)).to(dtype).requires_grad_()
    capture = compile_and_compare(norm_then_tanh, [x, w], partitioner=partitioner, target=target)
    assert capture.fused(RMS_NORM_GRAD.name) == 1
    assert [n.name for g in capture.before for n in g.nodes if n.target is FUSED_RMS_NORM_BACKWARD]
    assert not [n for n in whole_ops_left(capture) if "backward" in n]
    assert only_forward_misses(capture) == []
    site = capture.results[0].sites[0]
    assert site.replaced_targets.get("_fused_rms_norm_backward.default") == 1


@pytest.mark.parametrize("partitioner", PARTITIONERS)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float16])
def test_direct_call_with_a_weight_of_another_dtype(partitioner, weight_dtype):
    """``F.rms_norm`` takes the composite for a weight of another dtype; a direct call keeps the
    whole op: gamma is widened exactly to float32 (the (bf16, fp32) row of
    docs/fused-ops.md#rms_norm_grad), each output is cast
    back to the dtype the call declares."""
    def program(x, w):
        return torch.ops.aten._fused_rms_norm(x, [64], w, 1e-5)[0].tanh()

    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(64)).to(weight_dtype).requires_grad_()
    capture = compile_and_compare(program, [x, w], partitioner=partitioner, target="a2")
    assert capture.fused(RMS_NORM_GRAD.name) == 1 and only_forward_misses(capture) == []
    (fused,) = [n for n in capture.after[0].nodes if n.target is RMS_NORM_GRAD.overload]
    assert [a.meta["val"].dtype for a in fused.args] == [torch.bfloat16, torch.bfloat16, torch.float32,
                                                         torch.float32]


@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_dynamic_batch_and_sequence(partitioner):
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16).requires_grad_()
    capture = compile_and_compare(norm_then_tanh, [x, w], dynamic_dims={0: (0, 1)}, partitioner=partitioner,
                                  target="a2")
    assert capture.fused(RMS_NORM_GRAD.name) == 1 and only_forward_misses(capture) == []
    (fused,) = [n for n in capture.after[0].nodes if n.target is RMS_NORM_GRAD.overload]
    assert [isinstance(d, torch.SymInt) for d in fused.args[0].meta["val"].shape] == [True, True, False]


@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_module_over_two_axes_and_weightless(partitioner):
    """nn.RMSNorm over the last two axes, then one without weight (gamma of ones)."""
    torch.manual_seed(0)
    affine, plain = torch.nn.RMSNorm((4, 32), eps=1e-5), torch.nn.RMSNorm(32, elementwise_affine=False)
    with torch.no_grad():
        affine.weight.add_(0.1 * torch.randn(4, 32))

    def program(x):
        return plain(affine(x).relu() + x)

    x = torch.randn(3, 4, 32, requires_grad=True)
    capture = compile_and_compare(program, [x], params=list(affine.parameters()), partitioner=partitioner,
                                  target="a3")
    assert capture.fused(RMS_NORM_GRAD.name) == 2
    assert not [n for n in whole_ops_left(capture) if "backward" in n]
    assert only_forward_misses(capture) == []


@pytest.mark.parametrize("partitioner", PARTITIONERS)
@pytest.mark.parametrize("wants", ["dx", "dgamma"])
def test_output_mask_chooses_the_outputs(partitioner, wants):
    """Only x or only the weight requires grad: output_mask asks for one output, the other is
    never wired (and dgamma keeps the weight's dtype)."""
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=wants == "dx")
    w = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16).requires_grad_(wants == "dgamma")
    capture = compile_and_compare(norm_then_tanh, [x, w], partitioner=partitioner, target="a2")
    (whole,) = [n for g in capture.before for n in g.nodes if n.target is FUSED_RMS_NORM_BACKWARD]
    assert whole.args[5] == [wants == "dx", wants == "dgamma"]
    assert capture.fused(RMS_NORM_GRAD.name) == 1
    assert list(capture.results[0].sites[0].outputs) == [wants]
    assert only_forward_misses(capture) == []


def norm_over_every_axis_then_tanh(x, w):
    return F.rms_norm(x * 2, tuple(x.shape), w, 1e-6).tanh()


@pytest.mark.parametrize("partitioner", PARTITIONERS)
@pytest.mark.parametrize("target", ["a2", "generic"])
def test_whole_backward_over_every_axis_fuses(partitioner, target):
    """A norm over every axis of x (gamma shaped like x, rstd of one element) on the chips whose
    RmsNormGrad takes it."""
    x = torch.randn(8, 64, requires_grad=True)
    w = (1 + 0.1 * torch.randn(8, 64)).requires_grad_()
    capture = compile_and_compare(norm_over_every_axis_then_tanh, [x, w], partitioner=partitioner, target=target)
    assert capture.fused(RMS_NORM_GRAD.name) == 1 and only_forward_misses(capture) == []


@pytest.mark.parametrize("partitioner", PARTITIONERS)
@pytest.mark.parametrize("target, dtype, norm, reason", [
    ("950", torch.bfloat16, norm_over_every_axis_then_tanh, "RmsNormGrad on Ascend 950 needs at least one leading axis"),
    ("a2", torch.float64, norm_then_tanh, "dtype combination dy/x=torch.float64"),
    ("generic", torch.float64, norm_then_tanh, "dtype combination dy/x=torch.float64"),
])
def test_near_misses_stay_whole_with_their_reason(partitioner, target, dtype, norm, reason):
    x = torch.randn(8, 64, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(*(x.shape if norm is norm_over_every_axis_then_tanh else (64,)))).to(dtype)
    capture = compile_and_compare(norm, [x, w.requires_grad_()], partitioner=partitioner, target=target)
    assert capture.fused(RMS_NORM_GRAD.name) == 0
    assert [n for n in whole_ops_left(capture) if "backward" in n]
    (miss,) = only_forward_misses(capture)
    assert miss.node.startswith("_fused_rms_norm_backward") and reason in miss.reason
    assert miss.reason.startswith("aten._fused_rms_norm_backward: ")


def test_core_decompositions_take_the_decomposed_path():
    """With decompositions='core' both whole ops decompose (they are core decompositions):
    the value matcher fuses the backward and no whole forward is left to report."""
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16).requires_grad_()
    capture = compile_and_compare(norm_then_tanh, [x, w], decompositions="core", target="a2")
    assert capture.fused(RMS_NORM_GRAD.name) == 1
    assert not whole_ops_left(capture) and capture.misses() == []


@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_forward_decomposed_backward_whole(partitioner):
    """The whole forward decomposed alone (what torchair needs: it has no converter for it): no
    forward left to report, and the whole backward fuses."""
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16).requires_grad_()
    capture = compile_and_compare(norm_then_tanh, [x, w], partitioner=partitioner, target="a2",
                                  decompositions=forward_decomposition())
    assert capture.fused(RMS_NORM_GRAD.name) == 1 and capture.misses() == [] and not whole_ops_left(capture)
    assert capture.results[0].sites[0].replaced_targets.get("_fused_rms_norm_backward.default") == 1


def checkpointed_block(seed=0):
    torch.manual_seed(seed)
    norm, linear = torch.nn.RMSNorm(32), torch.nn.Linear(32, 32)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(32))

    def block(x):
        return x + linear(norm(x)).tanh()

    return block, list(norm.parameters()) + list(linear.parameters())


@pytest.mark.parametrize("partitioner", PARTITIONERS)
@pytest.mark.parametrize("stage", ["joint", "backward"])
def test_activation_checkpointing(partitioner, stage):
    """After the partition the whole forward is recomputed in the backward graph: its miss names
    both graphs. On the joint graph (before the partition) it is one node, one miss. The whole
    backward fuses either way."""
    block, params = checkpointed_block()
    x = torch.randn(2, 5, 32, requires_grad=True)
    capture = compile_and_compare(lambda h: checkpoint(block, h, use_reentrant=False), [x], params=params,
                                  partitioner=partitioner, target="a2", stage=stage)
    assert capture.fused(RMS_NORM_GRAD.name) == 1 and not [n for n in whole_ops_left(capture) if "backward" in n]
    expected = ["_fused_rms_norm", "_fused_rms_norm (forward graph)"] if stage == "backward" else ["_fused_rms_norm"]
    assert sorted(m.node for m in capture.misses()) == expected
    assert {m.reason for m in capture.misses()} == {WHOLE_FORWARD_REASON}
    # a forward site: the forward rule's miss on the joint graph, the backward rule's where only it runs
    assert {m.op for m in capture.misses()} == {"rms_norm" if stage == "joint" else RMS_NORM_GRAD.name}


def test_compiled_autograd():
    """Fused at the partition; the compiled-autograd graph that inlines it finds the fused op."""
    block, params = checkpointed_block()
    x = torch.randn(2, 5, 32, requires_grad=True)
    _, grad_outputs = run_grads(block, [x], params)
    eager = dict(zip("xabc", run_grads(block, [x], params, grad_outputs)[0]))
    exact = dict(zip("xabc", float64_grads(block, [x], params, grad_outputs)))
    capture = Capture(target="a2")

    def step(h):
        torch.autograd.backward(block(h), grad_outputs)

    with torch._dynamo.config.patch(compiled_autograd=True):
        torch.compile(step, backend=capture)(x)
    got = dict(zip("xabc", [t.grad for t in [x] + params]))
    assert grad_failures(got, eager, exact) == []
    assert [r.fused(RMS_NORM_GRAD.name) for r in capture.results] == [1, 0]
    assert any(n.target is RMS_NORM_GRAD.overload for n in capture.after[1].nodes)
    assert not [n for n in whole_ops_left(capture) if "backward" in n]


def backward_graph(rstd_shape, x_shape=(2, 8, 64)):
    """A graph calling ``_fused_rms_norm_backward`` with rstd in ``rstd_shape`` (keep-dim
    ``[2, 8, 1]``, plain ``[2, 8]``, or one torch takes and RmsNormGrad does not)."""
    def program(dy, x, rstd, w):
        return torch.ops.aten._fused_rms_norm_backward(dy, x, [64], rstd, w, [True, True])

    x = torch.randn(x_shape)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-6).reshape(rstd_shape)
    inputs = [torch.randn(x_shape), x, rstd, 1 + 0.1 * torch.randn(64)]
    return make_fx(program, tracing_mode="fake")(*inputs), program, inputs


@pytest.mark.parametrize("rstd_shape", [(2, 8, 1), (2, 8)])
def test_rstd_keep_dim_and_plain(rstd_shape):
    """rstd is 1/RMS(x) with eps inside, in either shape: the rewritten graph computes what the
    call computed, checked against the float64 call with the shared criterion."""
    gm, program, inputs = backward_graph(rstd_shape)
    result = fuse_backward(gm, {"target": "a2", "strict": True})
    assert result.fused(RMS_NORM_GRAD.name) == 1 and result.misses == []
    assert not [n for n in gm.graph.nodes if n.target is FUSED_RMS_NORM_BACKWARD]
    fused, unfused = gm(*inputs), program(*inputs)
    exact = program(*[t.double() for t in inputs])
    for got, ref, wide in zip(fused, unfused, exact):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert_close_as_unfused(got, ref, wide)


def test_rstd_of_another_shape_is_a_miss():
    """A 0-d rstd of a 1-D x (torch unsqueezes it; RmsNormGrad takes 1 to 8 axes)."""
    gm, program, inputs = backward_graph((), x_shape=(64,))
    result = fuse_backward(gm, {"target": "a2", "strict": True})
    assert result.sites == []
    (miss,) = result.misses
    assert "rstd must have 1 to 8 dimensions" in miss.reason
    assert all(torch.equal(a, b) for a, b in zip(gm(*inputs), program(*inputs)))
    assert [n for n in gm.graph.nodes if n.target is FUSED_RMS_NORM_BACKWARD]


def test_a_user_reading_the_result_whole_is_a_miss():
    gm, _, _ = backward_graph((2, 8, 1))
    whole = next(n for n in gm.graph.nodes if n.target is FUSED_RMS_NORM_BACKWARD)
    with gm.graph.inserting_after(whole):
        tupled = gm.graph.call_function(tuple, (whole,))
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    output.args = (tuple(output.args[0]) + (tupled,),)
    result = fuse_backward(gm, {"target": "a2"})
    assert result.sites == []
    (miss,) = result.misses
    assert "other than by index" in miss.reason
    assert whole in tupled.args and not whole._erased
