"""SwiGLU whose halves the lanes domain cannot read as pieces of the projection, read over the value the split
cuts (``patterns/swiglu_views.py``): the rows of a ``[..., 2, H]`` view that merges the leading axes or of a
projection plus a number, and the halves of a projection plus a number. Each fuses both ways with outputs and
gradients by the float64 criterion, and its inference forward too; a near miss among them stays one; a
merged leading shape under dynamic shapes, which no emitted view can name, is one recorded miss each way."""
import pytest
import torch
import torch.nn.functional as F

from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_grads, float64_output, run_grads
from npu_fusion_testing.capture import Capture

from test_swiglu import BACKWARD, FORWARD, H, ON, _inputs, check

B, S = 2, 3


def flattened_unbind(x, w):  # [B*S, 2, H]: the leading axes merged, the rows the halves
    gate, up = (x @ w).reshape(B * S, 2, H).unbind(1)
    return (F.silu(gate) * up).view(B, S, H)


def flattened_chunk(x, w):
    gate, up = (x @ w).reshape(B * S, 2, H).chunk(2, 1)
    return (F.silu(gate) * up).view(B, S, H)


def flattened_select(x, w):
    h = (x @ w).reshape(B * S, 2, H)
    return (F.silu(h[:, 0]) * h[:, 1]).view(B, S, H)


def flattened_gate_reused(x, w):
    gate, up = (x @ w).reshape(B * S, 2, H).unbind(1)
    return (F.silu(gate) * up + gate * 2).view(B, S, H)


def offset_rows(x, w):  # a projection plus a number, viewed [..., 2, H]
    gate, up = (x @ w + 0.1).view(B, S, 2, H).unbind(-2)
    return F.silu(gate) * up


def offset_rows_upcast(x, w):  # its rows upcast to float32, the product cast back
    gate, up = (x @ w + 0.1).view(B, S, 2, H).float().unbind(-2)
    return (F.silu(gate) * up).to(x.dtype)


def rows_of_a_sum(x, w):  # the view first, a number added to it, then its rows
    gate, up = ((x @ w).view(B, S, 2, H) + 0.1).unbind(-2)
    return F.silu(gate) * up


def offset_halves(x, w):  # a projection plus a number, chunked along its last axis
    gate, up = (x @ w + 0.1).chunk(2, -1)
    return F.silu(gate) * up


FUSED = [flattened_unbind, flattened_chunk, flattened_select, flattened_gate_reused, offset_rows, offset_rows_upcast,
         rows_of_a_sum, offset_halves]


def _joint(capture):
    (result,) = [r for r in capture.results if r.graph == "joint"]
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("form", FUSED, ids=lambda f: f.__name__)
def test_value_the_split_cuts_is_x_both_ways(form, dtype):
    """Fused both ways (outputs and gradients against eager by the float64 criterion), no miss, and the
    inference graph's forward fused too."""
    inputs = _inputs(dtype)
    result = _joint(check(form, inputs))
    assert sorted(s.op for s in result.sites) == [FORWARD, BACKWARD] and not result.misses, result.misses
    capture = Capture(**ON)
    torch._dynamo.reset()
    x, w = [t.detach() for t in inputs]
    with torch.no_grad():
        got = torch.compile(form, backend=capture)(x, w)
    assert_close_as_unfused(got, form(x, w), float64_output(form, [x, w]), factor=MODEL_FACTOR)
    (inference,) = capture.results
    assert inference.fused(FORWARD) == 1 and not inference.misses


def flattened_swapped(x, w):  # silu on the second row: a near miss over the view too
    up, gate = (x @ w).reshape(B * S, 2, H).unbind(1)
    return (F.silu(gate) * up).view(B, S, H)


def test_swapped_rows_of_a_flattened_view_are_one_miss_each_way():
    result = _joint(check(flattened_swapped, _inputs(torch.float32)))
    assert not result.sites
    assert sorted(m.op for m in result.misses) == [FORWARD, BACKWARD]
    for miss in result.misses:
        assert "silu gates the second half" in miss.reason, miss.reason


def flattened_dynamic(x, w):
    b, s, _ = x.shape
    gate, up = (x @ w).reshape(b * s, 2, H).unbind(1)
    return (F.silu(gate) * up).view(b, s, H)


def test_flattened_view_with_dynamic_batch_is_one_miss_each_way():
    """Under ``dynamic=True`` the merged leading size is ``B * S``, which no graph input is: the rewrite
    cannot name it in the views it emits, so each op is one recorded miss saying so; the values are right."""
    x, w = _inputs(torch.float32)
    capture = Capture(**ON)
    torch._dynamo.reset()
    compiled = torch.compile(flattened_dynamic, backend=capture, dynamic=True)
    fused, grad_outputs = run_grads(compiled, [x, w])
    unfused, _ = run_grads(flattened_dynamic, [x, w], (), grad_outputs)
    for f, e, r in zip(fused, unfused, float64_grads(flattened_dynamic, [x, w], (), grad_outputs)):
        assert_close_as_unfused(f, e, r, factor=MODEL_FACTOR)
    (result,) = capture.results
    assert not result.sites and sorted(m.op for m in result.misses) == [FORWARD, BACKWARD]
    for miss in result.misses:
        assert "is neither a graph input nor an axis of one" in miss.reason, miss.reason
