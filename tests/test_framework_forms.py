"""The RoPE and RMSNorm spellings of torchtune, torchtitan and Megatron-core, written out in
plain PyTorch (no framework needed), each beside near misses of it.

Every program runs forward and backward under both partitioners with the pass in strict mode;
every gradient is checked against eager and float64 (``compile_and_compare``), and the fused
count is asserted: the number of sites for a form, 0 for a near miss (its math is no fused
op's formula). The models themselves are built from the libraries in ``test_frameworks.py``.
"""
import dataclasses
from typing import Callable, Optional

import pytest
import torch

from npu_fusion_testing.capture import compile_and_compare

ROPE, RMS = "rotary_position_embedding_grad", "rms_norm_grad"
BF16 = torch.bfloat16
B, S, H, KV, D = 2, 6, 4, 2, 16


def _randn(gen, *shape, dtype=torch.float32, grad=True):
    return torch.randn(shape, generator=gen).to(dtype).requires_grad_(grad)


def angles(gen, d=D):
    return torch.arange(S)[:, None] * torch.rand(d // 2, generator=gen)


# -- torchtune: RotaryPositionalEmbeddings ---------------------------------------------

def tune_cache(gen):
    """torchtune's cache: [S, D/2, 2] of (cos, sin)."""
    theta = angles(gen)
    return torch.stack([theta.cos(), theta.sin()], -1)


def tune_rope(x, cache, first=(1, -1), second=(1, 1), lanes=(0, 1)):
    """``RotaryPositionalEmbeddings.forward`` on x [B, S, H, D]; the keyword arguments
    perturb it: the signs of the two products of each output lane, the cache lanes read."""
    c, s = lanes
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    rc = cache.view(-1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack([first[0] * xs[..., 0] * rc[..., c] + first[1] * xs[..., 1] * rc[..., s],
                       second[0] * xs[..., 1] * rc[..., c] + second[1] * xs[..., 0] * rc[..., s]], -1)
    return out.flatten(3).type_as(x)


def tune_attention_scores(q, k, cache, rope=tune_rope):
    """torchtune's attention around its RoPE: k expanded from KV to H heads after the
    rotation (its gradient is a sum over the copies), q scaled in place."""
    q = rope(q, cache).transpose(1, 2)
    k = rope(k, cache)
    k = k.view(B, S, KV, 1, D).expand(B, S, KV, H // KV, D).reshape(B, S, H, D).transpose(1, 2)
    q.mul_(0.25)
    return q @ k.transpose(2, 3)


def tune_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [_randn(gen, B, S, H, D, dtype=dtype), _randn(gen, B, S, KV, D, dtype=dtype), tune_cache(gen)]


def tune_q_cache():
    q, _, cache = tune_inputs()
    return [q, cache]


def two_cache_rope(x, cache, other):
    """Near miss: the second output lane reads another table than the first."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    rc, ro = (t.view(-1, xs.size(1), 1, xs.size(3), 2) for t in (cache, other))
    out = torch.stack([xs[..., 0] * rc[..., 0] - xs[..., 1] * rc[..., 1],
                       xs[..., 1] * ro[..., 0] + xs[..., 0] * ro[..., 1]], -1)
    return out.flatten(3)


def half_table_rope(x, cos, sin, sign=-1):
    """``x1*cos - x2*sin`` with half-width input tables (``sign=1``: a near miss)."""
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return torch.cat((x1 * cos + sign * x2 * sin, x2 * cos + x1 * sin), dim=-1)


def half_table_inputs():
    gen = torch.Generator().manual_seed(0)
    theta = angles(gen)[:, None, :]
    return [_randn(gen, B, S, H, D), theta.cos(), theta.sin()]


# -- Megatron-core: _apply_rotary_pos_emb_bshd on [S, B, H, D] -------------------------

def megatron_rotate_half(x, interleaved, pair=lambda x1, x2: (-x2, x1)):
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat(pair(x1, x2), dim=-1)
    x1, x2 = x[:, :, :, ::2], x[:, :, :, 1::2]
    x_new = torch.stack(pair(x1, x2), dim=-1)
    return x_new.view(x_new.shape[0], x_new.shape[1], x_new.shape[2], -1)


def megatron_rope(t, freqs, interleaved=False, pair=lambda x1, x2: (-x2, x1)):
    """freqs [S, 1, 1, D] (Megatron's ``RotaryEmbedding.get_emb``); the tables are computed
    from it inside the program, as Megatron does."""
    cos_, sin_ = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    return t * cos_ + megatron_rotate_half(t, interleaved, pair) * sin_


def megatron_freqs(gen, interleaved):
    f = angles(gen)
    emb = torch.stack((f.view(-1, 1), f.view(-1, 1)), -1).view(S, -1) if interleaved else torch.cat((f, f), -1)
    return emb[:, None, None, :]


def megatron_inputs(interleaved, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return [_randn(gen, S, B, H, D, dtype=dtype), _randn(gen, S, B, KV, D, dtype=dtype),
            megatron_freqs(gen, interleaved)]


def megatron_qk(interleaved, pair=lambda x1, x2: (-x2, x1)):
    def fn(q, k, freqs):
        return megatron_rope(q, freqs, interleaved, pair), megatron_rope(k, freqs, interleaved, pair).exp()
    return fn


# -- torchtitan: MLA's single-head k_pe; complex RoPE broadcast head-first ---------------

def titan_complex_rope(x, freqs_cis):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis).flatten(3).type_as(x)


def mla_k(k_pe, k_nope, freqs_cis):
    """DeepSeek-V3 MLA (torchtitan): one rotated k_pe head [B, S, 1, D] expanded over the
    heads beside the per-head k_nope."""
    k_pe = titan_complex_rope(k_pe, freqs_cis[None, :, None, :])
    k = torch.cat([k_nope, k_pe.expand(-1, -1, H, -1)], dim=-1)
    return k * k.detach()


def mla_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(2)
    return [_randn(gen, B, S, 1, D, dtype=dtype), _randn(gen, B, S, H, 8, dtype=dtype),
            torch.polar(torch.ones(S, D // 2), angles(gen))]


def head_first_complex(q, k, freqs_cis):
    """[B, H, T, D] with ``freqs_cis[None, None, :T, :]``."""
    fc = freqs_cis[None, None, :q.shape[2], :]
    return titan_complex_rope(q, fc), titan_complex_rope(k, fc).square()


def head_first_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    return [_randn(gen, B, H, S, D, dtype=dtype), _randn(gen, B, KV, S, D, dtype=dtype),
            torch.polar(torch.ones(S + 2, D // 2), torch.arange(S + 2)[:, None] * torch.rand(D // 2, generator=gen))]


# -- torchtitan qwen3 in bf16: a float32 norm with a bf16 weight ---------------------------

def fp32_norm_bf16_weight(x, w):
    h = x.float()
    return (w.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))).to(x.dtype)


def norm_inputs():
    gen = torch.Generator().manual_seed(4)
    return [_randn(gen, B, S, H, D, dtype=BF16), _randn(gen, D, dtype=BF16)]


@dataclasses.dataclass
class Case:
    fn: Callable
    inputs: Callable
    rope: Optional[int] = None
    rms: Optional[int] = None


CASES = {
    # torchtune: stack of selects, a [S, D/2, 2] cache read through four saved copies
    "tune_rope_q_and_gqa_k": Case(tune_attention_scores, tune_inputs, rope=2),
    "tune_rope_q_and_gqa_k_bf16": Case(tune_attention_scores, lambda: tune_inputs(BF16), rope=2),
    "tune_rope_alone": Case(lambda q, c: tune_rope(q, c), tune_q_cache, rope=1),
    "tune_near_miss_no_negation": Case(lambda q, c: tune_rope(q, c, first=(1, 1)), tune_q_cache, rope=0),
    "tune_near_miss_both_negated": Case(lambda q, c: tune_rope(q, c, second=(1, -1)), tune_q_cache, rope=0),
    # the cache's lanes swapped is RoPE with the tables swapped: tables are whatever leaves
    "tune_rope_cache_lanes_swapped": Case(lambda q, c: tune_rope(q, c, lanes=(1, 0)), tune_q_cache, rope=1),
    "tune_near_miss_two_caches": Case(lambda q, c: two_cache_rope(q, c, c.flip(0)), tune_q_cache, rope=0),
    # a computed dy: the gradient of an elementwise use after RoPE, read in pieces (selects,
    # slices, a negation) by the rotation's backward, is one dy
    "tune_rope_then_exp": Case(lambda q, c: tune_rope(q, c).exp(), tune_q_cache, rope=1),
    "tune_rope_then_square": Case(lambda q, c: tune_rope(q, c).square(), tune_q_cache, rope=1),
    "tune_near_miss_no_negation_then_square": Case(lambda q, c: tune_rope(q, c, first=(1, 1)).square(),
                                                   tune_q_cache, rope=0),
    "half_tables_then_square": Case(lambda q, c, s: half_table_rope(q, c, s).square(), half_table_inputs, rope=1),
    "half_tables_near_miss_sign_then_square": Case(
        lambda q, c, s: half_table_rope(q, c, s, sign=1).square(), half_table_inputs, rope=0),
    # Megatron-core: [S, B, H, D], tables computed from freqs in the program
    "megatron_half": Case(megatron_qk(False), lambda: megatron_inputs(False), rope=2),
    "megatron_interleaved": Case(megatron_qk(True), lambda: megatron_inputs(True), rope=2),
    "megatron_interleaved_bf16": Case(megatron_qk(True), lambda: megatron_inputs(True, BF16), rope=2),
    "megatron_interleaved_sin_negated": Case(megatron_qk(True, lambda x1, x2: (x2, -x1)),
                                             lambda: megatron_inputs(True), rope=2),
    "megatron_near_miss_unrotated_pair": Case(megatron_qk(True, lambda x1, x2: (-x1, x2)),
                                              lambda: megatron_inputs(True), rope=0),
    "megatron_near_miss_pair_not_swapped": Case(megatron_qk(False, lambda x1, x2: (x1, -x2)),
                                                lambda: megatron_inputs(False), rope=0),
    # torchtitan
    "mla_single_head_k_pe": Case(mla_k, mla_inputs, rope=1),
    "mla_single_head_k_pe_bf16": Case(mla_k, lambda: mla_inputs(BF16), rope=1),
    "complex_head_first": Case(head_first_complex, head_first_inputs, rope=2),
    "complex_head_first_bf16": Case(head_first_complex, lambda: head_first_inputs(BF16), rope=2),
    "complex_near_miss_conjugated_product": Case(
        lambda q, f: torch.view_as_real(torch.view_as_complex(q.reshape(B, H, S, -1, 2)).conj()
                                        * f[None, None, :S]).flatten(3), lambda: head_first_inputs()[::2], rope=0),
    "fp32_norm_bf16_weight": Case(fp32_norm_bf16_weight, norm_inputs, rms=1),
}


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
@pytest.mark.parametrize("name", list(CASES))
def test_framework_forms_and_near_misses(name, partitioner):
    case = CASES[name]
    capture = compile_and_compare(case.fn, list(case.inputs()), partitioner=partitioner, target="generic")
    for op, expected in ((ROPE, case.rope), (RMS, case.rms)):
        if expected is not None:
            assert capture.fused(op) == expected, (op, capture.fused(op), capture.misses())


# -- no silent misses: what no form matches is a recorded miss that says where it stopped --

def index_select_rope(q, angles):
    """rotate_half spelled as a permutation and a sign vector, tables computed in the program:
    its backward (index_add) is no op the lane evaluator reads."""
    d = q.shape[-1]
    perm = torch.cat((torch.arange(d // 2, d), torch.arange(0, d // 2)))
    signs = torch.cat((-torch.ones(d // 2), torch.ones(d // 2)))
    emb = torch.cat((angles, angles), -1)
    return q * emb.cos() + q.index_select(-1, perm) * signs * emb.sin()


def test_unread_rope_spelling_is_a_recorded_miss():
    gen = torch.Generator().manual_seed(5)
    q, table_angles = _randn(gen, B, H, S, D), angles(gen)
    capture = compile_and_compare(index_select_rope, [q, table_angles])
    assert capture.fused(ROPE) == 0
    reasons = [m.reason for m in capture.misses() if m.op == ROPE]
    assert len(reasons) == 1 and "rotary table" in reasons[0] and "stopped at" in reasons[0], reasons


def test_layer_norm_backward_is_no_rms_norm_miss():
    """A decomposed LayerNorm backward scales gradients by rsqrt(var + eps) of a centred square:
    not an RMS statistic, so no RMSNorm miss is recorded for it."""
    gen = torch.Generator().manual_seed(6)
    x, w = _randn(gen, B, S, D), _randn(gen, D)
    capture = compile_and_compare(lambda x, w: torch.nn.functional.layer_norm(x, (D,), w), [x, w],
                                  decompositions="core")
    assert not [m for m in capture.misses() if m.op == RMS], capture.misses()
