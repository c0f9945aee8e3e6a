"""Attacks on reading ``clamp(v, min=c)`` (c <= 0) of a v >= 0 as v, and its backward ``where(v >= c, g, 0)`` as g.

Near misses where that reading would be wrong (a clamp that moves values, a v that may be negative, a
user's own gate on a value that may be NaN): outputs and gradients equal eager's (NaN positions too),
and a clamp that moves values is never fused."""
import pytest
import torch

from npu_fusion_testing.capture import Capture

from test_attacks_inference import run_inference
from test_attacks_merged import RMS, RMS_GRAD, _norm_result

B, S, D = 2, 3, 16


def _eager_and_compiled(fn, inputs, **options):
    """``fn`` compiled with the pass and eagerly on copies of ``inputs``: (outputs and gradients) each way, the results."""
    capture, got = Capture(**options), []
    grad = 0.3 + 0.01 * torch.arange(B * S * D, dtype=torch.float32).view(B, S, D)
    for f in (torch.compile(fn, backend=capture), fn):
        torch._dynamo.reset()
        ts = [t.detach().clone().requires_grad_() for t in inputs]
        y = f(*ts)
        y.backward(grad.to(y.dtype))
        got.append([y.detach()] + [t.grad for t in ts])
    for fused, eager in zip(*got):
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5, equal_nan=True)
    (result,) = capture.results
    return result


def _inputs(nan_in_z=True):
    g = torch.Generator().manual_seed(0)
    x, w, z = torch.randn(B, S, D, generator=g), 1 + 0.1 * torch.randn(D, generator=g), torch.randn(B, S, D, generator=g)
    if nan_in_z:
        z[0, 1, 3] = float("nan")
    return [x, w, z]


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def gated_by_square(x, w, z):  # a user's gate on z*z (>= 0, or NaN): its backward where(z*z >= 0, dy, 0)
    return torch.where(z * z >= 0, rms(x, w), 0) + z


def gated_by_mean_square(x, w, z):  # the same gate on another tensor's mean square, one per row
    return torch.where(z.pow(2).mean(-1, keepdim=True) >= 0, rms(x, w), 0) + z


@pytest.mark.parametrize("fn", [gated_by_square, gated_by_mean_square], ids=lambda f: f.__name__)
def test_a_users_gate_on_a_value_that_may_be_nan_is_not_read_as_passing(fn):
    """where(v >= 0, dy, 0) with v >= 0 or NaN passes 0 where v is NaN: once read as dy (the norm's dx and dgamma off by
    0.46 and 0.36 where z is NaN, dy finite), now only where each term of what it passes is NaN there too."""
    _eager_and_compiled(fn, _inputs())


def zero_clamped(x, w, z):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).clamp(min=0) + 1e-6) * w + z


def test_zero_clamped_norm_still_fuses_both_ways_with_nan_and_inf_rows():
    x, w, z = _inputs(nan_in_z=False)
    x[0, 1, 3], x[1, 2, 0] = float("nan"), float("inf")
    result = _eager_and_compiled(zero_clamped, [x, w, z])
    assert result.fused(RMS) == 1 and result.fused(RMS_GRAD) == 1, (result.sites, result.misses)


def clamped_positive(x, w):  # clamp at 1e-3 > 0: moves every mean square below it
    return x * 1e-2 * torch.rsqrt((x * 1e-2).pow(2).mean(-1, keepdim=True).clamp(min=1e-3) + 1e-6) * w


def clamped_with_max(x, w):  # clamp(ms, 0, 0.5): moves the larger ones
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).clamp(0, 0.5) + 1e-6) * w


def clamped_max_only(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).clamp(max=0.5) + 1e-6) * w


def clamped_mean_of_x(x, w):  # mean(x) may be negative: clamp moves it
    return x * torch.rsqrt(x.mean(-1, keepdim=True).clamp(min=0) + x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def clamped_shifted_square(x, w):  # mean(x*x) - 1 may be negative
    return x * torch.rsqrt((x.pow(2).mean(-1, keepdim=True) - 1).clamp(min=0) + 1e-6) * w


def clamped_tensor_bound(x, w):  # clamp_min by a tensor: no number bound
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).clamp_min(w[:1] - 2) + 1e-6) * w


def clamped_nan_bound(x, w, z):  # clamp(v, min=nan) is NaN everywhere
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).clamp(min=float("nan")) + 1e-6) * w + z


def test_a_clamp_at_nan_is_not_read_as_its_operand():
    """clamp(v, min=nan) is NaN (nan <= 0 is False): outputs and gradients NaN as eager's, nothing fused."""
    result = _eager_and_compiled(clamped_nan_bound, _inputs(nan_in_z=False))
    assert result.fused(RMS) == 0 and result.fused(RMS_GRAD) == 0, result.sites


def clamped_input(x, w):  # a clamp of x (moves negative x), not of the mean square
    h = x.clamp(min=0)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def relu_mean_square(x, w):  # relu(ms) is ms too; its backward gates with <= 0, not read: fused or a miss, values equal
    return x * torch.rsqrt(torch.relu(x.pow(2).mean(-1, keepdim=True)) + 1e-6) * w


MOVING = [clamped_positive, clamped_with_max, clamped_max_only, clamped_mean_of_x, clamped_shifted_square,
          clamped_tensor_bound]


@pytest.mark.parametrize("fn", MOVING, ids=lambda f: f.__name__)
def test_a_clamp_that_moves_values_is_never_fused(fn):
    """Every clamp here changes some mean square (or is not by numbers): outputs and gradients as eager's, nothing fused."""
    result = _norm_result(fn)
    assert result.fused(RMS) == 0 and result.fused(RMS_GRAD) == 0, result.sites


@pytest.mark.parametrize("fn", [clamped_input, relu_mean_square], ids=lambda f: f.__name__)
def test_other_clamps_near_a_norm_keep_values(fn):
    _norm_result(fn)


def _inference_inputs(dtype):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(B, S, D, generator=g).to(dtype), (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path, dynamic", [("backend", False), ("backend", True), ("inductor", False)])
@pytest.mark.parametrize("fn", [clamped_positive, clamped_with_max, clamped_shifted_square, clamped_mean_of_x],
                         ids=lambda f: f.__name__)
def test_moving_clamps_on_inference_are_not_fused(fn, dtype, path, dynamic):
    results = run_inference(fn, _inference_inputs(dtype), path, dynamic)
    assert not any(s.op == RMS for r in results for s in r.sites), [r.sites for r in results]
