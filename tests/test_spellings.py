"""Spellings of RMSNorm and RoPE that compute what the fused ops compute (issue 31): each is read by
value, so it fuses forward and backward together, with its output and every gradient checked
against eager by the float64 criterion (``check``); beside each, a near miss one step away stays
unfused (and still computes what eager does)."""
import pytest
import torch
import torch.nn.functional as F

from npu_fusion.models import rotate_half
from npu_fusion.plugin.options import forward_options
from test_forward_fusion import assert_paired as assert_paired_through, calls, check
from test_forward_sites import complex_rope

FORWARD, BACKWARD = "rms_norm", "rms_norm_grad"
ON = {"rms_norm_forward": True}
EPS = 1e-6


def _source(node):
    """``node`` through casts, views and the unsqueezes and squeezes that add or drop axes of size 1."""
    while node.op == "call_function" and node.target in (
            torch.ops.aten._to_copy.default, torch.ops.aten.view.default, torch.ops.prims.convert_element_type.default,
            torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims):
        node = node.args[0]
    return node


def assert_paired(fw, bw, sites):
    """test_forward_fusion's pairing check, reading rstd through the program's unsqueezes too."""
    assert_paired_through(fw, bw, sites, through=_source)


def _weight(dtype, d=16):
    return torch.nn.Parameter(torch.randn(d, generator=torch.Generator().manual_seed(3)).to(dtype))


def _input(dtype, *size):
    return torch.randn(*(size or (2, 3, 16)), generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()


def _hf(statistic):
    """An HF-style norm (statistics in float32, the weight after the cast back) with the given
    normalized value of the float32 input."""
    def norm(x, w):
        return w * statistic(x.float()).to(x.dtype)
    return norm


RMS_SPELLINGS = {  # name: the normalized value of a float32 x, spelled as the program does
    "power_minus_half": lambda xf: xf * (xf.pow(2).mean(-1, keepdim=True) + EPS) ** -0.5,
    "division_by_sqrt": lambda xf: xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + EPS),
    "statistic_without_keepdim": lambda xf: xf * torch.rsqrt(xf.pow(2).mean(-1) + EPS).unsqueeze(-1),
}

RMS_NEAR_MISSES = {  # name: a normalized value one step away from an RMSNorm's
    "power_minus_0.4": lambda xf: xf * (xf.pow(2).mean(-1, keepdim=True) + EPS) ** -0.4,
    "division_by_sqrt_of_a_sum": lambda xf: xf / torch.sqrt(xf.pow(2).sum(-1, keepdim=True) + EPS),
    "division_by_sqrt_eps_outside": lambda xf: xf / (torch.sqrt(xf.pow(2).mean(-1, keepdim=True)) + EPS),
    # [B, S] unsqueezed before S: each row scaled by the statistics of other rows (S == D here)
    "statistic_without_keepdim_unsqueezed_elsewhere":
        lambda xf: xf * torch.rsqrt(xf.pow(2).mean(-1) + EPS).unsqueeze(-2),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("spelling", RMS_SPELLINGS)
def test_rms_norm_spelling_fuses_forward_and_backward(spelling, dtype):
    w = _weight(dtype)
    norm = _hf(RMS_SPELLINGS[spelling])
    result, fw, bw = check(lambda x: norm(x, w), [_input(dtype)], [w], **ON)
    assert not result.misses, result.misses
    assert result.fused(FORWARD) == 1 and result.fused(BACKWARD) == 1
    [site] = [s for s in result.sites if s.op == BACKWARD]
    assert set(site.outputs) == {"dx", "dgamma"}
    assert_paired(fw, bw, 1)


@pytest.mark.parametrize("near_miss", RMS_NEAR_MISSES)
def test_rms_norm_spelling_near_miss_stays_unfused(near_miss):
    w = _weight(torch.float32)
    norm = _hf(RMS_NEAR_MISSES[near_miss])
    result, fw, bw = check(lambda x: norm(x, w), [_input(torch.float32, 2, 16, 16)], [w], **ON)
    assert not result.sites and not calls(fw, FORWARD) and not calls(bw, BACKWARD)


# -- a norm whose output several readers take: dy is the sum of their gradients ---------------

HEAD = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))


def _head_and_auxiliary_loss(x, w):
    """A final norm feeding an extra head and squared in an auxiliary loss."""
    y = F.rms_norm(x, (16,), w, EPS)
    return F.linear(y, HEAD.to(x.dtype)).float().sum(-1) + y.float().pow(2).sum(-1)


def _head_and_loss_of_the_statistic(x, w):
    """Near miss: the auxiliary loss reads the statistic itself, whose gradient reaches x outside
    anything the fused op's dy can carry."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    y = w * (xf * rstd).to(x.dtype)
    return F.linear(y, HEAD.to(x.dtype)).float().sum(-1) + rstd.squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_norm_read_by_a_head_and_a_loss_fuses(dtype):
    w = _weight(dtype)
    result, fw, bw = check(lambda x: _head_and_auxiliary_loss(x, w), [_input(dtype)], [w], **ON)
    assert not result.misses, result.misses
    assert result.fused(FORWARD) == 1 and result.fused(BACKWARD) == 1
    [site] = [s for s in result.sites if s.op == BACKWARD]
    assert set(site.outputs) == {"dx", "dgamma"}
    assert_paired(fw, bw, 1)


def test_norm_whose_statistic_a_loss_reads_stays_unfused():
    w = _weight(torch.float32)
    result, fw, bw = check(lambda x: _head_and_loss_of_the_statistic(x, w), [_input(torch.float32)], [w], **ON)
    assert not calls(bw, BACKWARD) and not calls(fw, FORWARD), result.sites


# -- a norm feeding one projection that is then split into q, k and v --------------------------------

QKV = torch.randn(48, 16, generator=torch.Generator().manual_seed(6))


def _one_projection_unbound(x, w):
    """An HF-style norm read by one q/k/v projection, viewed as [B, S, 3, N, D] and unbound into q, k, v."""
    xf = x.float()
    y = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    q, k, v = F.linear(y, QKV.to(x.dtype)).view(*x.shape[:-1], 3, 4, 4).unbind(-3)
    return ((q * k).sum(-1, keepdim=True) * v).flatten(-2)


def _one_projection_indexed(x, w):
    """The same projection permuted to [3, B, N, S, D] and indexed (``qkv[0]``, ``qkv[1]``, ``qkv[2]``: selects)."""
    xf = x.float()
    y = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    qkv = F.linear(y, QKV.to(x.dtype)).view(*x.shape[:-1], 3, 4, 4).permute(2, 0, 3, 1, 4)
    return ((qkv[0] * qkv[1]).sum(-1, keepdim=True) * qkv[2]).transpose(1, 2).flatten(-2)


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("split", [_one_projection_unbound, _one_projection_indexed], ids=lambda f: f.__name__[1:])
def test_norm_read_by_one_projection_split_into_q_k_v_fuses(split, dtype, partitioner):
    w = _weight(dtype)
    result, fw, bw = check(lambda x: split(x, w), [_input(dtype)], [w], partitioner=partitioner, **ON)
    assert not result.misses, result.misses
    assert result.fused(FORWARD) == 1 and result.fused(BACKWARD) == 1
    [site] = [s for s in result.sites if s.op == BACKWARD]
    assert set(site.outputs) == {"dx", "dgamma"}
    assert_paired(fw, bw, 1)


# -- RoPE ----------------------------------------------------------------------------------------------

ROPE_ON = dict.fromkeys(forward_options(), True)  # the forward rules' switches
ROPE, ROPE_GRAD = "rotary_position_embedding", "rotary_position_embedding_grad"


def _stack_interleaved(q, cos, sin):
    """Pairs rotated as even and odd lanes, stacked back and flattened, with half-width tables."""
    even, odd = q[..., 0::2], q[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)


def _stack_interleaved_sign_flipped(q, cos, sin):
    """Near miss: the odd lanes' own term negated."""
    even, odd = q[..., 0::2], q[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin - odd * cos), -1).flatten(-2)


@pytest.mark.parametrize("target", ["generic", "a2"])
def test_rope_interleaved_with_half_width_tables_fuses_both_ways(target):
    """On A2 the fused ops take 4-D tables: the backward widens the [S, D/2] tables as the forward
    does (leading axes of size 1), so both fuse."""
    q = torch.randn(2, 4, 6, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    angles = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    cos, sin = angles.cos(), angles.sin()
    result, fw, bw = check(lambda q: _stack_interleaved(q, cos, sin) * 2, [q], target=target, **ROPE_ON)
    assert not result.misses, result.misses
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == 1
    assert len(calls(fw, ROPE)) == len(calls(bw, ROPE_GRAD)) == 1 and calls(fw, ROPE)[0].args[3] == 1


def test_rope_interleaved_with_a_sign_flipped_stays_unfused():
    q = torch.randn(2, 4, 6, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    angles = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    cos, sin = angles.cos(), angles.sin()
    result, fw, bw = check(lambda q: _stack_interleaved_sign_flipped(q, cos, sin) * 2, [q], target="a2", **ROPE_ON)
    assert not result.fused(ROPE) and not result.fused(ROPE_GRAD)
    assert not calls(fw, ROPE) and not calls(bw, ROPE_GRAD)


def _rotation(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def _rotation_sign_flipped(x, cos, sin):  # near miss: rotate_half's halves not negated
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((second, first), dim=-1) * sin


@pytest.mark.parametrize("outer", [_rotation, _rotation_sign_flipped], ids=["rotation", "near_miss"])
def test_rope_applied_twice_fuses_both_forwards(outer):
    """The outer rotation reads the inner one's output: it is read once the inner is a fused op
    (pending until then), so both forwards fuse with both backwards; an outer near miss stays."""
    q = torch.randn(2, 4, 6, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    angles = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    cos, sin = angles.cos(), angles.sin()
    result, fw, bw = check(lambda q: outer(_rotation(q, cos, sin), cos, sin) * 2, [q], **ROPE_ON)
    rotations = 2 if outer is _rotation else 1
    assert result.fused(ROPE) == len(calls(fw, ROPE)) == rotations, result.misses
    assert result.fused(ROPE_GRAD) == len(calls(bw, ROPE_GRAD)) == rotations, result.misses
    assert (not result.misses) == (outer is _rotation), result.misses


# -- a rotation before the heads' transpose, its output flattened (dy a view spanning two axes) --

HEADS_OUTPUTS = {  # name: how the program lays out the rotated [B, S, N, D] for what follows
    "transpose": lambda y: y.transpose(1, 2),
    "reshape": lambda y: y.reshape(y.shape[0], y.shape[1], -1),
    "flatten_heads_and_sequence": lambda y: y.flatten(1),
}


def _tables_per_batch(dtype=torch.float32):
    """[B, S, D] tables passed in (no cos/sin in the graph), read as [B, S, 1, D]."""
    angles = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(2))
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("output", HEADS_OUTPUTS)
def test_rope_before_the_heads_transpose_fuses_both_ways(output, dtype):
    """dy is ``grad.view(B, S, N, D)`` of the flattened output's gradient: read as the fused op's
    4-D dy, the backward fuses with the forward."""
    q = torch.randn(2, 6, 4, 16, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    cos, sin = _tables_per_batch(dtype)
    layout = HEADS_OUTPUTS[output]
    result, fw, bw = check(lambda q: layout(_rotation(q, cos[:, :, None], sin[:, :, None])), [q], **ROPE_ON)
    assert not result.misses, result.misses
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == 1
    assert len(calls(fw, ROPE)) == len(calls(bw, ROPE_GRAD)) == 1


@pytest.mark.parametrize("target", ["generic", "a2"])
@pytest.mark.parametrize("output", HEADS_OUTPUTS)
def test_rope_of_a_projection_viewed_into_heads_and_flattened_fuses_both_ways(output, target):
    """q = proj(x).view(B, S, N, D), rotated and flattened back: the N * D wide views on both sides
    match no mode; read with the heads' views as leaves, the rotation fuses, forward and backward."""
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(64, 32, generator=torch.Generator().manual_seed(4)) / 8)
    cos, sin = _tables_per_batch()
    layout = HEADS_OUTPUTS[output]

    def attention_input(x):
        q = F.linear(x, weight).view(2, 6, 4, 16)
        return layout(_rotation(q, cos[:, :, None], sin[:, :, None]))

    result, fw, bw = check(attention_input, [x], [weight], target=target, **ROPE_ON)
    assert not result.misses, result.misses
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == 1
    assert len(calls(fw, ROPE)) == len(calls(bw, ROPE_GRAD)) == 1


@pytest.mark.parametrize("output", HEADS_OUTPUTS)
def test_rope_before_the_heads_transpose_sign_flipped_is_one_miss_each_way(output):
    q = torch.randn(2, 6, 4, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    cos, sin = _tables_per_batch()
    layout = HEADS_OUTPUTS[output]
    result, fw, bw = check(lambda q: layout(_rotation_sign_flipped(q, cos[:, :, None], sin[:, :, None])), [q],
                           **ROPE_ON)
    assert not calls(fw, ROPE) and not calls(bw, ROPE_GRAD)
    assert sorted(m.op for m in result.misses) == [ROPE, ROPE_GRAD], result.misses


def _rotation_read_by_many(q, cos, sin):
    """x read by the rotation and by six more ops: autograd sums dx with six other gradients of x,
    deeper in the accumulation than the backward rule looks."""
    return _rotation(q, cos, sin).exp() + q.tanh() + q.sigmoid() + q.exp() + q.relu() + q.square() + q.abs()


def test_unmatched_backward_of_a_fused_forward_is_one_recorded_miss():
    """No silent misses: the forward fuses, the backward matches no form, and with tables passed in
    (no cos/sin in the graph to recognise them by) the products by the fused forward's cos and sin
    are still one recorded backward miss that names the forward."""
    q = torch.randn(2, 6, 4, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    cos, sin = _tables_per_batch()
    result, fw, bw = check(lambda q: _rotation_read_by_many(q, cos[:, :, None], sin[:, :, None]), [q], **ROPE_ON)
    assert result.fused(ROPE) == len(calls(fw, ROPE)) == 1 and not calls(bw, ROPE_GRAD)
    [miss] = result.misses
    assert miss.op == ROPE_GRAD and "this rotation's forward fused" in miss.reason, miss


# -- torchtitan's complex freqs_cis at sequence length 1 (a decode step's shapes) ------------------

def _conjugated_pairs_rope(x, freqs_cis):
    """Near miss: x's pairs conjugated before the product (a reflection, no rotation)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)).conj()
    return torch.view_as_real(pairs * freqs_cis).flatten(3).type_as(x)


def _freqs_cis_one_position():
    """torchtitan's ``freqs_cis`` for one position, [S, D/2] with S = 1."""
    angles = torch.rand(1, 8, generator=torch.Generator().manual_seed(2)) * 3
    return torch.polar(torch.ones_like(angles), angles)


def _over_bsnd(freqs_cis):
    """The table viewed in the graph as torchtitan broadcasts it over BSND: [1, S, 1, D/2]."""
    return freqs_cis.view(1, freqs_cis.shape[0], 1, freqs_cis.shape[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_complex_freqs_cis_at_sequence_length_one_fuses_both_ways(dtype):
    """Leading axes all of size 1 on both sides of the table's view hold one element per pair: the
    table is read over its pairs as at any other length, and the forward fuses with the backward."""
    x = torch.randn(2, 1, 4, 16, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    freqs_cis = _freqs_cis_one_position()
    result, fw, bw = check(lambda x: complex_rope(x, _over_bsnd(freqs_cis)) * 2, [x], **ROPE_ON)
    assert not result.misses, result.misses
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == 1
    assert len(calls(fw, ROPE)) == len(calls(bw, ROPE_GRAD)) == 1


def test_complex_freqs_cis_at_sequence_length_one_with_conjugated_pairs_stays_unfused():
    x = torch.randn(2, 1, 4, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_()
    freqs_cis = _freqs_cis_one_position()
    result, fw, bw = check(lambda x: _conjugated_pairs_rope(x, _over_bsnd(freqs_cis)) * 2, [x], **ROPE_ON)
    assert not calls(fw, ROPE) and not calls(bw, ROPE_GRAD) and not result.sites, result.sites
    assert result.misses


# -- learned tables rotating a q that takes no gradient: the backward is dcos and dsin alone --------

def _learned_tables(dtype):
    angles = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    return torch.nn.Parameter(angles.cos().to(dtype)), torch.nn.Parameter(angles.sin().to(dtype))


def _learned_angles(dtype):
    return torch.nn.Parameter(torch.randn(6, 16, generator=torch.Generator().manual_seed(2)).to(dtype))


def _constant_q(dtype):
    return torch.randn(2, 4, 6, 16, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tables", ["parameters", "computed_from_a_parameter"])
def test_learned_tables_of_a_constant_q_fuse_both_ways(tables, dtype):
    """dcos = sum(dy * q) and dsin = sum(dy * rotate_half(q)) are the fused backward's with q passed and
    its dx unused; with rotate_half(q) no longer saved for them, the forward fuses too."""
    if tables == "parameters":
        cos, sin = _learned_tables(dtype)
        params, fn = [cos, sin], lambda q: _rotation(q, cos, sin) * 2
    else:
        angles = _learned_angles(dtype)
        params, fn = [angles], lambda q: _rotation(q, angles.cos(), angles.sin()) * 2
    result, fw, bw = check(fn, [_constant_q(dtype)], params, **ROPE_ON)
    assert not result.misses, result.misses
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == 1
    [site] = [s for s in result.sites if s.op == ROPE_GRAD]
    assert set(site.outputs) == {"dcos", "dsin"}
    assert len(calls(fw, ROPE)) == len(calls(bw, ROPE_GRAD)) == 1


def test_learned_tables_of_a_constant_q_sign_flipped_stay_unfused():
    cos, sin = _learned_tables(torch.float32)
    result, fw, bw = check(lambda q: _rotation_sign_flipped(q, cos, sin) * 2, [_constant_q(torch.float32)],
                           [cos, sin], **ROPE_ON)
    assert not calls(fw, ROPE) and not calls(bw, ROPE_GRAD) and not result.sites, result.sites


# -- a norm over a last axis of size 1 ----------------------------------------------------------------

UNIT_AXIS_NORMS = {  # name: a norm of x over its last axis of size 1 with a weight w of shape [1]
    "functional": lambda x, w: F.rms_norm(x, (1,), w, EPS),
    "rsqrt_of_mean": lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w,
    "hf_division_by_sqrt": _hf(RMS_SPELLINGS["division_by_sqrt"]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("norm", UNIT_AXIS_NORMS)
def test_norm_over_a_unit_axis_fuses_forward_and_backward(norm, dtype):
    """hidden = 1: autograd writes the backward without the sum over the normalized axis (a sum over
    one element is elided), which the algebra reads as that sum (its summand): both ways fuse."""
    w = _weight(dtype, d=1)
    result, fw, bw = check(lambda x: UNIT_AXIS_NORMS[norm](x, w), [_input(dtype, 2, 3, 1)], [w], **ON)
    assert not result.misses, result.misses
    assert result.fused(FORWARD) == 1 and result.fused(BACKWARD) == 1
    [site] = [s for s in result.sites if s.op == BACKWARD]
    assert set(site.outputs) == {"dx", "dgamma"}
    assert_paired(fw, bw, 1)


UNIT_AXIS_READERS = {  # name: what the program computes from a unit-axis norm's output y (dy is no leaf)
    "squared": lambda y: y.pow(2),
    "exp_times_two": lambda y: (y * 2).exp(),
    "head_and_auxiliary_loss": lambda y: F.linear(y, HEAD[:, :1].to(y.dtype)).float().sum(-1) + y.float().pow(2).sum(-1),
}


#: (norm, dtype) of the unit-axis tests with a computed dy: a bf16 statistic (``rsqrt_of_mean`` in bf16)
#: makes dx = rstd*dy*g*(1 - (rstd*x)**2) nothing but the rounding error of rstd (eps/x**2 is
#: far below bf16's step), which the fused and the unfused backward each give by chance
UNIT_AXIS_CONDITIONED = [(norm, dtype) for norm in UNIT_AXIS_NORMS for dtype in (torch.bfloat16, torch.float32)
                         if not (norm == "rsqrt_of_mean" and dtype == torch.bfloat16)]


@pytest.mark.parametrize("reader", UNIT_AXIS_READERS)
@pytest.mark.parametrize("norm,dtype", UNIT_AXIS_CONDITIONED, ids=str)
def test_norm_over_a_unit_axis_with_a_computed_dy_fuses_forward_and_backward(norm, dtype, reader):
    """hidden = 1 and the output read again: dy is computed from y and the incoming gradient, no
    leaf of the backward. Its roles are found among the nodes dx is computed from, each assignment
    checked against the whole formula (a weight first: ``dy * g`` with no weight is the same
    value), so dx, dgamma and the forward fuse (they were one recorded miss each way)."""
    w = _weight(dtype, d=1)
    result, fw, bw = check(lambda x: UNIT_AXIS_READERS[reader](UNIT_AXIS_NORMS[norm](x, w)),
                           [_input(dtype, 2, 3, 1)], [w], **ON)
    assert not result.misses, result.misses
    assert result.fused(FORWARD) == 1 and result.fused(BACKWARD) == 1
    [site] = [s for s in result.sites if s.op == BACKWARD]
    assert set(site.outputs) == {"dx", "dgamma"}
    assert_paired(fw, bw, 1)


class _SignFlippedUnitNorm(torch.autograd.Function):
    """An RMSNorm over a unit axis whose dx has its second term's sign flipped: no RMSNorm backward."""

    @staticmethod
    def forward(ctx, x, w):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        ctx.save_for_backward(x, w, rstd)
        return x * rstd * w

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        return rstd * dy * w + rstd ** 3 * x * (dy * w * x), (dy * x * rstd).sum((0, 1))


def test_norm_over_a_unit_axis_with_a_sign_flipped_dx_keeps_its_dx():
    """No sum tells dx's terms apart over a unit axis: the whole formula does, and a flipped sign fails it."""
    w = _weight(torch.float32, d=1)
    result, fw, bw = check(lambda x: _SignFlippedUnitNorm.apply(x, w), [_input(torch.float32, 2, 16, 1)], [w], **ON)
    assert not any("dx" in s.outputs for s in result.sites) and not calls(fw, FORWARD), result.sites


@pytest.mark.parametrize("near_miss", ["power_minus_0.4", "division_by_sqrt_eps_outside"])
def test_norm_over_a_unit_axis_near_miss_stays_unfused(near_miss):
    """One step from an RMSNorm over a unit axis (no sum tells the roles apart there): unfused both ways."""
    w = _weight(torch.float32, d=1)
    norm = _hf(RMS_NEAR_MISSES[near_miss])
    result, fw, bw = check(lambda x: norm(x, w), [_input(torch.float32, 2, 16, 1)], [w], **ON)
    assert not result.sites and not calls(fw, FORWARD) and not calls(bw, BACKWARD), result.sites
