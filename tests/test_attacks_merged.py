"""Attacks on the merged SwiGLU (viewed projections, halves with other users) and silent-miss (clamped,
other-axis and backward-alone RMSNorm misses) changes: near-miss programs compiled with the pass, outputs
and gradients against eager by the float64 criterion, and sites or recorded misses read from the results.

A failing test here is a finding (a crash, a silent miss, a reason that says something false); a passing
one documents a near miss that was checked and found right."""
import copy

import pytest
import torch
import torch.nn.functional as F

from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_grads, float64_output, run_grads
from npu_fusion.patterns.rms_statistic import CLAMPED_EPS_REASON
from npu_fusion.plugin import pass_manager
from npu_fusion_testing.capture import Capture

from test_swiglu import BACKWARD, FORWARD, H, ON, _inputs, check

B, S, D = 2, 3, 16
RMS, RMS_GRAD = "rms_norm", "rms_norm_grad"


def _checked(fn, inputs, **options):
    """Compile ``fn`` with the pass (SwiGLU on): every output and gradient by the float64 criterion; its one result."""
    capture = Capture(**dict(ON, **options))
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=capture)
    with torch.no_grad():
        got, eager, exact = compiled(*inputs), fn(*inputs), float64_output(fn, inputs)
    for g, e, x in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, eager, exact))):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert_close_as_unfused(g, e, x, factor=MODEL_FACTOR)
    fused, grad_outputs = run_grads(compiled, inputs)
    unfused, _ = run_grads(fn, inputs, (), grad_outputs)
    for f, e, x in zip(fused, unfused, float64_grads(fn, inputs, (), grad_outputs)):
        assert f.dtype == e.dtype and f.shape == e.shape
        assert_close_as_unfused(f, e, x, factor=MODEL_FACTOR)
    (result,) = [r for r in capture.results if r.graph == "joint"]
    return result


def _ops(result):
    return sorted(s.op for s in result.sites), sorted(m.op for m in result.misses)


# == Change A: SwiGLU over a viewed projection, halves with other users ==========================

def unbound(x, w):
    gate, up = (x @ w).view(*x.shape[:-1], 2, H).unbind(-2)
    return F.silu(gate) * up


def chunked_across(x, w):
    gate, up = (x @ w).view(*x.shape[:-1], 2, H).chunk(2, dim=-2)
    return F.silu(gate) * up


@pytest.mark.parametrize("form", [unbound, chunked_across], ids=lambda f: f.__name__)
def test_viewed_projection_with_dynamic_batch_and_sequence_trains(form):
    """FINDING (A, crash): batch and sequence marked dynamic (what the symbolic-width miss tells the user to
    do), a viewed projection's rewrite emits ``view(..., [s77, s27, 2, 8])`` with raw SymInts: the compiled
    graph raises ``NameError: name 's77' is not defined`` on its first call."""
    x, w = _inputs(torch.float32)
    capture = Capture(**ON)
    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(x, 1)
    fused, grad_outputs = run_grads(torch.compile(form, backend=capture), [x, w])
    unfused, _ = run_grads(form, [x, w], (), grad_outputs)
    for f, e, r in zip(fused, unfused, float64_grads(form, [x, w], (), grad_outputs)):
        assert_close_as_unfused(f, e, r, factor=MODEL_FACTOR)
    (result,) = capture.results
    assert result.sites or result.misses


def test_viewed_projection_inference_with_dynamic_shapes_runs():
    """FINDING (A, crash): ``chunk(2, -2)`` of a ``[..., 2, H]`` view under ``dynamic=True`` without grad:
    the forward's rewrite views swiglu's result to ``[s77, s27, 1, 8]`` and the graph raises NameError."""
    x, w = [t.detach() for t in _inputs(torch.float32)]
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(chunked_across, backend=Capture(**ON), dynamic=True)(x, w)
    assert_close_as_unfused(got, chunked_across(x, w), float64_output(chunked_across, [x, w]), factor=MODEL_FACTOR)


def halves_of_four_heads(x, w):  # [..., 4, H/2], chunk(2, -2): rows 0-1 are the gate, 2-3 the up (two halves)
    gate, up = (x @ w).view(B, S, 4, H // 2).chunk(2, dim=-2)
    return F.silu(gate) * up


def test_halves_across_a_head_axis_miss_says_the_same_true_thing_both_ways():
    """Was a finding (A, false reason, a regression from 28be57e): the forward's miss said "mul is not
    silu(gate) * up position by position", which is false (the product is exactly silu of the first half
    times the second). Both ways the miss now says the same true thing: the halves are the projection's,
    each two rows of the view, and the rules read silu and its gradient a row at a time."""
    result = _checked(halves_of_four_heads, _inputs(torch.float32))
    assert _ops(result) == ([], [FORWARD, BACKWARD]) or _ops(result) == ([FORWARD, BACKWARD], [])
    for miss in result.misses:
        assert "is not silu(gate) * up position by position" not in miss.reason, miss.reason
        assert "each half is 2 rows" in miss.reason and "a row at a time" in miss.reason, miss.reason
    assert len({miss.reason for miss in result.misses}) <= 1  # the same reason both ways


def flattened_leading(x, w):  # [B*S, 2, H].unbind(1): the two halves of the last axis, leading axes merged
    gate, up = (x @ w).reshape(B * S, 2, H).unbind(1)
    return (F.silu(gate) * up).view(B, S, H)


def scalar_offset_projection(x, w):  # (x @ w + 0.1) viewed [..., 2, H]: unbind(-2) of a projection plus a number
    gate, up = (x @ w + 0.1).view(B, S, 2, H).unbind(-2)
    return F.silu(gate) * up


@pytest.mark.parametrize("form", [flattened_leading, scalar_offset_projection], ids=lambda f: f.__name__)
def test_halves_of_a_two_row_view_are_not_called_a_split_the_rules_cannot_read(form):
    """Was a finding (A, false reason / missed fusion): each splits ``[..., 2, H]`` along its second-to-last
    axis, the form this change fuses (``unbind(-2)``: ``tests/test_swiglu.py::unbound`` fuses), yet the
    miss said the rules "find the two halves along the last axis only". Now the view is x (its two rows the
    halves, read ``[..., 2H]``): fused both ways, outputs and gradients by the float64 criterion
    (``_checked``), and the inference graph's forward too."""
    result = _checked(form, _inputs(torch.float32))
    for miss in result.misses:
        assert "along the last axis only" not in miss.reason, miss.reason
    assert _ops(result) == ([FORWARD, BACKWARD], []), result.misses
    capture = Capture(**ON)
    torch._dynamo.reset()
    x, w = [t.detach() for t in _inputs(torch.float32)]
    with torch.no_grad():
        got = torch.compile(form, backend=capture)(x, w)
    assert_close_as_unfused(got, form(x, w), float64_output(form, [x, w]), factor=MODEL_FACTOR)
    (inference,) = capture.results
    assert _ops(inference) == ([FORWARD], [])


def strided_halves(x, w):  # the two halves spelled with as_strided
    h = x @ w
    gate = h.as_strided((B, S, H), (S * 2 * H, 2 * H, 1))
    up = h.as_strided((B, S, H), (S * 2 * H, 2 * H, 1), H)
    return F.silu(gate) * up


def gate_scaled_in_place_first(x, w):  # the projection's gate half updated in place, then halved
    h = x @ w
    h[..., :H].mul_(2)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("form, reason", [(strided_halves, "not as_strided's sizes, strides and offset"),
                                          (gate_scaled_in_place_first, "after an in-place update")],
                         ids=["strided_halves", "gate_scaled_in_place_first"])
def test_swiglu_of_one_projection_is_never_silent(form, reason):
    """Was a finding (silent miss, already at 28be57e): silu of the first half times the second half of one
    projection, reached through as_strided or after an in-place update of a slice: no site, no miss. Now
    one recorded miss each way, saying what the rules do not read."""
    result = _checked(form, _inputs(torch.float32))
    assert result.sites or result.misses, "silent: no site and no recorded miss"
    assert _ops(result) == ([], [FORWARD, BACKWARD])
    for miss in result.misses:
        assert reason in miss.reason, miss.reason


# -- checked near misses (Change A): right values, each fused or recorded -----------------------

def both_reused(x, w):
    gate, up = (x @ w).chunk(2, -1)
    return F.silu(gate) * up + gate * up


def both_returned(x, w):
    gate, up = (x @ w).chunk(2, -1)
    return F.silu(gate) * up, gate, up


def gate_returned_and_reused(x, w):
    gate, up = (x @ w).chunk(2, -1)
    return F.silu(gate) * up + gate.exp(), gate


def view_returned(x, w):
    h = (x @ w).view(B, S, 2, H)
    gate, up = h.unbind(-2)
    return F.silu(gate) * up, h


def two_products_of_one_split(x, w):
    gate, up = (x @ w).chunk(2, -1)
    return F.silu(gate) * up + F.silu(gate) * up * 2


def a_view_and_a_chunk_of_one_projection(x, w):
    h = x @ w
    g1, u1 = h.chunk(2, -1)
    g2, u2 = h.view(B, S, 2, H).unbind(-2)
    return F.silu(g1) * u1 + F.silu(g2) * u2 * 0.5


def across_up_squared(x, w):
    gate, up = (x @ w).view(B, S, 2, H).chunk(2, dim=-2)
    return F.silu(gate) * up + up * up


def selected_both_reused(x, w):
    h = (x @ w).view(B, S, 2, H)
    g, u = h[..., 0, :], h[..., 1, :]
    return F.silu(g) * u + g * u.sin()


def per_head_up_returned(x, w):
    gate, up = (x @ w).view(B, S, 2, H).chunk(2, dim=-1)
    return F.silu(gate) * up, up


def output_updated_with_the_gate(x, w):
    gate, up = (x @ w).chunk(2, -1)
    y = F.silu(gate) * up
    y.add_(gate)
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("form, sites", [
    (both_reused, 1), (both_returned, 1), (gate_returned_and_reused, 1), (view_returned, 1),
    (two_products_of_one_split, 2), (a_view_and_a_chunk_of_one_projection, 2), (across_up_squared, 1),
    (selected_both_reused, 1), (per_head_up_returned, 1), (output_updated_with_the_gate, 1),
], ids=lambda v: getattr(v, "__name__", None))
def test_checked_halves_with_other_users_fuse_and_keep_values(form, sites, dtype):
    result = _checked(form, _inputs(dtype))
    assert sorted(s.op for s in result.sites) == sorted([FORWARD, BACKWARD] * sites)
    assert not [m for m in result.misses if m.op in (FORWARD, BACKWARD)], result.misses


def interleaved_pairs(x, w):  # view(B, S, H, 2).unbind(-1): interleaved
    gate, up = (x @ w).view(B, S, H, 2).unbind(-1)
    return F.silu(gate) * up


def rows_across_batch(x, w):  # view(2, B, S, H): each "half" mixes positions
    gate, up = (x @ w).view(2, B, S, H).unbind(0)
    return F.silu(gate) * up


def transposed_then_chunked(x, w):  # view(B, S, 2, H).transpose(-1, -2).chunk(2, -2): quarters
    gate, up = (x @ w).view(B, S, 2, H).transpose(-1, -2).chunk(2, dim=-2)
    return F.silu(gate) * up


def swapped_view(x, w):  # silu of the second row of [..., 2, H]
    gate, up = (x @ w).view(B, S, 2, H).unbind(-2)
    return F.silu(up) * gate


@pytest.mark.parametrize("form", [interleaved_pairs, rows_across_batch, transposed_then_chunked, swapped_view],
                         ids=lambda f: f.__name__)
def test_checked_views_whose_pieces_are_not_the_halves_are_one_miss_each(form):
    result = _checked(form, _inputs(torch.float32))
    assert _ops(result) == ([], [FORWARD, BACKWARD]), result.misses


def test_checked_autocast_bf16_viewed_projection_fuses():
    x, w = _inputs(torch.float32)
    capture = Capture(**ON)
    torch._dynamo.reset()
    compiled = torch.compile(unbound, backend=capture)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, grad_outputs = run_grads(compiled, [x, w])
        unfused, _ = run_grads(unbound, [x, w], (), grad_outputs)
    for f, e in zip(fused, unfused):
        assert f.dtype == e.dtype and (f.float() - e.float()).abs().max() < 2e-2
    (result,) = capture.results
    assert _ops(result) == ([FORWARD, BACKWARD], [])


# == Change B: clamped, other-axis and backward-alone RMSNorm misses ==============================

def _norm_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, D, generator=g).requires_grad_(), (1 + 0.1 * torch.randn(D, generator=g)).requires_grad_()]


def _norm_result(fn, **options):
    """``fn`` through the backend with every default (RMSNorm on): its gradients equal eager's; its one result."""
    capture = Capture(**options)
    torch._dynamo.reset()
    inputs = _norm_inputs()
    fused, grad_outputs = run_grads(torch.compile(fn, backend=capture), inputs)
    unfused, _ = run_grads(fn, inputs, (), grad_outputs)
    for f, e, r in zip(fused, unfused, float64_grads(fn, inputs, (), grad_outputs)):
        assert_close_as_unfused(f, e, r, factor=MODEL_FACTOR)
    (result,) = capture.results
    return result


def _backward_alone(fn, decompositions="none"):
    """The backward graphs of ``fn``'s partition through the pass with no forward (``forward=None``)."""
    capture = Capture(fuse=False, decompositions=decompositions)
    torch._dynamo.reset()
    torch.compile(fn, backend=capture)(*_norm_inputs()).sum().backward()
    return [pass_manager.fuse_backward(copy.deepcopy(bw), {"target": "generic", "strict": True}, forward=None)
            for bw in capture.backwards]


def clamped_residual(x, w):  # three rsqrt(clamp_min(mean(h*h), eps)) norms on a residual stream
    h = x
    for _ in range(3):
        h = h + torch.tanh(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).clamp_min(1e-6)) * w)
    return h


def rms_residual(x, w):
    h = x
    for _ in range(3):
        h = h + torch.tanh(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w)
    return h


def test_each_clamped_norm_of_a_residual_stream_is_one_backward_miss():
    """Three clamped norms on a residual stream are three forward and three backward misses (once one
    backward miss: the first norm's products reach the next two's, which counted as the first's)."""
    result = _norm_result(clamped_residual)
    assert sum(m.op == RMS for m in result.misses) == 3, result.misses
    grads = [m for m in result.misses if m.op == RMS_GRAD]
    assert len(grads) == 3 and all(m.reason == CLAMPED_EPS_REASON for m in grads), result.misses


@pytest.mark.parametrize("decompositions", ["none", "core"])
def test_clamped_norms_backward_alone_are_not_silent(decompositions):
    """The same three clamped norms' backward alone (once no miss): one miss per norm, read off clamp_min's backward."""
    (result,) = _backward_alone(clamped_residual, decompositions)
    assert not result.sites
    grads = [m for m in result.misses if m.op == RMS_GRAD]
    assert len(grads) == 3 and all("clamp_min" in m.reason for m in grads), result.misses
    assert len({m.node for m in grads}) == 3, result.misses


@pytest.mark.parametrize("decompositions", ["none", "core"])
def test_residual_norms_backward_alone_core_decomposed_are_one_miss_per_norm(decompositions):
    """Three residual norms' backward alone is one miss per norm (with core decompositions, once SIX, five of
    them the first norm's dx carried on by tanh's decomposed backward; the last norm's read too few symbols)."""
    (result,) = _backward_alone(rms_residual, decompositions=decompositions)
    misses = [m for m in result.misses if m.op == RMS_GRAD]
    assert result.fused(RMS_GRAD) + len(misses) == 3, [(m.node, m.reason[:100]) for m in misses]


def rounded_then_clamped(x, w):  # a norm rounding inside to bf16 (a recorded miss), then a clamped norm
    h = x + torch.tanh((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).float() * w)
    return h + torch.tanh(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).clamp_min(1e-6)) * w)


def test_a_norms_recorded_miss_does_not_account_for_the_next_norms_backward():
    """The first norm's backward miss (its rounding) lies where the clamped norm's backward products reach it, down the
    residual stream: it is the first norm's miss, not the clamped one's, whose backward is a miss of its own (once silent)."""
    result = _norm_result(rounded_then_clamped)
    grads = [m for m in result.misses if m.op == RMS_GRAD]
    assert len(grads) == 2 and sorted(m.reason == CLAMPED_EPS_REASON for m in grads) == [False, True], result.misses


def eps_outside_then_clamped(x, w):  # a norm with eps outside the root (a dx-shaped near miss), then a clamped norm
    h = x + torch.tanh(x * (torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) + 1e-6) * w)
    return h + torch.tanh(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).clamp_min(1e-6)) * w)


def test_a_near_miss_without_a_statistic_does_not_account_for_the_next_norms_backward():
    """Eps outside the root is no RMS statistic, so the first norm's dx near miss was the only miss the clamped norm's
    backward products reach, and counted for it (once silent): a near miss accounts only for the norm it is about."""
    result = _norm_result(eps_outside_then_clamped)
    grads = [m for m in result.misses if m.op == RMS_GRAD]
    assert len(grads) == 2 and sorted(m.reason == CLAMPED_EPS_REASON for m in grads) == [False, True], result.misses


def clamped_over_axis_0(x, w):  # clamp_min and a statistic over the batch axis: both near misses at once
    return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True).clamp_min(1e-6)) * w


def clamped_over_every_axis(x, w):
    return x * torch.rsqrt(x.pow(2).mean((0, 1, 2), keepdim=True).clamp_min(1e-6)) * w


@pytest.mark.parametrize("fn, axes", [(clamped_over_axis_0, "axes [0]"), (clamped_over_every_axis, "every axis")],
                         ids=["axis_0", "every_axis"])
def test_clamped_statistic_over_another_axis_is_not_silent(fn, axes):
    """Clamped eps is a miss, another axis is a miss, and both together (once silent) one miss each way naming the axes."""
    result = _norm_result(fn)
    misses = [m for m in result.misses if m.op in (RMS, RMS_GRAD)]
    assert sorted(m.op for m in misses) == [RMS, RMS_GRAD], result.misses
    assert all("clamp_min" in m.reason and axes in m.reason for m in misses), result.misses


@pytest.mark.parametrize("decompositions", ["none", "core"])
@pytest.mark.parametrize("fn, axes", [(clamped_over_axis_0, "axes [0]"), (clamped_over_every_axis, "every axis")],
                         ids=["axis_0", "every_axis"])
def test_clamped_statistic_over_another_axis_backward_alone_is_not_silent(fn, axes, decompositions):
    """The same norms' backward alone (once silent: no sum over the last axes for the algebra to start from): one miss,
    read off clamp_min's backward, naming the axes."""
    (result,) = _backward_alone(fn, decompositions)
    assert not result.sites
    grads = [m for m in result.misses if m.op == RMS_GRAD]
    assert len(grads) == 1 and "clamp_min" in grads[0].reason and axes in grads[0].reason, result.misses



def zero_clamped_residual(x, w):  # three norms whose mean square is clamped at 0 (a no-op guard), on a residual stream
    h = x
    for _ in range(3):
        h = h + torch.tanh(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).clamp(min=0) + 1e-6) * w)
    return h


@pytest.mark.parametrize("decompositions", ["none", "core"])
def test_norms_clamped_at_zero_fuse_both_ways(decompositions):
    """clamp(mean(x*x), min=0) is the mean itself (clamp keeps NaN), and its backward where(mean >= 0, g, 0) passes g:
    three norms fuse forward and backward, gradients as eager's (once neither fused nor recorded)."""
    result = _norm_result(zero_clamped_residual, decompositions=decompositions)
    assert result.fused(RMS) == 3 and result.fused(RMS_GRAD) == 3, (result.sites, result.misses)
    assert not result.misses, result.misses


@pytest.mark.parametrize("decompositions", ["none", "core"])
def test_norms_clamped_at_zero_backward_alone_are_one_miss_each(decompositions):
    """On a backward graph alone the saved mean square cannot be proven >= 0: one miss per norm, naming the clamp at 0
    (not eps as a lower bound, which it is not)."""
    (result,) = _backward_alone(zero_clamped_residual, decompositions)
    grads = [m for m in result.misses if m.op == RMS_GRAD]
    assert len(grads) == 3 and all("clamped at 0" in m.reason for m in grads), result.misses



def test_norms_clamped_at_zero_fused_keep_a_nan_row_as_eager():
    """A NaN in x: where(NaN >= 0, g, 0) drops g where the fused backward keeps it, but the row's rstd is NaN, so its
    output and dx are NaN either way (and dgamma, a sum over rows): fused output and gradients equal eager's, NaN included."""
    x, w = (t.detach() for t in _norm_inputs())
    x[0, 1, 3] = float("nan")
    got = []
    for fn in (torch.compile(zero_clamped_residual, backend=Capture()), zero_clamped_residual):
        torch._dynamo.reset()
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi)
        y.backward(torch.ones_like(y))
        got.append((y.detach(), xi.grad, wi.grad))
    for fused, eager in zip(*got):
        assert fused.isnan().any()
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5, equal_nan=True)

def norm_of_vector_norm(x, w):
    return x * torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).pow(2) / x.shape[-1] + 1e-6) * w


@pytest.mark.parametrize("decompositions", ["none", "core"])
def test_norm_through_vector_norm_is_one_miss_each_way(decompositions):
    """vector_norm(x)**2 / D is sum(x*x) / D only up to rounding: one forward miss naming vector_norm (once silent: the
    backward's miss alone), one backward miss naming it too; no site."""
    result = _norm_result(norm_of_vector_norm, decompositions=decompositions)
    assert not [s for s in result.sites if s.op in (RMS, RMS_GRAD)]
    forward = [m for m in result.misses if m.op == RMS]
    assert len(forward) == 1 and "vector_norm" in forward[0].reason, result.misses
    backward = [m for m in result.misses if m.op == RMS_GRAD]
    assert len(backward) == 1 and "vector_norm" in backward[0].reason, result.misses  # once only 'terms differ'


def norm_over_axis_0(x, w):
    return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6) * w


def norm_over_every_axis(x, w):
    return x * torch.rsqrt(x.pow(2).mean((0, 1, 2), keepdim=True) + 1e-6) * w


@pytest.mark.parametrize("decompositions", ["none", "core"])
@pytest.mark.parametrize("fn, axes", [(norm_over_axis_0, "axes [0]"), (norm_over_every_axis, "every axis")],
                         ids=["axis_0", "every_axis"])
def test_statistic_over_another_axis_backward_alone_is_not_silent(fn, axes, decompositions):
    """A norm over another axis, not clamped, on a backward graph alone (once silent: no sum over the last axes for the
    algebra to start from, and no clamp_min backward to read): one miss at dx's rstd**3*sum(dy*g*x) term naming the axes."""
    (result,) = _backward_alone(fn, decompositions)
    assert not result.sites
    grads = [m for m in result.misses if m.op == RMS_GRAD]
    assert len(grads) == 1 and axes in grads[0].reason and "backward graph alone" in grads[0].reason, result.misses


# -- checked near misses (Change B) ----------------------------------------------------------

def l2_normalize(x, w):
    return F.normalize(x, dim=-1) * w


def l2_by_norm(x, w):
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6) * w


def l2_by_sqrt_of_sum(x, w):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True)).clamp_min(1e-6) * w


def l2_residual(x, w):
    h = x
    for _ in range(3):
        h = h + F.normalize(h, dim=-1) * w
    return h


def softmax_residual(x, w):
    h = x
    for _ in range(3):
        h = h + torch.softmax(h * w, -1)
    return h


def layer_norm(x, w):
    return F.layer_norm(x, (D,), w)


def layer_norm_residual(x, w):
    h = x
    for _ in range(3):
        h = h + torch.tanh(F.layer_norm(h, (D,), w))
    return h


def moe_routing(x, w):
    v, _ = torch.softmax(x * w, -1).topk(4, -1)
    return v / v.sum(-1, keepdim=True)


def moe_routing_clamped(x, w):
    v, _ = torch.sigmoid(x * w).topk(4, -1)
    return v / v.sum(-1, keepdim=True).clamp_min(1e-20)


@pytest.mark.parametrize("decompositions", ["none", "core"])
@pytest.mark.parametrize("form", [l2_normalize, l2_by_norm, l2_by_sqrt_of_sum, l2_residual, softmax_residual, layer_norm,
                                  layer_norm_residual, moe_routing, moe_routing_clamped], ids=lambda f: f.__name__)
def test_checked_non_rms_programs_are_no_norm_site_nor_miss(form, decompositions):
    """F.normalize (an L2 norm, not an RMSNorm), softmax, LayerNorm and MoE weight normalization: no
    RMSNorm site or miss on the joint graph nor on the backward alone."""
    result = _norm_result(form, decompositions=decompositions)
    assert not [s for s in result.sites if s.op in (RMS, RMS_GRAD)]
    assert not [m for m in result.misses if m.op in (RMS, RMS_GRAD)], result.misses
    for alone in _backward_alone(form, decompositions):
        assert not [m for m in alone.misses if m.op in (RMS, RMS_GRAD)], alone.misses


def upcast_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def clamped_input_norm(x, w):  # a clamp elsewhere (of x): still rsqrt(mean + eps)
    x = x.clamp(-10, 10)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def sqrt_divided_norm(x, w):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def centred_norm(x, w):  # an RMSNorm of x - mean(x): fused at 28be57e too
    c = x - x.mean(-1, keepdim=True)
    return c * torch.rsqrt((c * c).mean(-1, keepdim=True) + 1e-5) * w


@pytest.mark.parametrize("form, norms", [(rms_residual, 3), (upcast_norm, 1), (clamped_input_norm, 1),
                                         (sqrt_divided_norm, 1), (centred_norm, 1)], ids=lambda v: getattr(v, "__name__", None))
def test_checked_norms_that_fused_at_the_base_still_fuse(form, norms):
    result = _norm_result(form)
    assert (result.fused(RMS), result.fused(RMS_GRAD)) == (norms, norms) and not result.misses, result.misses
