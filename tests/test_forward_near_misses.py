"""Near misses of the forward rules (``rms_norm_forward``, ``rope_forward``): programs one step
away from an RMSNorm or a RoPE forward must keep their decomposed forward (the fused forward op
absent), and programs that are spelled oddly but equal the op's formula may fuse; either way
outputs and every gradient pass the float64 criterion against eager (``check``). Each norm is
applied to a tensor that takes no gradient, under ``x * norm(h)``, so its forward alone is the
site (a norm whose input takes a gradient fuses its forward only after its backward)."""
import pytest
import torch

from npu_fusion.patterns.rope.sites import SYMBOLIC_MOVES
from npu_fusion.patterns.rotation import symbolic_head_dim_reason
from npu_fusion_testing.capture import compile_and_compare
from npu_fusion.plugin.options import forward_options
from test_forward_fusion import calls, check

EPS = 1e-6
BOTH = dict.fromkeys(forward_options(), True)  # the forward rules' switches
NORM, ROPE = "rms_norm", "rotary_position_embedding"


def _seeded(seed, *size):
    return torch.randn(*size, generator=torch.Generator().manual_seed(seed))


W16, W3x16 = _seeded(3, 16), _seeded(4, 3, 16)


def _stat(h, dims=-1):
    return torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + EPS)


NORM_NEAR_MISSES = {  # name: (the norm of h, whether its forward fuses)
    "eps_outside_the_root": (lambda h: h * (torch.rsqrt(h.pow(2).mean(-1, keepdim=True)) + EPS) * W16, False),
    "sum_over_the_wrong_n": (lambda h: h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) / 15 + EPS) * W16, False),
    "variance_not_mean_square": (lambda h: h * torch.rsqrt(h.var(-1, unbiased=False, keepdim=True) + EPS) * W16,
                                 False),
    "centred_statistic_uncentred_x": (lambda h: h * _stat(h - h.mean(-1, keepdim=True)) * W16, False),
    "statistic_of_a_leading_flip": (lambda h: h * _stat(h.flip(0)) * W16, False),
    "statistic_of_a_sequence_roll": (lambda h: h * _stat(h.roll(1, 1)) * W16, False),
    "x_scaled_after_the_statistic": (lambda h: (2 * h) * _stat(h) * W16, False),
    "rstd_squared": (lambda h: h * _stat(h) ** 2 * W16, False),
    "rstd_rounded_to_bf16": (lambda h: h * _stat(h).bfloat16().float() * W16, False),
    "normalized_value_through_fp16_then_bf16": (
        lambda h: (W16.bfloat16() * (h * _stat(h)).half().bfloat16()).float(), False),
    "gamma_over_another_axis": (
        lambda h: (h.view(2, 3, 4, 4) * _stat(h.view(2, 3, 4, 4)) * W16[:4, None]).view(2, 3, 16), False),
    "two_weights_share_one_rstd": (lambda h: (lambda r: h * r * W16 + h * r * W16.flip(0) * 2)(_stat(h)), False),
    # equal to the op's formula: fusing them is right
    "two_axes_weight_over_the_last": (lambda h: h * _stat(h, (-2, -1)) * W16, True),
    "gamma_added_after_a_weightless_norm": (lambda h: h * _stat(h) + W16, True),
    "statistic_of_the_negated_x": (lambda h: h * _stat(-h) * W16, True),
    "rstd_also_read_by_another_branch": (lambda h: (lambda r: h * r * W16 + r)(_stat(h)), True),
}


@pytest.mark.parametrize("name", NORM_NEAR_MISSES)
def test_rms_norm_forward_near_miss(name):
    norm, fuses = NORM_NEAR_MISSES[name]
    h = _seeded(2, 2, 3, 16)
    x = _seeded(5, 2, 3, 16).requires_grad_()
    result, fw, _ = check(lambda x: x * norm(h), [x], **BOTH)
    assert result.fused(NORM) == len(calls(fw, NORM)) == int(fuses), (result.sites, result.misses)


ANGLES = _seeded(2, 7, 16)
COS, SIN = ANGLES.cos(), ANGLES.sin()


def _rotate_half(q, split=8):
    return torch.cat((-q[..., split:], q[..., :split]), -1)


ROPE_NEAR_MISSES = {  # name: (the rotation of q [2, 4, 6, 16], whether it fuses)
    "both_halves_negated": (lambda q: q * COS[:6] + torch.cat((-q[..., 8:], -q[..., :8]), -1) * SIN[:6], False),
    "no_negation": (lambda q: q * COS[:6] + torch.cat((q[..., 8:], q[..., :8]), -1) * SIN[:6], False),
    "split_at_six": (lambda q: q * COS[:6] + _rotate_half(q, 6) * SIN[:6], False),
    "rotated_x_flipped_over_batch": (lambda q: q * COS[:6] + _rotate_half(q.flip(0)) * SIN[:6], False),
    "rotated_x_rolled_over_sequence": (lambda q: q * COS[:6] + _rotate_half(q.roll(1, 2)) * SIN[:6], False),
    "rotated_half_of_the_other_slice": (
        lambda q: q[..., :8] * COS[:6, :8] + _rotate_half(q[..., 8:], 4) * SIN[:6, :8], False),
    "a_term_rounded_to_bf16": (lambda q: (q * COS[:6]).bfloat16().float() + _rotate_half(q) * SIN[:6], False),
    "rotation_shared_with_another_consumer": (
        lambda q: (lambda r: q * COS[:6] + r * SIN[:6] + r.sum(-1, keepdim=True))(_rotate_half(q)), False),
    # equal to the op's formula with other tables: fusing them is right
    "tables_swapped": (lambda q: q * SIN[:6] + _rotate_half(q) * COS[:6], True),
    "tables_of_shifted_positions": (lambda q: q * COS[1:] + _rotate_half(q) * SIN[:6], True),
    "cat_x2_minus_x1": (lambda q: q * COS[:6] + torch.cat((q[..., 8:], -q[..., :8]), -1) * SIN[:6], True),
    "x_read_again_after": (lambda q: (q * COS[:6] + _rotate_half(q) * SIN[:6]) * q, True),
}


@pytest.mark.parametrize("name", ROPE_NEAR_MISSES)
def test_rope_forward_near_miss(name):
    rotate, fuses = ROPE_NEAR_MISSES[name]
    q = _seeded(1, 2, 4, 6, 16).requires_grad_()
    result, fw, _ = check(lambda q: rotate(q) * 2, [q], **BOTH)
    assert result.fused(ROPE) == len(calls(fw, ROPE)) == int(fuses), (result.sites, result.misses)


# -- BSND: tables [S, 1, D] over x [B, S, N, D] (the rotation before the heads' transpose) --------

PROJECTION = torch.nn.Parameter(_seeded(8, 64, 64) / 8)

BSND = {  # name: (the rotation of p, p's shape, its recorded miss, None where it fuses, "" where it is
        # no rotation)
    "x_an_input": (lambda p: p * COS[:6, None] + _rotate_half(p) * SIN[:6, None], (2, 6, 4, 16), None),
    "x_a_view_of_a_projection": (
        lambda p: (lambda q: q * COS[:6, None] + _rotate_half(q) * SIN[:6, None])((p @ PROJECTION).view(2, 6, 4, 16)),
        (2, 6, 64), None),
    "tables_per_head": (lambda p: p * COS[:4, None] + _rotate_half(p) * SIN[:4, None], (2, 4, 6, 16), None),
    "split_at_six": (lambda p: p * COS[:6, None] + _rotate_half(p, 6) * SIN[:6, None], (2, 6, 4, 16),
                     "no mode's formula"),
    "rotated_x_flipped_over_heads": (lambda p: p * COS[:6, None] + _rotate_half(p.flip(2)) * SIN[:6, None],
                                     (2, 6, 4, 16), ""),
    "a_term_rounded_to_bf16": (
        lambda p: (p * COS[:6, None]).bfloat16().float() + _rotate_half(p) * SIN[:6, None], (2, 6, 4, 16),
        "rounds a value inside the site to torch.bfloat16"),
    "tables_broadcast_differently": (lambda p: p * COS[:6] + _rotate_half(p) * SIN[:4, None], (2, 4, 6, 16),
                                     "cos and sin must have the same shape"),
}


@pytest.mark.parametrize("name", BSND)
def test_rope_forward_with_tables_broadcast_over_heads(name):
    """A table with a size-1 axis before the last ([S, 1, D]) and an x that is a view splitting
    a projection into heads are read as leaves: the rotation fuses (it was neither fused nor a
    recorded miss), or is a recorded miss where the op refuses it."""
    rotate, size, reason = BSND[name]
    p = _seeded(1, *size).requires_grad_()
    result, fw, _ = check(lambda p: rotate(p) * 2, [p], [PROJECTION] if "projection" in name else [], **BOTH)
    missed = [m.reason for m in result.misses if m.op == ROPE]
    if reason is None:
        assert result.fused(ROPE) == len(calls(fw, ROPE)) == 1 and not missed, (result.sites, result.misses)
    elif reason:
        assert not result.fused(ROPE) and len(missed) == 1 and reason in missed[0], result.misses
    else:  # no rotation at all: x and its flip are two leaves
        assert not result.fused(ROPE) and not calls(fw, ROPE), result.sites


# -- dynamic=True: a symbolic last axis ----------------------------------------------------------

W1 = torch.nn.Parameter(_seeded(9, 1))


def _causal_taps(h):
    padded = torch.nn.functional.pad(h, (2, 0))
    return padded[..., :-2] * W1[0] + padded[..., 1:-1] * 0.5 + padded[..., 2:]


SYMBOLIC_NO_ROPE = {  # name: a program over h [2, 6, 12], every axis of h dynamic; no rotation
    "difference_along_the_last_axis": lambda h: (h[..., 1:] - h[..., :-1]) * W1,
    "causal_convolution_along_the_last_axis": lambda h: _causal_taps(h) * W1,
    "concatenation_along_the_last_axis_plus_one": lambda h: (torch.cat((h, h.exp()), -1) + 1) * W1,
    "roll_along_the_last_axis_plus_x": lambda h: (torch.cat((h[..., 1:], h[..., :1]), -1) + h) * W1,
    "shift_along_the_sequence": lambda h: (h[:, 1:] + h[:, :-1]) * W1,
}


@pytest.mark.parametrize("name", SYMBOLIC_NO_ROPE)
def test_symbolic_last_axis_without_a_rotation_is_no_rope_miss(name):
    """Under dynamic shapes the forward RoPE rule records elements moved along a symbolic last
    axis and summed as a rotation it cannot prove: only where the move is along the last axis and
    the sum adds two products of tensors that vary along it (``x * cos + rotate(x) * sin``), or a
    complex product. Differences, causal convolution taps, concatenations, rolls and sequence
    shifts of a tensor whose last axis is symbolic are no RoPE: no RoPE miss (they were)."""
    h = _seeded(2, 2, 6, 12)
    capture = compile_and_compare(SYMBOLIC_NO_ROPE[name], [h], [W1], dynamic_dims={0: [0, 1, 2]}, **BOTH)
    assert not [m for m in capture.misses() if m.op == ROPE], capture.misses()


def _complex_rotation(x, cos_sin):
    freqs_cis = torch.view_as_complex(cos_sin)  # a real input: float64_grads would drop a complex one's parts
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis[:, None, :]).flatten(3) * 1.5


COS_SIN = torch.stack((ANGLES[:6, :8].cos(), ANGLES[:6, :8].sin()), -1)


def test_complex_rotation_of_a_symbolic_head_dim_is_a_recorded_forward_miss():
    """A complex ``freqs_cis`` rotation whose head dim is symbolic (every axis dynamic): its
    product of complex pairs is the rotation's sum; the forward was neither fused nor a recorded
    miss (it fuses with a static head dim: test_forward_sites)."""
    x = _seeded(1, 2, 6, 4, 16).requires_grad_()
    capture = compile_and_compare(_complex_rotation, [x, COS_SIN], dynamic_dims={0: [0, 1, 2, 3], 1: [0, 1]},
                                  **BOTH)
    marked = symbolic_head_dim_reason(SYMBOLIC_MOVES, "L['x'].size()[3]")  # the pairs' axis, marked dynamic
    assert not capture.fused(ROPE) and [m.reason for m in capture.misses() if m.op == ROPE] == [marked]


def test_complex_rotation_of_a_symbolic_head_dim_is_a_recorded_backward_miss():
    """Its dx is a complex product (dy's pairs times conj(freqs_cis)), no add: the backward scan
    records complex products too (it looked only for an add or sub, a silent backward miss)."""
    x = _seeded(1, 2, 6, 4, 16).requires_grad_()
    capture = compile_and_compare(_complex_rotation, [x, COS_SIN], dynamic_dims={0: [0, 1, 2, 3], 1: [0, 1]},
                                  **BOTH)
    assert [m for m in capture.misses() if m.op == ROPE + "_grad"], capture.misses()


def _halves_rotated(q, cos, sin):
    half = q.shape[-1] // 2
    x1, x2 = q[..., :half], q[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1) * 2


SYMBOLIC_ROTATIONS = {  # name: (a rotation of q [2, 4, 6, 16], the tables' width)
    "sums_of_the_halves_products": (_halves_rotated, 8),
    "terms_scaled_by_constants": (lambda q, cos, sin: q * cos * 0.5 + (_rotate_half(q) * sin) / 3, 16),
}


@pytest.mark.parametrize("name", SYMBOLIC_ROTATIONS)
def test_rotation_spellings_of_a_symbolic_head_dim_are_recorded_forward_misses(name):
    """Rotations with every axis dynamic whose sums read the products through a ``cat`` of the
    halves or through scalings by constants: still recorded by the narrowed scan."""
    rotate, width = SYMBOLIC_ROTATIONS[name]
    angles = _seeded(2, 6, width)
    capture = compile_and_compare(rotate, [_seeded(1, 2, 4, 6, 16).requires_grad_(), angles.cos(), angles.sin()],
                                  dynamic_dims={0: [0, 1, 2, 3], 1: [0, 1], 2: [0, 1]}, **BOTH)
    marked = symbolic_head_dim_reason(SYMBOLIC_MOVES, "L['q'].size()[3]")
    assert not capture.fused(ROPE) and marked in {m.reason for m in capture.misses() if m.op == ROPE}


@pytest.mark.parametrize("name", ["difference_along_the_last_axis", "shift_along_the_sequence"])
def test_symbolic_last_axis_of_a_trained_input_without_a_rotation_is_no_rope_miss(name):
    """The backward scan records a gradient's move only where it is summed with a rotation's term
    (a product varying along the last axis, possibly moved) and along the last axis: a difference
    or a sequence shift of a trained input was a false RoPE miss."""
    h = _seeded(2, 2, 6, 12).requires_grad_()
    capture = compile_and_compare(SYMBOLIC_NO_ROPE[name], [h], [W1], dynamic_dims={0: [0, 1, 2]}, **BOTH)
    assert not [m for m in capture.misses() if m.op in (ROPE, ROPE + "_grad")], capture.misses()
