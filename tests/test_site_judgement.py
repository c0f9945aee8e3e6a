"""One judgement per site (issue 30): a norm or a rotation is one site with a forward and a backward,
and its two rules must not judge it differently. Each program below rounds a value of the site (a
table, a weight, x, per lane or per copy) and runs through the ``npu_fusion`` backend with both
forward rules on, under both partitioners: outputs and every gradient pass the float64 criterion
(``check``: the float64 reference keeps the program's roundings, so a fused op that drops one fails
it), and the site is fused both ways (the fused ops read the rounded value the program reads
everywhere) or refused both ways with the same reason."""
import pytest
import torch

from test_forward_fusion import calls, check

ROPE, ROPE_GRAD, NORM, NORM_GRAD = ("rotary_position_embedding", "rotary_position_embedding_grad", "rms_norm",
                                    "rms_norm_grad")
BOTH = {"rope_forward": True, "rms_norm_forward": True}
ROUNDING = "rounds a value inside the site to torch.bfloat16"
PARTITIONERS = ["default", "min_cut"]


def _seeded(seed, *size):
    return torch.randn(*size, generator=torch.Generator().manual_seed(seed))


def rnd(t):
    """A bf16 round trip: the program's own rounding, kept by the float64 reference."""
    return t.to(torch.bfloat16).to(t.dtype)


def rotate_half(q):
    return torch.cat((-q[..., 8:], q[..., :8]), -1)


def halves(t, rounding=rnd):
    """``t`` with its last 8 of 16 lanes rounded."""
    return torch.cat((t[..., :8], rounding(t)[..., 8:]), -1)


COS, SIN, CACHE = _seeded(1, 6, 16), _seeded(2, 6, 16), _seeded(3, 6, 8, 2)


def issue_30(q, cache=CACHE, sin=SIN):
    """Issue 30's program: a table read through a bf16 round trip in half of its lanes, exactly in the other."""
    c = cache.flatten(-2)[..., :16]
    return torch.cat((q[..., :8] * c[..., :8], q[..., 8:] * rnd(c)[..., 8:]), -1) + rotate_half(q) * sin


ROPE_SITES = {  # name: (the rotation of q [2, 4, 6, 16], whether it fuses)
    "issue_30_cache_rounded_in_half_of_its_lanes": (issue_30, False),
    "cos_rounded_in_its_first_lanes_only": (
        lambda q: torch.cat((q[..., :8] * rnd(COS)[..., :8], q[..., 8:] * COS[..., 8:]), -1) + rotate_half(q) * SIN,
        False),
    "x_rounded_in_its_cos_term": (lambda q: rnd(q) * COS + rotate_half(q) * SIN, False),
    "x_rounded_in_its_rotated_term": (lambda q: q * COS + rotate_half(rnd(q)) * SIN, False),
    "x_rounded_in_half_of_its_lanes": (lambda q: halves(q) * COS + rotate_half(q) * SIN, False),
    # the program's tables (or x) are rounded values, read so everywhere: fusing them is right
    "cos_built_of_rounded_halves": (lambda q: q * halves(COS) + rotate_half(q) * SIN, True),
    "cos_rounded_whole": (lambda q: q * rnd(COS) + rotate_half(q) * SIN, True),
    "x_rounded_whole": (lambda q: (lambda r: r * COS + rotate_half(r) * SIN)(rnd(q)), True),
}


def _misses(result, op):
    return [m.reason for m in result.misses if m.op == op]


@pytest.mark.parametrize("partitioner", PARTITIONERS)
@pytest.mark.parametrize("name", ROPE_SITES)
def test_rotation_is_judged_once(name, partitioner):
    rotate, fuses = ROPE_SITES[name]
    q = _seeded(5, 2, 4, 6, 16).requires_grad_()
    result, fw, bw = check(lambda q: rotate(q) * 2, [q], partitioner=partitioner, **BOTH)
    assert len(calls(fw, ROPE)) == result.fused(ROPE) == int(fuses), (result.sites, result.misses)
    assert len(calls(bw, ROPE_GRAD)) == result.fused(ROPE_GRAD) == int(fuses), (result.sites, result.misses)
    if not fuses:
        forward, backward = _misses(result, ROPE), _misses(result, ROPE_GRAD)
        assert len(forward) == len(backward) == 1 and ROUNDING in forward[0], result.misses
        assert forward == backward, result.misses


@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_issue_30_program_is_refused_both_ways_for_its_rounding(partitioner):
    """Issue 30's program as written (its output returned, the cache and sin inputs): the forward rule
    fused it, reading the cache's rounded copy in every lane, and the output was off by the bf16
    rounding of the half the program reads exactly."""
    q = _seeded(5, 2, 4, 6, 16).requires_grad_()
    result, fw, bw = check(issue_30, [q, CACHE, SIN], partitioner=partitioner, **BOTH)
    assert not calls(fw, ROPE) and not calls(bw, ROPE_GRAD), (result.sites, result.misses)
    forward, backward = _misses(result, ROPE), _misses(result, ROPE_GRAD)
    assert len(forward) == len(backward) == 1 and ROUNDING in forward[0] and forward == backward, result.misses


W16 = _seeded(4, 16)


def _norm(x, w, statistic_of=None, times=None):
    s = x if statistic_of is None else statistic_of
    return (x if times is None else times) * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w


NORM_SITES = {  # name: (the norm of x [2, 3, 16] with weight w, whether it fuses)
    "statistic_of_a_rounded_copy_of_x": (lambda x, w: _norm(x, w, statistic_of=rnd(x)), False),
    "x_rounded_where_the_statistic_scales_it": (lambda x, w: _norm(x, w, times=rnd(x)), False),
    # rounded values read so everywhere: fusing them is right
    "weight_rounded_in_half_of_its_lanes": (lambda x, w: _norm(x, halves(w)), True),
    "weight_rounded_whole": (lambda x, w: _norm(x, rnd(w)), True),
    "x_rounded_whole": (lambda x, w: _norm(rnd(x), w), True),
}


@pytest.mark.parametrize("partitioner", PARTITIONERS)
@pytest.mark.parametrize("name", NORM_SITES)
def test_norm_is_judged_once(name, partitioner):
    norm, fuses = NORM_SITES[name]
    x = _seeded(6, 2, 3, 16).requires_grad_()
    w = torch.nn.Parameter(W16.clone())
    result, fw, bw = check(lambda x: norm(x, w), [x], [w], partitioner=partitioner, **BOTH)
    assert len(calls(fw, NORM)) == result.fused(NORM) == int(fuses), (result.sites, result.misses)
    assert len(calls(bw, NORM_GRAD)) == result.fused(NORM_GRAD) == int(fuses), (result.sites, result.misses)
    if not fuses:
        forward, backward = _misses(result, NORM), _misses(result, NORM_GRAD)
        assert len(forward) == len(backward) == 1 and ROUNDING in backward[0], result.misses
        assert forward == backward, result.misses


def gptj_rotate(q):
    return torch.stack((-q[..., 1::2], q[..., ::2]), -1).flatten(-2)


TARGET_SITES = {  # name: (q's shape, the rotation of q, the target, the reason both rules refuse it for; None: fuses)
    # a [S, D] table is 11SD to both rules (the forward rule unsqueezed it, the backward called A2 on a 2-D cos)
    "table_of_two_axes_on_a2": ((2, 4, 6, 16), lambda q: q * COS + rotate_half(q) * SIN, "a2", None),
    "transposed_q_on_a2": ((2, 6, 4, 16), lambda q: (lambda t: t * COS + rotate_half(t) * SIN)(q.transpose(1, 2)),
                           "a2", None),
    "thousand_heads_on_a2": ((2, 1000, 6, 16), lambda q: q * COS + rotate_half(q) * SIN, "a2",
                             "A2/A3 half mode needs B < 1000, N < 1000"),
    "interleave_over_1200_heads_on_a2": ((2, 600, 6, 16), lambda q: q * COS + gptj_rotate(q) * SIN, "a2",
                                         "A2/A3 interleave mode needs B*N < 1000"),
    "three_axes_on_a2": ((6, 4, 16), lambda q: q * COS[:, None] + rotate_half(q) * SIN[:, None], "a2",
                         "A2/A3 need 4-D dy and cos/sin"),
    "three_axes_on_950": ((6, 4, 16), lambda q: q * COS[:, None] + rotate_half(q) * SIN[:, None], "950", None),
}


@pytest.mark.parametrize("name", TARGET_SITES)
def test_rotation_is_judged_once_by_the_target(name):
    """The target's verdict on a rotation is made on the shapes both rules call their op with (tables
    right-aligned to the rotated tensor's rank, in the output's memory order): one verdict, one reason."""
    size, rotate, target, refused = TARGET_SITES[name]
    q = _seeded(5, *size).requires_grad_()
    result, fw, bw = check(rotate, [q], target=target, **BOTH)
    fuses = int(refused is None)
    assert len(calls(fw, ROPE)) == result.fused(ROPE) == fuses, (result.sites, result.misses)
    assert len(calls(bw, ROPE_GRAD)) == result.fused(ROPE_GRAD) == fuses, (result.sites, result.misses)
    if refused is not None:
        forward, backward = _misses(result, ROPE), _misses(result, ROPE_GRAD)
        assert len(forward) == len(backward) == 1 and refused in forward[0] and forward == backward, result.misses


SWIGLU, SWIGLU_GRAD = "swiglu", "swiglu_grad"
GLU_ON = {"swiglu": True, "swiglu_forward": True}


def _glu(gate=lambda g: g, up=lambda u: u, silu=lambda s: s, product=lambda y: y, projection=lambda h: h):
    """``silu(gate) * up`` of the halves of the projection ``x @ w``, each value passed through its function."""
    def program(x, w):
        g, u = projection(x @ w).chunk(2, dim=-1)
        return product(silu(torch.nn.functional.silu(gate(g))) * up(u))
    return program


SWIGLU_SITES = {  # name: (the program of x [2, 3, 16], (forward fuses, backward fuses))
    "gate_rounded_in_half_of_its_lanes": (_glu(gate=halves), (False, False)),
    "gate_rounded_whole": (_glu(gate=rnd), (False, False)),
    "up_rounded_whole": (_glu(up=rnd), (False, False)),
    "up_rounded_in_half_of_its_lanes": (_glu(up=halves), (False, False)),
    "silu_rounded": (_glu(silu=rnd), (False, False)),
    "product_rounded": (_glu(product=rnd), (False, False)),
    # the halves of a rounded copy of the projection: the rules read the projection before the
    # copy (casts are identities of the lanes domain), so both refuse it (both fused it, reading
    # the unrounded projection, and the output and the gradients were off by bf16's rounding)
    "projection_rounded_whole": (_glu(projection=rnd), (False, False)),
}


@pytest.mark.parametrize("partitioner", PARTITIONERS)
@pytest.mark.parametrize("name", SWIGLU_SITES)
def test_swiglu_is_judged_once(name, partitioner):
    """A SwiGLU site with a rounding in one of its values: outputs and every gradient pass the
    float64 criterion whatever each rule decides, a forward fuses only with its backward fused
    (the forward waits for it), each direction ends fused or as one recorded miss, and a site
    refused both ways says why in both (the backward's verdict binds the forward)."""
    program, (forward_fuses, backward_fuses) = SWIGLU_SITES[name]
    x, w = _seeded(8, 2, 3, 16).requires_grad_(), (_seeded(7, 16, 16) / 4).requires_grad_()
    result, fw, bw = check(program, [x, w], **GLU_ON, partitioner=partitioner)
    assert len(calls(fw, SWIGLU)) == result.fused(SWIGLU) == int(forward_fuses), (result.sites, result.misses)
    assert len(calls(bw, SWIGLU_GRAD)) == result.fused(SWIGLU_GRAD) == int(backward_fuses), (result.sites, result.misses)
    for op, fuses in ((SWIGLU, forward_fuses), (SWIGLU_GRAD, backward_fuses)):
        assert len(_misses(result, op)) == int(not fuses), result.misses
    if not forward_fuses and not backward_fuses:  # the site's own reason both ways, not "waits for its backward"
        assert not any("decomposed backward" in m for m in _misses(result, SWIGLU)), result.misses
