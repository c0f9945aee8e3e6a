"""No silent misses, on the programs an adversarial session found silent: every RMSNorm and RoPE
application ends fused or as a recorded miss whose reason says what to change. Each program is
compiled by the ``npu_fusion`` backend (target ``generic``), with the forward rules off and on;
outputs and every gradient pass the float64 criterion against eager (``check``)."""
import pytest
import torch
import torch.nn.functional as F

from npu_fusion.patterns.rms_statistic import CLAMPED_EPS_REASON, DIVISION_REASON, KEEPDIM_REASON
from npu_fusion.patterns.rope.sites import SCALED_COPY_REASON
from npu_fusion.plugin.options import forward_options
from npu_fusion_testing.capture import compile_and_compare
from test_attacks_backend import GATE_UP, _halves, compiled_step
from test_forward_fusion import calls, check

EPS = 1e-6
BOTH = dict.fromkeys(forward_options(), True)  # the forward rules' switches
BACKWARD_ALONE = dict.fromkeys(forward_options(), False)
NORM, NORM_GRAD = "rms_norm", "rms_norm_grad"
ROPE, ROPE_GRAD = "rotary_position_embedding", "rotary_position_embedding_grad"


def _seeded(seed, *size):
    return torch.randn(*size, generator=torch.Generator().manual_seed(seed))


def _reasons(result, op):
    return [m.reason for m in result.misses if m.op == op]


# -- RMSNorm spellings read by value where a form reads them; recorded, with the spelling that fuses,
# where none does ------------------------------------------------------------------------------------

NORMS = {  # name: (the norm of x with weight w, the reason a miss must give, whether its forward fuses)
    "division_by_the_root": (lambda x, w: x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w,
                             DIVISION_REASON, True),
    "statistic_without_keepdim": (lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1) + EPS).unsqueeze(-1) * w,
                                  KEEPDIM_REASON, True),
}


@pytest.mark.parametrize("options", [BACKWARD_ALONE, BOTH], ids=["backward", "forward_too"])
@pytest.mark.parametrize("name", NORMS)
def test_norm_spelling_of_a_trained_input_fuses_its_backward(name, options):
    """Its dx and dgamma are read by value (the statistic's power, the axes put back by the
    unsqueeze), and so is its forward."""
    norm, reason, forward_fuses = NORMS[name]
    w = torch.nn.Parameter(_seeded(3, 16))
    x = _seeded(1, 2, 3, 16).requires_grad_()
    result, _, _ = check(lambda x: norm(x, w), [x], [w], **options)
    assert result.fused(NORM_GRAD) == 1 and not _reasons(result, NORM_GRAD), result.misses
    if options["rms_norm_forward"]:
        assert result.fused(NORM) == forward_fuses, result.misses
        assert _reasons(result, NORM) == ([] if forward_fuses else [reason]), result.misses


@pytest.mark.parametrize("name", NORMS)
def test_norm_spelling_of_an_input_without_gradient(name):
    """The norm's input and weight take no gradient: only the forward rule sees the norm; it fuses
    or is one miss saying how to fuse it."""
    norm, reason, forward_fuses = NORMS[name]
    h, w = _seeded(2, 2, 3, 16), _seeded(3, 16)
    x = _seeded(5, 2, 3, 16).requires_grad_()
    result, _, _ = check(lambda x: x * norm(h, w), [x], **BOTH)
    assert result.fused(NORM) == forward_fuses and _reasons(result, NORM) == ([] if forward_fuses else [reason]), \
        result.misses


@pytest.mark.parametrize("name", NORMS)
def test_norm_spelling_whose_weight_alone_takes_gradient_is_a_miss(name):
    """Only the weight's gradient is computed (dgamma alone): the backward scan records it."""
    norm, reason, _ = NORMS[name]
    h, w = _seeded(2, 2, 3, 16), torch.nn.Parameter(_seeded(3, 16))
    x = _seeded(5, 2, 3, 16).requires_grad_()
    result, _, _ = check(lambda x: x * norm(h, w), [x], [w])
    assert result.fused(NORM_GRAD) == 0 and _reasons(result, NORM_GRAD) == [reason], result.misses


#: statistics spelled otherwise than ``rsqrt``: no form of either direction reads their dx (the
#: backward records it where dx normalizes), and the forward records the statistic
OTHER_ROOTS = {
    "reciprocal_of_the_root": lambda x: torch.reciprocal(torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)),
    "one_over_the_root": lambda x: 1.0 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS),
}


@pytest.mark.parametrize("name", OTHER_ROOTS)
def test_norm_with_another_root_is_one_miss_each_way(name):
    """Once silent forward misses (the reciprocal of the root is no statistic the forward scan looked
    for) and a norm judged twice (``** -0.5``: its dx reads ``(ms + eps) ** -1.5``, no cube of the
    statistic, a recorded near miss, while its dgamma fused alone as a norm without dx): each is one
    backward miss and one forward miss, nothing fused, with outputs and gradients checked."""
    statistic = OTHER_ROOTS[name]
    w = torch.nn.Parameter(_seeded(3, 16))
    x = _seeded(1, 2, 3, 16).requires_grad_()
    result, _, _ = check(lambda x: x * statistic(x) * w, [x], [w], **BOTH)
    assert result.fused(NORM_GRAD) == result.fused(NORM) == 0, result.misses
    assert len(_reasons(result, NORM_GRAD)) == len(_reasons(result, NORM)) == 1, result.misses


# -- RoPE -----------------------------------------------------------------------------------------

ANGLES = _seeded(2, 7, 16)
COS, SIN = ANGLES.cos(), ANGLES.sin()


def _rotate_half(q):
    return torch.cat((-q[..., 8:], q[..., :8]), -1)


def _rope(q, cos=COS[:6], sin=SIN[:6]):
    return q * cos + _rotate_half(q) * sin


def test_rope_reading_a_scaled_x_in_its_rotated_term_is_a_forward_miss():
    q = _seeded(1, 2, 4, 6, 16).requires_grad_()
    result, fw, _ = check(lambda q: (q * COS[:6] + _rotate_half(2 * q) * SIN[:6]) * 2, [q], **BOTH)
    assert not calls(fw, ROPE) and _reasons(result, ROPE) == [SCALED_COPY_REASON], result.misses


def test_the_scaled_table_the_forward_miss_suggests_fuses():
    q = _seeded(1, 2, 4, 6, 16).requires_grad_()
    result, fw, _ = check(lambda q: (q * COS[:6] + _rotate_half(q) * (2 * SIN[:6])) * 2, [q], **BOTH)
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == len(calls(fw, ROPE)) == 1, result.misses


ACCUMULATED = {  # name: (program of q, rotations): dx summed with other gradients of q
    "x_read_again_by_a_product": (lambda q: _rope(q) * q, 1),
    "x_added_to_its_rotation": (lambda q: _rope(q) + q, 1),
    "two_rotations_of_one_x": (lambda q: _rope(q) + _rope(q, COS[1:], SIN[1:]) * 2, 2),
}


@pytest.mark.parametrize("options", [BACKWARD_ALONE, BOTH], ids=["backward", "forward_too"])
@pytest.mark.parametrize("name", ACCUMULATED)
def test_rope_dx_summed_with_other_gradients_of_x_fuses(name, options):
    program, rotations = ACCUMULATED[name]
    q = _seeded(1, 2, 4, 6, 16).requires_grad_()
    result, fw, bw = check(lambda q: program(q) * 2, [q], **options)
    assert result.fused(ROPE_GRAD) == len(calls(bw, ROPE_GRAD)) == rotations, (result.sites, result.misses)
    assert result.fused(ROPE) == len(calls(fw, ROPE)) == (rotations if options["rope_forward"] else 0)
    assert not result.misses, result.misses


@pytest.mark.parametrize("name", ["x_read_again_by_a_product", "two_rotations_of_one_x"])
def test_rope_dx_summed_with_other_gradients_of_a_bf16_x_fuses(name):
    """The other gradients are added back to the fused dx in the program's dtype."""
    program, rotations = ACCUMULATED[name]
    q = _seeded(1, 2, 4, 6, 16).bfloat16().requires_grad_()
    result, _, bw = check(lambda q: program(q) * 2, [q])
    assert result.fused(ROPE_GRAD) == len(calls(bw, ROPE_GRAD)) == rotations, (result.sites, result.misses)


# -- a backward whose forward is a recorded miss ---------------------------------------------------

def _clamped_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS).clamp(max=3.0) * w


def _sin_scaled_after_the_product(q, cos, sin):
    return q * cos + _rotate_half(q) * sin * 0.5


#: programs whose forward rule records one miss and whose backward no backward scan sees (a gradient
#: scaled by a clamped rstd, no RMS statistic; tables that are inputs, sin scaled after the product):
#: name: (program, its inputs, which take a gradient, the forward op, the backward op)
FORWARD_MISSED = {
    "rstd_clamped": (_clamped_norm, lambda: [_seeded(1, 2, 3, 16), 1 + 0.1 * _seeded(3, 16)], (1, 1), NORM, NORM_GRAD),
    "sin_scaled_after_the_product": (_sin_scaled_after_the_product, lambda: [_seeded(1, 2, 4, 6, 16), COS[:6], SIN[:6]],
                                     (1, 0, 0), ROPE, ROPE_GRAD),
}


@pytest.mark.parametrize("name", FORWARD_MISSED)
def test_a_backward_whose_forward_is_a_recorded_miss_is_one_miss_too(name):
    """Once silent on the joint graph: the forward rule recorded its miss, no backward scan saw the
    backward. Now one miss each way, the backward's saying what the forward found, with outputs and
    gradients checked."""
    program, make, grads, forward_op, backward_op = FORWARD_MISSED[name]
    inputs = [t.requires_grad_(bool(g)) for t, g in zip(make(), grads)]
    capture = compile_and_compare(program, inputs, **BOTH)
    (result,) = capture.results
    assert not result.sites, result.sites
    assert sorted(m.op for m in result.misses) == sorted([forward_op, backward_op]), result.misses
    (forward,) = [m for m in result.misses if m.op == forward_op]
    (backward,) = [m for m in result.misses if m.op == backward_op]
    assert forward.reason in backward.reason and forward.node in backward.reason, result.misses


@pytest.mark.parametrize("name", FORWARD_MISSED)
def test_a_forward_miss_whose_site_takes_no_gradient_has_no_backward_miss(name):
    """The site's inputs take no gradient (another value does): its backward is not in the graph, and
    only the forward's miss is recorded."""
    program, make, _, forward_op, _ = FORWARD_MISSED[name]
    y = _seeded(7, 16).requires_grad_()
    capture = compile_and_compare(lambda *inputs: program(*inputs[:-1]) * inputs[-1], [*make(), y], **BOTH)
    (result,) = capture.results
    assert [m.op for m in result.misses] == [forward_op] and not result.sites, result.misses


# -- near misses an attacking session found silent: each one recorded miss per op, with what to write ---------

def _clamped_eps_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).clamp_min(EPS)) * w


@pytest.mark.parametrize("options", [{}, BACKWARD_ALONE], ids=["every_rule", "backward_rules"])
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_norm_with_eps_as_a_lower_bound_of_the_mean_square_is_one_miss_each_way(training, options):
    """``rsqrt(clamp_min(mean(x*x), eps))`` is another function than the fused ops' ``rsqrt(mean(x*x) + eps)``:
    no form read it and no scan looked for it, silent both ways (in training and in the inference graph of
    ``torch.no_grad()``). Each graph now records one miss per op it holds (the weight's gradient alone, where x
    takes none), saying so and what fuses; outputs and gradients are eager's."""
    w = torch.nn.Parameter(_seeded(3, 16))
    x = _seeded(1, 2, 3, 16).requires_grad_(training)
    results = compiled_step(lambda x: _clamped_eps_norm(x, w), [x], [w], **options)
    forward_rule = not options
    for graph, ops in (("inference", [NORM]), ("joint", [NORM, NORM_GRAD] if forward_rule else [NORM_GRAD])):
        misses = [m for r in results if r.graph == graph for m in r.misses]
        assert not [s for r in results if r.graph == graph for s in r.sites], results
        assert sorted(m.op for m in misses) == sorted(ops if forward_rule or graph == "joint" else []), misses
        for m in misses:
            assert m.reason == CLAMPED_EPS_REASON and m.node.startswith("rsqrt" if m.op == NORM else "mul"), m
    assert "clamp_min" in CLAMPED_EPS_REASON and "x.pow(2).mean(-1, keepdim=True) + eps" in CLAMPED_EPS_REASON


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_norm_over_the_second_last_axis_is_one_miss_each_way_naming_the_axis(training):
    """A mean over ``dim=-2``: the forward scan records it in the inference graph, and the backward's miss,
    which said only that no form matched (and was silent where the weight alone takes a gradient), names
    the axis as the forward's does."""
    w = torch.nn.Parameter(_seeded(3, 3, 1))
    x = _seeded(1, 2, 3, 16).requires_grad_(training)
    results = compiled_step(lambda x: x * torch.rsqrt(x.pow(2).mean(-2, keepdim=True) + EPS) * w, [x], [w])
    for graph in ("inference", "joint"):
        misses = [m for r in results if r.graph == graph for m in r.misses]
        ops = [NORM, NORM_GRAD] if graph == "joint" else [NORM]  # the weight takes a gradient in both
        assert sorted(m.op for m in misses) == sorted(ops) and not any(r.sites for r in results), misses
        for m in misses:
            assert "axes [1] of a rank-3 tensor, not its last axes" in m.reason, m
            assert "x.pow(2).mean(-1, keepdim=True) + eps" in m.reason, m
            assert m.node.startswith("rsqrt" if m.op == NORM else "mul"), m


BIAS = _seeded(9, 8)
#: name: (SwiGLU of the two halves with a half read with another term, the half it combines)
COMBINED_HALVES = {
    "up_plus_gate": (lambda gate, up: F.silu(gate) * (up + gate), "up"),
    "gate_plus_a_bias": (lambda gate, up: F.silu(gate + BIAS) * up, "gate"),
}


@pytest.mark.parametrize("name", COMBINED_HALVES)
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_swiglu_with_a_half_read_with_another_term_is_one_miss_each_way(training, name):
    """``silu(gate) * (up + gate)`` of one chunked projection (or ``silu(gate + bias) * up``): another function
    than ``silu(x[:H]) * x[H:]``. The near-miss readers followed pointwise ops of one tensor only, so it was
    silent both ways; now one miss per op, at the product and at ``silu_backward``, naming the op that
    combines the half; outputs and gradients are eager's."""
    program, role = COMBINED_HALVES[name]
    x = _seeded(1, 2, 3, 16).requires_grad_(training)
    results = compiled_step(lambda x: program(*_halves(x)), [x], [GATE_UP])
    for graph in ("inference", "joint"):
        misses = [m for r in results if r.graph == graph for m in r.misses]
        assert sorted(m.op for m in misses) == (["swiglu", "swiglu_grad"] if graph == "joint" else ["swiglu"]), misses
        assert not any(r.sites for r in results), results
        for m in misses:
            assert m.node == ("mul" if m.op == "swiglu" else "silu_backward"), m
            assert f"add (aten.add.Tensor) combines the {role} with" in m.reason, m
            assert "it fuses only where silu of the first half multiplies the second half itself" in m.reason, m
