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
