"""Near misses and realistic programs on inference graphs, found wrong, crashing or silent by an attacking session.

Each program runs under ``torch.no_grad()`` through ``backend="npu_fusion"`` (the recording backend
``Capture``, ``strict``) or Inductor after ``install_inductor``, static and with ``dynamic=True``: its
outputs equal eager's (float32 within 1e-5, bfloat16 by the float64 criterion), with eager's dtypes
and shapes, and each norm and rotation ends fused or as one recorded miss."""
import contextlib

import pytest
import torch

from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused
from npu_fusion.measure.recording import InductorRecorder
from npu_fusion.plugin.options import FusionOptions
from npu_fusion_testing.capture import Capture

ROPE = "rotary_position_embedding"


def _seeded(seed, *size):
    return torch.randn(*size, generator=torch.Generator().manual_seed(seed))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def _tables(dtype, seq=8, dim=64):
    angles = _seeded(2, seq, dim // 2)
    return tuple(torch.cat((f(angles), f(angles)), -1).to(dtype) for f in (torch.cos, torch.sin))


def run_inference(fn, inputs, path="backend", dynamic=False, **options):
    """``fn`` compiled on ``path`` and run under no_grad on copies of ``inputs``, checked against eager
    (and float64 for bfloat16); returns the pass's results."""
    torch._dynamo.reset()
    if path == "backend":
        recorder, installed = Capture(target="generic", **options), contextlib.nullcontext()
    else:
        recorder = InductorRecorder(FusionOptions.from_mapping(dict({"target": "generic", "strict": True}, **options)))
        installed = recorder.installed()
    with installed, torch.no_grad():
        got = torch.compile(fn, backend=recorder, dynamic=dynamic)(*(t.clone() for t in inputs))
    with torch.no_grad():
        eager, exact = fn(*(t.clone() for t in inputs)), fn(*(t.double() for t in inputs))
    assert got.dtype == eager.dtype and got.shape == eager.shape
    if eager.dtype == torch.float32:
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    else:
        assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)
    assert recorder.results and all(r.graph == "inference" and r.error is None for r in recorder.results)
    return recorder.results


# -- a rotation summed by addcmul: neither fused nor recorded ---------------------------------------

def rope_addcmul(q, cos, sin):
    return torch.addcmul(q * cos, rotate_half(q), sin)


def rope_addcmul_rotated_first(q, cos, sin):
    return torch.addcmul(rotate_half(q) * sin, q, cos)


def rope_addcmul_valued(q, cos, sin):
    return torch.addcmul(q * cos, rotate_half(q), -sin, value=-1)


def rope_addcmul_in_place(q, cos, sin):
    y = q * cos
    return y.addcmul_(rotate_half(q), sin)


ADDCMUL_SPELLINGS = [rope_addcmul, rope_addcmul_rotated_first, rope_addcmul_valued, rope_addcmul_in_place]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path, dynamic", [("backend", False), ("backend", True), ("inductor", False)])
@pytest.mark.parametrize("fn", ADDCMUL_SPELLINGS, ids=lambda f: f.__name__)
def test_rotation_summed_by_addcmul_fuses(fn, path, dynamic, dtype):
    """``addcmul(q * cos, rotate_half(q), sin)`` (and its in-place, valued and swapped spellings) is a
    RoPE: the lane evaluator read no ``addcmul`` (an opaque leaf), so the rotation neither fused nor
    was recorded as a miss (the leftover finder looked for add/sub only). Now it fuses, output as eager."""
    cos, sin = _tables(dtype)
    results = run_inference(fn, [_seeded(1, 2, 4, 8, 64).to(dtype), cos, sin], path=path, dynamic=dynamic)
    assert sum(r.fused(ROPE) for r in results) == 1
    assert [m for r in results for m in r.misses] == []


def test_rotation_summed_by_addcmul_fuses_on_the_joint_graph():
    """Trained, the same spelling's backward fused but its forward was one recorded miss: both fuse now,
    the output and q's gradient as eager's."""
    cos, sin = _tables(torch.float32)
    q = _seeded(1, 2, 4, 8, 64).requires_grad_()
    torch._dynamo.reset()
    capture = Capture(target="generic")
    got = torch.compile(rope_addcmul, backend=capture)(q, cos, sin)
    (grad,) = torch.autograd.grad(got, q, _seeded(3, *got.shape))
    q_eager = q.detach().clone().requires_grad_()
    eager = rope_addcmul(q_eager, cos, sin)
    (grad_eager,) = torch.autograd.grad(eager, q_eager, _seeded(3, *got.shape))
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(grad, grad_eager)
    (result,) = capture.results
    assert result.fused(ROPE) == 1 and result.fused(ROPE + "_grad") == 1 and not result.misses, result.misses


def test_addcmul_that_is_no_rotation_stays():
    """An ``addcmul`` of x moved by a quarter of the head (no mode's split point) is no rotation:
    nothing fuses, one recorded miss, the output as eager's."""
    cos, sin = _tables(torch.float32)

    def near_miss(q, cos, sin):
        return torch.addcmul(q * cos, torch.cat((q[..., 16:], q[..., :16]), -1), sin)

    results = run_inference(near_miss, [_seeded(1, 2, 4, 8, 64), cos, sin])
    assert sum(r.fused(ROPE) for r in results) == 0
    assert len([m for r in results for m in r.misses if m.op == ROPE]) == 1


# -- a rotation of no positions: fused, and its unfused computation left behind ---------------------

@pytest.mark.parametrize("path", ["backend", "inductor"])
def test_rotation_of_an_empty_sequence_is_fused_once(path):
    """q of sequence length 0: the site fused with an empty region (nothing interpreted at no
    position), so the replaced sum and its terms stayed in the graph, dead, and the leftover finder
    recorded the fused rotation as a miss too. The replaced output's dead inputs are erased now:
    fused, no miss, the empty output as eager's."""
    cos, sin = _tables(torch.float32)
    results = run_inference(lambda q, c, s: q * c + rotate_half(q) * s,
                            [_seeded(1, 2, 4, 0, 64), cos[:0], sin[:0]], path=path)
    assert sum(r.fused(ROPE) for r in results) == 1
    assert [m for r in results for m in r.misses] == []


# -- RMS statistics spelled so that neither the forward rule nor the leftover finder saw them (once silent) --

def norm_clamped_statistic(x, w):
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True).clamp(min=0)
    return w * (x32 * torch.rsqrt(variance + 1e-6)).to(x.dtype)


def norm_clamp_min_statistic(x, w):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).clamp_min(0.0) + 1e-6)).to(x.dtype)


def norm_of_vector_norm(x, w):
    x32 = x.float()
    mean_square = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).pow(2) / x.shape[-1]
    return w * (x32 * torch.rsqrt(mean_square + 1e-6)).to(x.dtype)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("path", ["backend", "inductor"])
@pytest.mark.parametrize("fn", [norm_clamped_statistic, norm_clamp_min_statistic], ids=lambda f: f.__name__)
def test_rms_statistic_clamped_at_zero_fuses(fn, path, dynamic):
    """A mean of squares clamped at 0 (a guard some codebases add; clamp keeps NaN, so on a mean of squares it
    is the identity): the output as eager's, and the norm fused, with no miss (once silent: neither)."""
    x, w = _seeded(1, 2, 8, 64).to(torch.bfloat16), _seeded(2, 64).to(torch.bfloat16)
    results = run_inference(fn, [x, w], path=path, dynamic=dynamic)
    assert sum(r.fused("rms_norm") for r in results) == 1
    assert [m for r in results for m in r.misses] == []


def test_rms_statistic_clamped_at_zero_keeps_nan_as_eager():
    """A row of NaN: clamp(NaN, min=0) is NaN, so the fused norm's row is NaN as eager's, and the other rows equal."""
    x, w = _seeded(1, 2, 8, 64), _seeded(2, 64)
    x[0, 3, 5] = float("nan")
    torch._dynamo.reset()
    recorder = Capture(target="generic")
    with torch.no_grad():
        got = torch.compile(norm_clamped_statistic, backend=recorder)(x.clone(), w)
        eager = norm_clamped_statistic(x.clone(), w)
    assert sum(r.fused("rms_norm") for r in recorder.results) == 1
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert got[0, 3].isnan().all() and not got[0, 2].isnan().any()


@pytest.mark.parametrize("path", ["backend", "inductor"])
def test_rms_statistic_through_vector_norm_is_one_recorded_miss(path):
    """vector_norm(x)**2 / D (a square root then a square: rounded otherwise than the fused op's mean of x*x):
    the output as eager's, and one recorded miss that names vector_norm and the spelling that fuses (once silent)."""
    x, w = _seeded(1, 2, 8, 64).to(torch.bfloat16), _seeded(2, 64).to(torch.bfloat16)
    results = run_inference(norm_of_vector_norm, [x, w], path=path)
    misses = [m for r in results for m in r.misses if m.op == "rms_norm"]
    assert sum(r.fused("rms_norm") for r in results) == 0
    assert len(misses) == 1 and "vector_norm" in misses[0].reason and "x.pow(2).mean(-1" in misses[0].reason, misses
