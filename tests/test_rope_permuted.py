"""Rotations of a transposed q that share their ``[S, D]`` tables with a rotation in another layout.

q ``[B, S, N, D]`` transposed to ``[B, N, S, D]`` and rotated with the ``[S, D]`` tables themselves,
beside k rotated in ``[B, S, N, D]`` with ``cos[:, None]`` (or the other way round, the rotation
transposed after it), each returned and reused (``qr * 3, qr``). The ``[S, D]`` table is then a
value the backward reads directly, and its ``[S, 1, D]`` view was read over two tracked axes, so the
BSND rotation's ``dy * cos[:, None]`` was refused ("broadcast") and its backward a recorded miss,
under the ``npu_fusion`` backend with static shapes and through Inductor (both shapes). The view is
now read as a leaf: both rotations fuse each way. Near misses (the tables paired with other rows, a
sign flipped, the last axis moved) stay unfused and are recorded misses whose reasons name the
difference. Outputs and gradients are checked against eager by the float64 criterion."""
import pytest
import torch

from test_inductor import installed  # noqa: F401  (the fixture: the pass in Inductor, compile caches off)
from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_output
from npu_fusion.models import rotate_half
from npu_fusion.plugin.backend import aot_backend
from npu_fusion.plugin.options import FusionOptions, forward_options
from npu_fusion.plugin.pass_manager import COUNTER
from test_forward_fusion import calls, check_gradients

ROPE, ROPE_GRAD = "rotary_position_embedding", "rotary_position_embedding_grad"
B, S, N, D = 2, 6, 4, 16


def rotate(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def _rot_sign_flipped(x, cos, sin):  # near miss: rotate_half's halves not negated
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((second, first), dim=-1) * sin


def transposed_then_rotated(q, k, cos, sin):
    qr = rotate(q.transpose(1, 2), cos, sin)
    return qr * 3, qr, rotate(k, cos[:, None], sin[:, None])


def rotated_then_transposed(q, k, cos, sin):
    qr = rotate(q, cos[:, None], sin[:, None]).transpose(1, 2)
    return qr * 3, qr, rotate(k.transpose(1, 2), cos, sin)


def one_q_both_ways(q, k, cos, sin):
    """One q rotated in both layouts: its gradient sums both rotations' dx."""
    qr = rotate(q.transpose(1, 2), cos, sin)
    return qr * 3, qr, rotate(q * 2, cos[:, None], sin[:, None]) + k


PROGRAMS = {f.__name__: f for f in (transposed_then_rotated, rotated_then_transposed, one_q_both_ways)}


# -- near misses: S == N, so that tables aligned with the heads broadcast too ---------------------

def sin_paired_with_the_heads(q, k, cos, sin):
    """k's sin read as ``[1, S, D]``: row n of sin meets head n, cos's row s meets position s."""
    qr = rotate(q.transpose(1, 2), cos, sin)
    return qr * 3, qr, rotate(k, cos[:, None], sin[None])


def sin_transposed_differently(q, k, cos, sin):
    """The same pairing spelled as ``sin[:, None].transpose(0, 1)``, a permute of the leading axes."""
    qr = rotate(q.transpose(1, 2), cos, sin)
    return qr * 3, qr, rotate(k, cos[:, None], sin[:, None].transpose(0, 1))


def sign_flipped(q, k, cos, sin):
    qr = rotate(q.transpose(1, 2), cos, sin)
    return qr * 3, qr, _rot_sign_flipped(k, cos[:, None], sin[:, None])


def last_axis_moved(q, k, cos, sin):
    """k's rotated half read across the heads (``k.transpose(-1, -2)``, N == D): no rotation."""
    qr = rotate(q.transpose(1, 2), cos, sin)
    moved = rotate_half(k.transpose(-1, -2)).transpose(-1, -2)
    return qr * 3, qr, k * cos[:, None] + moved * sin[:, None]


#: name: (program, what k's backward miss says, under static and dynamic shapes alike)
NEAR_MISSES = {"sin_paired_with_the_heads": (sin_paired_with_the_heads, "have different shapes"),
               "sin_transposed_differently": (sin_transposed_differently, "have different shapes"),
               "sign_flipped": (sign_flipped, "no mode's formula")}


def _inputs(dtype, heads=N, d=D):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, heads, d, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(B, S, heads, d, generator=gen).to(dtype).requires_grad_()
    angles = torch.randn(S, d, generator=gen)
    return [q, k, angles.cos().to(dtype), angles.sin().to(dtype)]


def compiled_step(fn, inputs, dynamic, forward_rules=True):
    """``fn`` compiled by the ``npu_fusion`` backend (``strict``, target ``generic``, the forward rules
    on or off) and trained one step; every output and gradient passes the float64 criterion against
    eager. Returns the pass's result on the joint graph and the graph after it."""
    seen = {}

    def around(gm, run):
        result = run()
        seen[result.graph] = (result, gm.graph)

    torch._dynamo.reset()
    options = FusionOptions.from_mapping(dict({"strict": True, "target": "generic"},
                                              **dict.fromkeys(forward_options(), forward_rules)))
    compiled = torch.compile(fn, backend=aot_backend(options, around), dynamic=dynamic)
    with torch.no_grad():
        eager, exact = fn(*inputs), float64_output(fn, inputs)
    got = compiled(*inputs)
    for g, e, x in zip(got, eager, exact):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert_close_as_unfused(g.detach(), e, x, factor=MODEL_FACTOR)
    check_gradients(compiled, fn, inputs)
    return seen["joint"]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("program", PROGRAMS)
def test_rotations_sharing_tables_across_a_transpose_fuse_both_ways(program, dtype, dynamic):
    result, after = compiled_step(PROGRAMS[program], _inputs(dtype), dynamic)
    assert not result.misses, result.misses
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == 2, result.sites
    assert len(calls(after, ROPE)) == len(calls(after, ROPE_GRAD)) == 2
    # the BSND rotation's backward is given the [S, 1, D] view, the BNSD one's the [S, D] table itself
    tables = sorted(tuple(call.args[1].meta["val"].shape) for call in calls(after, ROPE_GRAD))
    assert tables == [(1, 1, S, D), (1, S, 1, D)], tables


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("program", NEAR_MISSES)
def test_near_misses_of_shared_tables_stay_unfused_and_are_recorded(program, dynamic):
    """q's rotation fuses; k's, no rotation by one pair of tables, does not, and is a recorded miss each
    way whose reason names the difference (before the view was read as a leaf, the static backward's
    said only "broadcast")."""
    fn, reason = NEAR_MISSES[program]
    result, after = compiled_step(fn, _inputs(torch.float32, heads=S), dynamic)
    assert result.fused(ROPE) == len(calls(after, ROPE)) == 1, result.sites
    assert result.fused(ROPE_GRAD) == len(calls(after, ROPE_GRAD)) == 1, result.sites
    assert sorted(m.op for m in result.misses) == [ROPE, ROPE_GRAD], result.misses
    [backward] = [m for m in result.misses if m.op == ROPE_GRAD]
    assert reason in backward.reason, backward


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_the_last_axis_moved_is_no_rotation_and_the_miss_says_so(dynamic):
    """k's rotated half read across the heads (N == D): nothing of k's fuses, q's rotation does, and
    k's backward, a gradient times the tables q's fused forward reads, is one recorded miss naming
    the transpose that moves the last axis (the lanes prove values along it only)."""
    result, after = compiled_step(last_axis_moved, _inputs(torch.float32, heads=D), dynamic)
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == 1, (result.sites, result.misses)
    assert len(calls(after, ROPE)) == len(calls(after, ROPE_GRAD)) == 1
    [miss] = result.misses
    assert miss.op == ROPE_GRAD and miss.reason.endswith("(aten.transpose.int): moves the last axis"), miss


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("program", ["transposed_then_rotated", "rotated_then_transposed"])
def test_through_inductor_both_rotations_fuse(installed, program, dynamic):  # noqa: F811
    """Through ``install_inductor`` (its decompositions, min-cut): two sites each way, no miss, and
    outputs and gradients by the float64 criterion."""
    assert inductor_step(PROGRAMS[program], _inputs(torch.float32), dynamic) == {ROPE: 2, ROPE_GRAD: 2}


def inductor_step(fn, inputs, dynamic):
    """``fn`` compiled by Inductor with the pass installed and trained one step; outputs and gradients
    pass the float64 criterion against eager. Returns the pass's counts of fused sites."""
    compiled = torch.compile(fn, dynamic=dynamic)
    with torch.no_grad():
        eager, exact = fn(*inputs), float64_output(fn, inputs)
    for g, e, x in zip(compiled(*inputs), eager, exact):
        assert_close_as_unfused(g.detach(), e, x, factor=MODEL_FACTOR)
    check_gradients(compiled, fn, inputs)
    return dict(torch._dynamo.utils.counters[COUNTER])
