"""SwiGLU against near misses and tricky programs: each site fuses, outputs and gradients by the
float64 criterion, or is ONE recorded miss per fused op with a reason, never silence; SwiGLU-like
sites the lanes domain cannot read (halves along another axis, a scale or a sign inside the
product, interleaved halves, a SiLU the program spells with ``sigmoid``) are recorded misses too;
the SiLU a decomposition table decomposed (Inductor's, core ATen's) is put back and fuses."""
import pytest
import torch
import torch.nn.functional as F

import npu_fusion
from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_grads, grad_error, run_grads
from npu_fusion_testing.capture import Capture

from test_swiglu import BACKWARD, FORWARD, H, ON, _fused, _inputs, _joint, _misses, check, chunked


def _outcome(capture):
    return _fused(capture, FORWARD), _fused(capture, BACKWARD)


def _one_miss_each(capture, reason):
    """No fusion, and exactly one miss per fused op whose reason says ``reason``."""
    assert _outcome(capture) == (0, 0)
    for op in (FORWARD, BACKWARD):
        misses = _misses(capture, op)
        assert len(misses) == 1 and reason in misses[0].reason, _joint(capture).misses


# -- SwiGLU-like sites the rules do not read: recorded, never silent ------------------------

def halves_along_axis_1(x, w):
    gate, up = (x @ w).chunk(2, dim=1)
    return F.silu(gate) * up


def halves_along_minus_2(x, w):
    gate, up = (x @ w).transpose(-1, -2).chunk(2, dim=-2)
    return F.silu(gate) * up


def scaled_inside(x, w):
    gate, up = (x @ w).chunk(2, dim=-1)
    return 2 * F.silu(gate) * up


def negated_up(x, w):
    gate, up = (x @ w).chunk(2, dim=-1)
    return F.silu(gate) * -up


def interleaved(x, w):
    h = x @ w
    return F.silu(h[..., ::2]) * h[..., 1::2]


@pytest.mark.parametrize("form, lead, reason", [
    (halves_along_axis_1, (2, 2 * H), "along axis 1"),
    (halves_along_minus_2, (2, 3), "along axis 1"),
    (scaled_inside, (2, 3), "constant, a sign"),
    (negated_up, (2, 3), "constant, a sign"),
    (interleaved, (2, 3), "interleave element by element"),
], ids=lambda v: getattr(v, "__name__", None))
def test_swiglu_like_site_the_rules_cannot_read_is_one_recorded_miss(form, lead, reason):
    _one_miss_each(check(form, _inputs(torch.float32, lead=lead)), reason)


def test_inductor_decomposed_silu_is_put_back_by_the_backend():
    """The backend compiling with Inductor's table (SiLU ``x / (1 + exp(-x))``, its backward its
    formula) puts both back where the graph holds exactly that table's trace of them: fused both
    ways; with a symbolic width (``dynamic=True``, where the lanes domain reads no halves) one miss
    per fused op saying why, and the unfused graph is the table's again (no ``silu`` left)."""
    from npu_fusion.compat import inductor_decompositions

    for dynamic in (False, True):
        capture = Capture(decompositions=inductor_decompositions(), **ON)
        torch._dynamo.reset()
        inputs = _inputs(torch.float32)
        fused, grad_outputs = run_grads(torch.compile(chunked, backend=capture, dynamic=dynamic), inputs)
        unfused, _ = run_grads(chunked, inputs, (), grad_outputs)
        for f, e, x in zip(fused, unfused, float64_grads(chunked, inputs, (), grad_outputs)):
            assert_close_as_unfused(f, e, x, factor=MODEL_FACTOR)
        if not dynamic:
            assert _outcome(capture) == (1, 1) and not _joint(capture).misses, _joint(capture).misses
        else:
            _one_miss_each(capture, "symbolic")
            left = [n for g in capture.after for n in g.nodes if n.target in (torch.ops.aten.silu.default,
                                                                               torch.ops.aten.silu_backward.default)]
            assert not left, left


def by_hand(x, w):  # SiLU spelled out: not fused (aten.silu rounds otherwise), one recorded miss
    a, b = (x @ w).chunk(2, dim=-1)
    return a * torch.sigmoid(a) * b


def halves_of_a_cat(x, w):  # two projections joined, then halved: Llama's MLP in disguise, no site
    h = torch.cat([x @ w[:, :H], x @ w[:, H:]], dim=-1)
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b


def test_silu_by_hand_is_one_miss_each_way_and_a_cat_of_two_projections_is_no_site():
    """``a * sigmoid(a)`` written by the program (no table decomposed it: nothing is put back): one
    miss per fused op, the forward's too (on the joint graph as on an inference graph)."""
    capture = check(by_hand, _inputs(torch.float32))
    _one_miss_each(capture, "spelled with sigmoid")
    assert all("F.silu" in m.reason for m in _joint(capture).misses)
    capture = check(halves_of_a_cat, _inputs(torch.float32))
    assert _outcome(capture) == (0, 0) and not _joint(capture).misses, _joint(capture).misses


def test_inductor_path_fuses_swiglu_and_keeps_it_right():
    """Through ``install_inductor`` the pass puts back the SiLU Inductor decomposed: the program
    fuses both ways, compiles, runs and keeps its gradients."""
    from npu_fusion.compat import no_compile_caches
    from npu_fusion.plugin.inductor import uninstall_inductor
    from npu_fusion.plugin.pass_manager import HISTORY

    npu_fusion.install_inductor(target="generic", strict=True, **ON)
    try:
        torch._dynamo.reset()
        inputs = _inputs(torch.bfloat16)
        mark = HISTORY.mark()
        with no_compile_caches():
            fused, grad_outputs = run_grads(torch.compile(chunked), inputs)
        unfused, _ = run_grads(chunked, inputs, (), grad_outputs)
        for f, e, x in zip(fused, unfused, float64_grads(chunked, inputs, (), grad_outputs)):
            assert_close_as_unfused(f, e, x, factor=MODEL_FACTOR)
        (joint,) = [r for r in HISTORY.since(mark) if r.graph == "joint"]
        assert (joint.fused(FORWARD), joint.fused(BACKWARD)) == (1, 1) and not joint.misses, joint.misses
    finally:
        uninstall_inductor()
        torch._dynamo.reset()


# -- near misses the lanes domain reads: one recorded miss per op ------------------------------

def chunk4_first_two(x, w):
    a, b, _, _ = (x @ w).chunk(4, dim=-1)
    return F.silu(a) * b


def silu_times_its_input(x, w):
    a, _ = (x @ w).chunk(2, dim=-1)
    return F.silu(a) * a


def plus_the_gate(x, w):  # the gate read besides the product: its other gradient added to the product's
    a, b = (x @ w).chunk(2, dim=-1)
    return F.silu(a) * b + a


@pytest.mark.parametrize("form, reason", [
    (chunk4_first_two, "not its two halves"),
    (silu_times_its_input, "not its two halves"),
], ids=lambda v: getattr(v, "__name__", None))
def test_wrong_pieces_are_one_recorded_miss_each(form, reason):
    _one_miss_each(check(form, _inputs(torch.float32)), reason)


def test_gate_also_read_elsewhere_fuses_both_ways():
    """The gate's other gradient is added to the product's before the halves join: the fused dx's
    halves replace the product's two, the sum stays (outputs and gradients checked by ``check``)."""
    capture = check(plus_the_gate, _inputs(torch.bfloat16))
    assert _outcome(capture) == (1, 1) and not _joint(capture).misses, _joint(capture).misses


# -- tricky programs that fuse: outputs and gradients by the float64 criterion -----------------

def factor_order_swapped(x, w):
    a, b = (x @ w).chunk(2, dim=-1)
    return b * F.silu(a)


def silu_in_place(x, w):
    a, b = (x @ w).chunk(2, dim=-1)
    return F.silu(a.clone(), inplace=True) * b


def output_updated_in_place(x, w):
    a, b = (x @ w).chunk(2, dim=-1)
    y = F.silu(a) * b
    y.mul_(2)
    return y


def leading_axes_permuted_first(x, w):
    a, b = (x @ w).permute(1, 0, 2).chunk(2, dim=-1)
    return F.silu(a) * b


def moe_experts(x, w):  # per-expert gate_up by index_select and bmm
    ws = w.index_select(0, torch.tensor([2, 0, 1]))
    a, b = torch.bmm(x, ws).chunk(2, dim=-1)
    return F.silu(a) * b


@pytest.mark.parametrize("form, inputs", [
    (factor_order_swapped, lambda: _inputs(torch.bfloat16)),
    (silu_in_place, lambda: _inputs(torch.float32)),
    (output_updated_in_place, lambda: _inputs(torch.bfloat16)),
    (leading_axes_permuted_first, lambda: _inputs(torch.float32)),
    (chunked, lambda: _inputs(torch.float32, lead=(2, 3, 5))),  # 4-D x
    (chunked, lambda: _inputs(torch.float16, width=2)),  # halves of one lane
    (chunked, lambda: [_inputs(torch.float32)[0].detach(), _inputs(torch.float32)[1]]),  # weight grad only
    (moe_experts, lambda: [torch.randn(3, 4, 16, requires_grad=True), (torch.randn(3, 16, 2 * H) / 4).requires_grad_()]),
], ids=["order", "inplace_silu", "y_mul_", "permute_first", "4d", "width2", "weight_only", "moe"])
def test_tricky_program_fuses_both_ways(form, inputs):
    capture = check(form, inputs())
    assert _outcome(capture) == (1, 1) and not _joint(capture).misses, _joint(capture).misses


def test_empty_batch_fuses_and_the_criterion_reads_empty_tensors():
    """An empty batch on the generic target (the reference kernels run it); the float64 criterion
    itself must accept empty results (it used to raise on their max)."""
    assert grad_error(torch.empty(0, 4), torch.empty(0, 4), torch.empty(0, 4, dtype=torch.float64)).ok
    capture = check(chunked, _inputs(torch.float32, lead=(0, 3)))
    assert _outcome(capture) == (1, 1)


def test_swiglu_meta_kernels_name_the_constraint():
    ops = torch.ops.npu_fusion
    for device in ("meta", "cpu"):
        with pytest.raises(Exception, match="even"):
            ops.swiglu(torch.zeros(3, 5, device=device), -1)
        with pytest.raises(Exception, match="out of range"):
            ops.swiglu(torch.zeros(2, 4, device=device), 2)
        with pytest.raises(Exception, match="dtype"):
            ops.swiglu(torch.zeros(2, 4, dtype=torch.float64, device=device), -1)
        with pytest.raises(Exception, match="halved"):
            ops.swiglu_grad(torch.zeros(3, 4, device=device), torch.zeros(3, 4, device=device), -1)
        with pytest.raises(Exception, match="must equal"):
            ops.swiglu_grad(torch.zeros(3, 2, dtype=torch.bfloat16, device=device), torch.zeros(3, 4, device=device), -1)
        assert ops.swiglu(torch.zeros(4, 3, device=device), 0).shape == (2, 3)
        assert ops.swiglu_grad(torch.zeros(2, 3, device=device), torch.zeros(4, 3, device=device), 0).shape == (4, 3)
