"""Mean squares spelled otherwise than ``mean(x*x)``, found silent (neither fused nor a recorded miss).

A matrix product of x with itself (``einsum``, ``@``, ``bmm``), ``var(x) + mean(x)**2``, a clamp that
moves the mean square (a NaN bound), eps added outside the root: each is another function than the
fused ops' ``x * rsqrt(mean(x*x) + eps)`` in floating point, so it never fuses; it is one recorded miss
each way whose reason names the spelling and the one that fuses. Each program is compiled by the
``npu_fusion`` backend for training (forward and backward, outputs and gradients against eager by the
float64 criterion) and run under ``no_grad`` through the backend and Inductor."""
import pytest
import torch

from npu_fusion.plugin.options import forward_options
from npu_fusion_testing.capture import Capture
from test_attacks_inference import run_inference
from test_forward_fusion import calls, check

EPS = 1e-6
BOTH = dict.fromkeys(forward_options(), True)  # the forward rules' switches
NORM, NORM_GRAD = "rms_norm", "rms_norm_grad"
FUSING = "x.pow(2).mean(-1, keepdim=True)"  # what every reason says to write instead


def _statistic(mean_square):
    """A norm of x with weight w whose mean square is ``mean_square(x)``, eps inside the root."""
    return lambda x, w: x * torch.rsqrt(mean_square(x) + EPS) * w


def _bmm(x):
    d = x.shape[-1]
    return torch.bmm(x.reshape(-1, 1, d), x.reshape(-1, d, 1)).reshape(*x.shape[:-1], 1) / d


def _var_mean_square(x):
    var, mean = torch.var_mean(x, -1, keepdim=True, correction=0)
    return var + mean * mean


SPELLINGS = {  # name: (the norm of x with weight w, what its misses' reasons must name)
    "einsum": (_statistic(lambda x: torch.einsum("...d,...d->...", x, x).unsqueeze(-1) / x.shape[-1]),
               "matrix product of x with itself"),
    "matmul": (_statistic(lambda x: (x.unsqueeze(-2) @ x.unsqueeze(-1)).squeeze(-1) / x.shape[-1]),
               "matrix product of x with itself"),
    "bmm": (_statistic(_bmm), "matrix product of x with itself"),
    "variance_plus_squared_mean": (
        _statistic(lambda x: x.var(-1, keepdim=True, unbiased=False) + x.mean(-1, keepdim=True) ** 2),
        "var(x, unbiased=False) + mean(x)**2"),
    "var_mean": (_statistic(_var_mean_square), "var(x, unbiased=False) + mean(x)**2"),
    "unbiased_variance_plus_squared_mean": (
        _statistic(lambda x: x.var(-1, keepdim=True) + x.mean(-1, keepdim=True).pow(2)), "correction 1"),
    "vector_norm": (_statistic(lambda x: torch.linalg.vector_norm(x, dim=-1, keepdim=True).pow(2) / x.shape[-1]),
                    "linalg.vector_norm"),
    "clamped_above_zero": (_statistic(lambda x: x.pow(2).mean(-1, keepdim=True).clamp(min=1e-3)), "clamp(min=0.001)"),
    "clamped_from_above": (_statistic(lambda x: x.pow(2).mean(-1, keepdim=True).clamp(max=0.5)), "clamp(max=0.5)"),
    "eps_outside_the_root": (lambda x, w: x / (torch.sqrt(x.pow(2).mean(-1, keepdim=True)) + EPS) * w,
                             "eps is added outside the root (sqrt(mean(x*x)) + eps)"),
}


def _seeded(seed, *size):
    return torch.randn(*size, generator=torch.Generator().manual_seed(seed))


def _misses(results, op):
    return [m for r in results for m in r.misses if m.op == op]


@pytest.mark.parametrize("decompositions", ["none", "core"])
@pytest.mark.parametrize("name", SPELLINGS)
def test_trained_norm_is_one_named_miss_each_way(name, decompositions):
    """Forward and backward of a norm whose input and weight train: nothing fused, one miss each way naming the
    spelling and saying what fuses (the matrix products and var + mean**2 once silent both ways; vector_norm's
    backward once said only that the terms differ)."""
    norm, named = SPELLINGS[name]
    w = torch.nn.Parameter(_seeded(3, 16))
    x = _seeded(1, 2, 3, 16).requires_grad_()
    result, fw, bw = check(lambda x: norm(x, w), [x], [w], decompositions=decompositions, **BOTH)
    assert result.fused(NORM) == result.fused(NORM_GRAD) == 0 and not calls(fw, NORM) and not calls(bw, NORM_GRAD)
    for op in (NORM, NORM_GRAD):
        misses = _misses([result], op)
        assert len(misses) == 1 and named in misses[0].reason and FUSING in misses[0].reason, result.misses


@pytest.mark.parametrize("path, dynamic", [("backend", False), ("backend", True), ("inductor", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", SPELLINGS)
def test_inference_norm_is_one_named_miss(name, dtype, path, dynamic):
    """Under no_grad (the forward rule alone): eager's output, no fused norm, one miss naming the spelling (with
    dynamic=True too, where D and eps reach the graph as symbols and inputs)."""
    norm, named = SPELLINGS[name]
    x, w = _seeded(1, 2, 8, 64).to(dtype), _seeded(2, 64).to(dtype)
    results = run_inference(lambda x, w: norm(x.float(), w.float()).to(x.dtype), [x, w], path=path, dynamic=dynamic)
    misses = _misses(results, NORM)
    assert sum(r.fused(NORM) for r in results) == 0
    assert len(misses) == 1 and named in misses[0].reason and FUSING in misses[0].reason, misses


def _residual(norm, spelled_at):
    """Three norms on a residual stream, the one at ``spelled_at`` spelled by ``norm``, the others as the fused ops'."""
    plain = _statistic(lambda x: x.pow(2).mean(-1, keepdim=True))

    def stream(x, w):
        h = x
        for i in range(3):
            h = h + torch.tanh((norm if i == spelled_at else plain)(h, w))
        return h
    return stream


@pytest.mark.parametrize("spelled_at", [0, 2])
@pytest.mark.parametrize("name", ["einsum", "variance_plus_squared_mean", "clamped_above_zero", "eps_outside_the_root"])
def test_spelled_norm_on_a_residual_stream_is_its_own_miss(name, spelled_at):
    """Among norms that fuse: those fuse each way, the spelled one is one miss each way, about it alone."""
    norm, named = SPELLINGS[name]
    w = torch.nn.Parameter(1 + 0.1 * _seeded(3, 16))
    x = _seeded(1, 2, 3, 16).requires_grad_()
    result, _, _ = check(lambda x: _residual(norm, spelled_at)(x, w), [x], [w], **BOTH)
    assert result.fused(NORM) == result.fused(NORM_GRAD) == 2, result.misses
    for op in (NORM, NORM_GRAD):
        misses = _misses([result], op)
        assert len(misses) == 1 and named in misses[0].reason, result.misses


def norm_clamped_at_nan(x, w):
    return x * torch.rsqrt(torch.clamp(x.pow(2).mean(-1, keepdim=True), min=float("nan")) + EPS) * w


@pytest.mark.parametrize("train", [True, False], ids=["training", "no_grad"])
def test_mean_square_clamped_at_nan_is_a_miss_and_nan_as_eager(train):
    """clamp(v, min=nan) makes every value NaN: the output (and gradients) NaN as eager's, nothing fused, and one miss
    each way naming the clamp (once silent: a NaN bound is neither the identity nor eps as a lower bound)."""
    capture, got = Capture(target="generic", **BOTH), []
    for f in (torch.compile(norm_clamped_at_nan, backend=capture), norm_clamped_at_nan):
        torch._dynamo.reset()
        x, w = _seeded(1, 2, 3, 16).requires_grad_(train), _seeded(3, 16).requires_grad_(train)
        with torch.set_grad_enabled(train):
            y = f(x, w)
            if train:
                y.backward(torch.ones_like(y))
        got.append([y.detach()] + ([x.grad, w.grad] if train else []))
    for fused, eager in zip(*got):
        assert fused.isnan().all()
        torch.testing.assert_close(fused, eager, equal_nan=True)
    (result,) = capture.results
    assert result.fused(NORM) == result.fused(NORM_GRAD) == 0
    for op in (NORM, NORM_GRAD) if train else (NORM,):
        misses = _misses([result], op)
        assert len(misses) == 1 and "clamp(min=nan)" in misses[0].reason and FUSING in misses[0].reason, result.misses


def test_gram_matrix_is_no_mean_square():
    """A matrix product pairing rows (x @ x.mT, a Gram matrix) is no statistic per row: no RMSNorm miss names it, and the
    true norm beside it fuses each way."""
    w = torch.nn.Parameter(_seeded(3, 16))
    x = _seeded(1, 2, 3, 16).requires_grad_()

    def fn(x):
        gram = torch.rsqrt((x @ x.mT) / x.shape[-1] + 1.0)
        return gram @ _statistic(lambda x: x.pow(2).mean(-1, keepdim=True))(x, w)
    result, _, _ = check(fn, [x], [w], **BOTH)
    assert result.fused(NORM) == result.fused(NORM_GRAD) == 1 and not result.misses, result.misses
