"""Adversarial programs against the widened matchers (commit 6f51c3d): RoPE products cut
into leaves, negated tables, RMSNorm roles bound to any node of the right value, forward
values as cuts under checkpointing, rounds to a fixed point, and a symbolic hidden size.

Each program runs forward + backward under both partitioners with the pass in strict mode
and every gradient is checked against eager and float64 (``compile_and_compare``). Where
the expected outcome is certain the fused count is asserted too: 0 for near misses (the
math differs from every fused op's formula), the number of sites for legitimate forms.

The ``ROUNDED`` cases are programs that round a value to bfloat16 in the forward: the
float64 reference keeps the rounding (only the inputs are widened), so a fused op that
reads the unrounded value instead of the rounded one gives a wrong gradient.
"""
import dataclasses
from typing import Callable, Optional

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers.models.llama.modeling_llama import rotate_half

from npu_fusion_testing.capture import Capture, compile_and_compare
from npu_fusion.measure.grads import assert_close_as_unfused, float64_grads, run_grads

ROPE, RMS = "rotary_position_embedding_grad", "rms_norm_grad"
BF16 = torch.bfloat16


# -- forwards -----------------------------------------------------------------------

def rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def rot_neg_sin(x):  # nanochat: cat(x2, -x1), mode 0 with sin negated
    return torch.cat((x[..., 8:], -x[..., :8]), dim=-1)


def rms(x, w, eps=1e-6):  # HF Llama: statistics in float32, weight times the cast back
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def plain_rms(x, w=None, eps=1e-6):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else w * y


def rms_2d(x, w, eps=1e-6):  # gamma over the last two axes
    return w * (x * torch.rsqrt(x.pow(2).mean((-2, -1), keepdim=True) + eps))


def rstd(x, eps=1e-6):
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def rounded(t):
    return t.to(BF16).float()


# -- inputs ---------------------------------------------------------------------------

def _randn(gen, *shape, dtype=torch.float32, grad=True):
    return torch.randn(shape, generator=gen).to(dtype).requires_grad_(grad)


def rope_qcs(dtype=torch.float32, table_grad=False):
    """q [B, N, S, D], cos/sin [1, 1, S, D]."""
    gen = torch.Generator().manual_seed(0)
    return [_randn(gen, 2, 4, 6, 16, dtype=dtype),
            _randn(gen, 1, 1, 6, 16, dtype=dtype, grad=table_grad),
            _randn(gen, 1, 1, 6, 16, dtype=dtype, grad=table_grad)]


def rope_qkcs(dtype=torch.float32, table_grad=False):
    q, cos, sin = rope_qcs(dtype, table_grad)
    return [q, _randn(torch.Generator().manual_seed(1), 2, 4, 6, 16, dtype=dtype), cos, sin]


def norm_xw(dtype=torch.float32, shape=(2, 5, 32), w_grad=True, x_grad=True):
    gen = torch.Generator().manual_seed(0)
    return [_randn(gen, *shape, dtype=dtype, grad=x_grad), _randn(gen, *shape[-1:], dtype=dtype, grad=w_grad)]


def norm_xgw(dtype=torch.float32, x_grad=True):
    """x, a gate or second input of x's shape, a weight."""
    gen = torch.Generator().manual_seed(0)
    return [_randn(gen, 2, 5, 32, dtype=dtype, grad=x_grad), _randn(gen, 2, 5, 32, dtype=dtype),
            _randn(gen, 32, dtype=dtype)]


def norm_xgww(dtype=torch.float32):
    return norm_xgw(dtype) + [_randn(torch.Generator().manual_seed(1), 32, dtype=dtype)]


def norm_abgw():
    gen = torch.Generator().manual_seed(0)
    return [_randn(gen, 2, 5, 32), _randn(gen, 2, 5, 32), _randn(gen, 2, 5, 32), _randn(gen, 32, grad=False)]


def square_xw():  # [B, S, D] with S == D: an axis whose size equals the hidden size
    gen = torch.Generator().manual_seed(1)
    return [_randn(gen, 4, 6, 6), _randn(gen, 6)]


def dyn_xwz(shape=(3, 5, 7), w_axes=1):
    gen = torch.Generator().manual_seed(2)
    return [_randn(gen, *shape), _randn(gen, *shape[-w_axes:]), _randn(gen, *shape)]


SCALE = torch.randn(1, 1, 6, 16, generator=torch.Generator().manual_seed(5))


@dataclasses.dataclass
class Case:
    fn: Callable
    inputs: Callable
    rope: Optional[int] = None   # RoPE sites fused (None: not asserted)
    rms: Optional[int] = None    # RMSNorm sites fused (None: not asserted)
    dynamic: bool = False        # torch.compile(dynamic=True): every size symbolic


CASES = {
    # 1. a RoPE output used elementwise: a dy of degree 2 is cut into a leaf -----------
    "rope_output_squared_bf16": Case(lambda q, c, s: rope(q, c, s).square(), lambda: rope_qcs(BF16), rope=1),
    "rope_output_squared_tables_grad": Case(lambda q, c, s: rope(q, c, s).square(),
                                            lambda: rope_qcs(table_grad=True), rope=1),
    "rope_times_its_detached_self": Case(lambda q, c, s: (lambda y: y * y.detach())(rope(q, c, s)), rope_qcs, rope=1),
    "rope_times_cos_table_grad": Case(lambda q, c, s: rope(q, c, s) * c, lambda: rope_qcs(table_grad=True), rope=1),
    "rope_times_cos_times_sin": Case(lambda q, c, s: rope(q, c, s) * c * s, rope_qcs, rope=1),
    "rope_times_its_input": Case(lambda q, c, s: rope(q, c, s) * q, rope_qcs),
    "rope_times_rotated_self": Case(lambda q, c, s: (lambda y: y * rotate_half(y))(rope(q, c, s)), rope_qcs),
    "rope_dy_from_table_product": Case(lambda q, k, c, s: rope(q, c, s) * (c * s) + rope(k, c, s).exp(),
                                       rope_qkcs, rope=2),
    "rope_of_rope_tables_grad": Case(lambda q, c, s: rope(rope(q, c, s), c, s), lambda: rope_qcs(table_grad=True),
                                     rope=2),
    "rope_with_squared_table": Case(lambda q, c, s: q * c * c + rotate_half(q) * s * c, rope_qcs),

    # 2. negated tables: only a uniform negation of a whole table is a RoPE ------------
    "neg_sin_rotation_tables_grad": Case(lambda q, c, s: q * c + rot_neg_sin(q) * s,
                                         lambda: rope_qcs(table_grad=True), rope=1),
    "neg_cos_tables_grad": Case(lambda q, c, s: q * (-c) + rotate_half(q) * s, lambda: rope_qcs(table_grad=True),
                                rope=1),
    "whole_rope_negated": Case(lambda q, c, s: -rope(q, c, s), rope_qcs, rope=1),
    # a table negated in part is computed in the forward: it is simply another table
    "half_negated_sin_table_grad": Case(
        lambda q, c, s: q * c + rotate_half(q) * torch.cat((s[..., :8], -s[..., 8:]), -1),
        lambda: rope_qcs(table_grad=True), rope=1),
    "one_position_of_sin_negated_grad": Case(
        lambda q, c, s: q * c + rotate_half(q) * torch.cat((-s[..., :1], s[..., 1:]), -1),
        lambda: rope_qcs(table_grad=True), rope=1),
    "q_and_k_mixed_signs_shared_tables_grad": Case(
        lambda q, k, c, s: (rope(q, c, s), k * c + rot_neg_sin(k) * s), lambda: rope_qkcs(table_grad=True), rope=2),
    "neg_sin_interleave": Case(
        lambda q, c, s: q * c + torch.stack((q[..., 1::2], -q[..., 0::2]), -1).flatten(-2) * s, rope_qcs, rope=1),
    "neg_sin_quarter": Case(
        lambda q, c, s: q * c + (lambda a, b, e, d: torch.cat((b, -a, d, -e), -1))(*q.chunk(4, -1)) * s,
        rope_qcs, rope=1),
    # near misses: the rotation's own signs are not a table's sign
    "rotation_without_negation": Case(lambda q, c, s: q * c + torch.cat((q[..., 8:], q[..., :8]), -1) * s,
                                      rope_qcs, rope=0),
    "rotation_both_halves_negated": Case(lambda q, c, s: q * c + torch.cat((-q[..., 8:], -q[..., :8]), -1) * s,
                                         rope_qcs, rope=0),
    "interleave_without_negation": Case(
        lambda q, c, s: q * c + torch.stack((q[..., 1::2], q[..., 0::2]), -1).flatten(-2) * s, rope_qcs, rope=0),
    "quarter_mixed_signs": Case(
        lambda q, c, s: q * c + (lambda a, b, e, d: torch.cat((b, -a, -d, e), -1))(*q.chunk(4, -1)) * s,
        rope_qcs, rope=0),

    # 3. RMSNorm roles bound to computed nodes -----------------------------------------
    "gated_norm_bf16": Case(lambda x, g, w: rms(x, w) * g, lambda: norm_xgw(BF16), rms=1),
    "gated_norm_fp16_casts": Case(lambda x, g, w: (rms(x, w).half() * g.half()).float(), norm_xgw, rms=1),
    "norm_times_its_input": Case(lambda x, w: rms(x, w) * x, norm_xw),
    "norm_times_its_detached_input": Case(lambda x, w: rms(x, w) * x.detach(), norm_xw, rms=1),
    "norm_squared": Case(lambda x, w: rms(x, w).square(), norm_xw),
    "norm_times_other_norm_same_x": Case(lambda x, g, w: rms(x, w) * rms(x, g[0, 0]), norm_xgw),
    "norm_times_its_rstd": Case(lambda x, w: rms(x, w) * rstd(x), norm_xw),
    "norm_times_its_detached_rstd": Case(lambda x, w: rms(x, w) * rstd(x).detach(), norm_xw, rms=1),
    "norm_of_product": Case(lambda x, g, w: rms(x * g, w), norm_xgw, rms=1),
    "norm_of_x_times_other_rstd": Case(lambda x, g, w: rms(x * rstd(g), w), norm_xgw, rms=1),
    "sandwich_norm_bf16": Case(lambda x, g, w, w2: rms(x + rms(x, w), w2) * g, lambda: norm_xgww(BF16), rms=2),
    "post_norm_same_weight": Case(lambda x, g, w: rms(rms(x, w), w) * g, norm_xgw, rms=2),
    "post_norm_weightless": Case(lambda x, g: plain_rms(plain_rms(x)) * g, lambda: norm_xgw()[:2], rms=2),
    # near misses
    "gated_norm_eps_outside_root": Case(
        lambda x, g, w: w * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6) * g, norm_xgw, rms=0),
    "gated_norm_stat_over_wrong_axis": Case(
        lambda x, g, w: w * x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * g, norm_xgw, rms=0),
    "gated_norm_wrong_n": Case(
        lambda x, g, w: w * x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / 31 + 1e-6) * g, norm_xgw, rms=0),
    "sandwich_inner_eps_outside_root": Case(
        lambda x, g, w, w2: rms(x + w * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6), w2) * g,
        norm_xgww, rms=1),
    "stat_of_transposed_square_input": Case(
        lambda x, w: w * x * torch.rsqrt(x.transpose(-1, -2).pow(2).mean(-1, keepdim=True) + 1e-6), square_xw, rms=0),
    "stat_over_equal_sized_axis": Case(
        lambda x, w: plain_rms(x, w) + w * x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6), square_xw, rms=1),
    "stat_over_one_of_two_weight_axes": Case(
        lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) + rms_2d(x, w),
        lambda: norm_xw(shape=(3, 5, 4, 8))[:1] + [_randn(torch.Generator().manual_seed(4), 4, 8)], rms=1),

    # 3b. a norm whose input takes no gradient: only dgamma, fused alone ----------------
    "dgamma_only_hf_norm": Case(rms, lambda: norm_xw(x_grad=False), rms=1),
    "dgamma_only_bf16": Case(rms, lambda: norm_xw(BF16, x_grad=False), rms=1),
    "dgamma_only_gated": Case(lambda x, g, w: plain_rms(x, w) * g, lambda: norm_xgw(x_grad=False), rms=1),
    "dgamma_only_output_used_twice": Case(lambda x, g, w: (lambda h: h * g + h.exp())(plain_rms(x, w)),
                                          lambda: norm_xgw(x_grad=False), rms=1),
    "dgamma_only_under_a_post_norm": Case(
        lambda x, g, w, w2: plain_rms(plain_rms(x, w), w2) * g,
        lambda: norm_xgw(x_grad=False) + [_randn(torch.Generator().manual_seed(1), 32)], rms=2),
    "dgamma_only_checkpointed": Case(lambda x, w: checkpoint(lambda a: rms(a, w), x, use_reentrant=False),
                                     lambda: norm_xw(x_grad=False), rms=1),
    "dgamma_only_two_axes": Case(rms_2d, lambda: norm_xw(shape=(3, 5, 4, 8), x_grad=False)[:1]
                                 + [_randn(torch.Generator().manual_seed(4), 4, 8)], rms=1),
    # near misses: eps outside the root, a LayerNorm's centred statistic, another axis
    "dgamma_only_eps_outside_root": Case(
        lambda x, w: w * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6), lambda: norm_xw(x_grad=False), rms=0),
    "dgamma_only_layer_norm_statistic": Case(
        lambda x, w: (lambda c: w * (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)))(
            x - x.mean(-1, keepdim=True)), lambda: norm_xw(x_grad=False), rms=0),
    "dgamma_only_stat_over_wrong_axis": Case(
        lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6), lambda: norm_xw(x_grad=False),
        rms=0),
    "dgamma_only_stat_over_equal_sized_axis": Case(
        lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6),
        lambda: [square_xw()[0].detach(), square_xw()[1]], rms=0),
    "dgamma_only_rounded_normalized_value": Case(
        lambda x, w: w * rounded(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)),
        lambda: norm_xw(x_grad=False)),

    # 4. forward values as cuts: activation checkpointing -------------------------------
    "checkpointed_gated_norm": Case(lambda x, g, w: checkpoint(lambda a: rms(a, w) * g, x + 1.0, use_reentrant=False),
                                    norm_xgw, rms=1),
    "checkpointed_sandwich": Case(lambda x, g, w: checkpoint(lambda a: rms(a + rms(a, w), w) * g, x,
                                                             use_reentrant=False), norm_xgw, rms=2),
    "checkpointed_norm_output_used_twice": Case(
        lambda x, g, w: checkpoint(lambda a: (lambda h: h * g + h.square())(rms(a, w)), x, use_reentrant=False),
        norm_xgw),
    "checkpointed_shared_recompute": Case(
        lambda x, g, w, w2: checkpoint(lambda a: (lambda h: rms(h, w) + rms(h, w2) * h)(a + g), x,
                                       use_reentrant=False), norm_xgww),
    "checkpointed_rope_tables_grad": Case(
        lambda q, k, c, s: checkpoint(lambda a, c, s: rope(a, c, s) * rope(k, c, s), q, c, s, use_reentrant=False),
        lambda: rope_qkcs(table_grad=True), rope=2),
    # near misses: the recomputed sums are leaves, not values to see through
    "checkpointed_sum_normalized_by_difference": Case(
        lambda x, g, w: checkpoint(lambda a, b: w * (a + b) * torch.rsqrt((a - b).pow(2).mean(-1, keepdim=True)
                                                                          + 1e-6), x, g, use_reentrant=False),
        norm_xgw, rms=0),

    # 5. rounds: chains of sites whose dy is another site's dx ------------------------
    "rope_then_norm": Case(lambda q, c, s: plain_rms(rope(q, c, s)), rope_qcs, rope=1, rms=1),
    "norm_rope_norm_bf16_tables_grad": Case(lambda q, c, s: plain_rms(rope(plain_rms(q), c, s)),
                                            lambda: rope_qcs(BF16, table_grad=True), rope=1, rms=2),
    # every norm of the chain is an ordinary site (two-norm chains fuse both)
    "three_gated_norms": Case(lambda x, g, w, w2: rms(rms(rms(x, w), w2), w) * g, norm_xgww, rms=3),

    # 6. symbolic sizes (dynamic=True) -------------------------------------------------
    "dynamic_gated_norm": Case(lambda x, w, z: plain_rms(x, w) * z, dyn_xwz, rms=1, dynamic=True),
    "dynamic_two_axes": Case(lambda x, w, z: rms_2d(x, w) + z, lambda: dyn_xwz((3, 5, 4, 7), 2), rms=1,
                             dynamic=True),
    "dynamic_sandwich": Case(lambda x, w, z: plain_rms(x + plain_rms(x, w), w) * z, dyn_xwz, rms=2, dynamic=True),
    "dynamic_dgamma_only": Case(lambda x, w, z: plain_rms(x, w) * z,
                                lambda: (lambda x, w, z: [x.detach(), w, z])(*dyn_xwz()), rms=1, dynamic=True),
    "dynamic_weightless": Case(lambda x, w, z: plain_rms(x) * z + w, dyn_xwz, rms=0, dynamic=True),
    "dynamic_stat_over_one_of_two_axes": Case(
        lambda x, w, z: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) + z,
        lambda: dyn_xwz((3, 5, 4, 7), 2), rms=0, dynamic=True),
    "dynamic_n_is_another_size": Case(
        lambda x, w, z: w * x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / x.shape[1] + 1e-6) + z, dyn_xwz,
        rms=0, dynamic=True),
    "dynamic_stat_over_equal_sized_axis": Case(
        lambda x, w, z: w * x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) + plain_rms(z, w),
        lambda: dyn_xwz((3, 6, 6)), rms=1, dynamic=True),
    # S == D share one symbol (Dynamo duck-sizes them, with a guard): sum / S is the mean
    "dynamic_n_is_an_equal_size": Case(
        lambda x, w, z: w * x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / x.shape[1] + 1e-6) + z,
        lambda: dyn_xwz((3, 6, 6)), rms=1, dynamic=True),
}

#: forwards that round a value to bfloat16: a role bound to an unrounded node of "equal" value is wrong
ROUNDED = {
    # roles bound by value (6f51c3d): dy/x found as another node equal up to casts
    "gated_norm_beside_rounded_gated_norm": Case(
        lambda a, b, g, w: rms(a, w) * g + (rms(b, w).to(BF16) * g.to(BF16)).float(), norm_abgw),
    "norm_of_product_beside_norm_of_rounded_product": Case(
        lambda a, g, w, w2: rms(a * g, w) + rms((a.to(BF16) * g.to(BF16)).float(), w2), norm_xgww),
    # leaf roles seen through a narrowing cast (before 6f51c3d too)
    "norm_of_rounded_input": Case(lambda a, w: rms(rounded(a), w), norm_xw),
    "norm_numerator_rounded": Case(
        lambda a, w: w * (rounded(a) * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)), norm_xw),
    "rope_of_rounded_q_tables_grad": Case(lambda q, c, s: rope(rounded(q), c, s), lambda: rope_qcs(table_grad=True)),
    "rope_rounded_sin": Case(lambda q, c, s: rope(q, c, rounded(s)) + q * s, rope_qcs),
}

PARTITIONERS = ["default", "min_cut"]


def compare_dynamic(fn, inputs, partitioner):
    """compile_and_compare with torch.compile(dynamic=True)."""
    capture = Capture(partitioner=partitioner, target="generic")
    torch._dynamo.reset()
    got, grad_outputs = run_grads(torch.compile(fn, backend=capture, dynamic=True), inputs)
    eager, _ = run_grads(fn, inputs, grad_outputs=grad_outputs)
    exact = float64_grads(fn, inputs, (), grad_outputs)
    for g, e, x in zip(got, eager, exact):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert_close_as_unfused(g, e, x, factor=4.0)
    return capture


def check(case: Case, partitioner: str):
    inputs = list(case.inputs())
    if case.dynamic:
        capture = compare_dynamic(case.fn, inputs, partitioner)
    else:
        capture = compile_and_compare(case.fn, inputs, partitioner=partitioner, target="generic")
    fused = {"rope": capture.fused(ROPE), "rms": capture.fused(RMS)}
    for op in ("rope", "rms"):
        expected = getattr(case, op)
        if expected is not None:
            assert fused[op] == expected, (op, fused, capture.misses())


@pytest.mark.parametrize("partitioner", PARTITIONERS)
@pytest.mark.parametrize("name", list(CASES))
def test_widened_matchers(name, partitioner):
    check(CASES[name], partitioner)


@pytest.mark.parametrize("partitioner", PARTITIONERS)
@pytest.mark.parametrize("name", list(ROUNDED))
def test_rounded_forward_values_keep_gradients_exact(name, partitioner):
    check(ROUNDED[name], partitioner)
