"""RoPE on a 3-D q with ``[S, D]`` tables: heads folded into the batch (``[B*H, S, D]``, GPT-NeoX-style
code and many tutorials) or one head (``[B, S, D]``). The op reads a 3-D tensor as TND, whose tables
vary along its first axis; these tables broadcast over it, so the pass runs the op as BNSD on views
with an axis of size 1 inserted (``[A, 1, S, D]``, tables ``[1, 1, S, D]``) and views the results
back. Each program is compiled by ``backend="npu_fusion"`` (every rule on, ``strict``), run under
``torch.no_grad()`` (an inference graph) and trained one step (a joint graph, backward through q),
its output and every gradient checked against eager by the float64 criterion; near misses stay
unfused, each a recorded miss."""
import re

import pytest
import torch
import torch.nn.functional as F

from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_output
from npu_fusion.models import rotate_half
from npu_fusion.plugin.backend import aot_backend
from npu_fusion.plugin.options import FusionOptions, forward_options
from test_forward_fusion import calls, check_gradients

ROPE, ROPE_GRAD = "rotary_position_embedding", "rotary_position_embedding_grad"
ROPE_ON = dict.fromkeys(forward_options(), True)
S, D = 6, 16


def _seeded(seed, *size):
    return torch.randn(*size, generator=torch.Generator().manual_seed(seed))


def _tables(dtype=torch.float32, *size):
    angles = _seeded(2, *(size or (S, D)))
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _half(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def _interleave(x, cos, sin):
    even, odd = x[..., 0::2], x[..., 1::2]
    return x * cos + torch.stack((-odd, even), -1).flatten(-2) * sin


def _half_sign_flipped(x, cos, sin):  # near miss: rotate_half's halves not negated
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((second, first), dim=-1) * sin


SPELLINGS = {"half": (_half, 0), "interleave": (_interleave, 1)}  # name: (rotation, the op's mode)
TABLE_SHAPES = {"S_D": lambda t: t, "1_S_D": lambda t: t[None]}


def compiled_step(fn, inputs, params=(), dynamic=False, **options):
    """``fn`` compiled by the ``npu_fusion`` backend (``strict``, target ``generic`` unless ``options``
    say otherwise, the forward rules on), run without gradient and trained one step, each checked
    against eager by the float64 criterion; returns ``{graph kind: (the pass's result, the graph after
    it)}`` for the inference and the joint graph (the last compiled of each)."""
    seen = {}

    def around(gm, run):
        result = run()
        seen[result.graph] = (result, gm.graph)

    torch._dynamo.reset()
    options = FusionOptions.from_mapping(dict({"strict": True, "target": "generic"}, **ROPE_ON, **options))
    compiled = torch.compile(fn, backend=aot_backend(options, around), dynamic=dynamic)
    with torch.no_grad():
        got, eager, exact = compiled(*inputs), fn(*inputs), float64_output(fn, inputs, params)
    assert got.dtype == eager.dtype and got.shape == eager.shape
    assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)
    check_gradients(compiled, fn, inputs, params)
    assert set(seen) == {"inference", "joint"}, seen
    return seen


def _shapes(call):
    """The shapes the fused call reads its rotated tensor and its cos as."""
    return [tuple(call.args[i].meta["val"].shape) for i in (0, 1)]


def assert_fused_as_bnsd(seen, sites=1, mode=0, rows=None):
    """``sites`` rotations fused each way with no miss, the ops called on BNSD views with N = 1 and
    11SD tables (``rows``: the folded axis, when static)."""
    for graph, ops in (("inference", (ROPE,)), ("joint", (ROPE, ROPE_GRAD))):
        result, after = seen[graph]
        assert not result.misses, (graph, result.misses)
        for op in ops:
            assert result.fused(op) == len(calls(after, op)) == sites, (graph, op, result.sites)
            for call in calls(after, op):
                (a, one, s, d), table = _shapes(call)
                assert one == 1 and table[:2] == (1, 1) and table[-1] == d == D, _shapes(call)
                assert rows is None or (a, s, table[2]) == (rows, S, S), _shapes(call)
                assert call.args[-1] == mode
    # the tables take no gradient: the fused backward computes dx only, without x
    assert all(call.args[3] is None for call in calls(seen["joint"][1], ROPE_GRAD))


# -- the spellings: [B*H, S, D] with [S, D] and [1, S, D] tables -----------------------------------

@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tables", TABLE_SHAPES)
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_rope_of_a_3d_q_with_sequence_tables_fuses_both_ways(spelling, tables, dtype, dynamic):
    rotation, mode = SPELLINGS[spelling]
    cos, sin = (TABLE_SHAPES[tables](t) for t in _tables(dtype))
    q = _seeded(1, 8, S, D).to(dtype).requires_grad_()
    seen = compiled_step(lambda q: rotation(q, cos, sin) * 2, [q], dynamic=dynamic)
    assert_fused_as_bnsd(seen, mode=mode, rows=None if dynamic else 8)


# -- the programs they come from: projections folded into [B*H, S, D] or one head [B, S, D] ---------

B, H = 2, 2


def _neox_style_attention_scores(x, weight, cos, sin, rotation=_half):
    """q and k projected together, heads folded into the batch, rotated, and multiplied by bmm."""
    q, k = F.linear(x, weight).view(B, S, 2, H, D).permute(2, 0, 3, 1, 4).reshape(2, B * H, S, D).unbind(0)
    return torch.bmm(rotation(q, cos, sin), rotation(k, cos, sin).transpose(1, 2))


def _one_head_attention_scores(x, weight, cos, sin, rotation=_half):
    """A tutorial's single-head attention: q and k each [B, S, D]."""
    q, k = F.linear(x, weight).chunk(2, dim=-1)
    return rotation(q, cos, sin) @ rotation(k, cos, sin).transpose(-1, -2)


PROGRAMS = {"heads_in_batch": (_neox_style_attention_scores, 2 * H * D), "one_head": (_one_head_attention_scores, 2 * D)}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("program", PROGRAMS)
def test_rope_of_projected_3d_q_and_k_fuses_both_ways(program, spelling, dynamic):
    """Both rotations of a projection's q and k, each as BNSD with N = 1, gradients reaching the weight."""
    scores, width = PROGRAMS[program]
    rotation, mode = SPELLINGS[spelling]
    cos, sin = _tables()
    weight = torch.nn.Parameter(_seeded(4, width, 32) / 8)
    x = _seeded(1, B, S, 32).requires_grad_()
    seen = compiled_step(lambda x: scores(x, weight, cos, sin, rotation), [x], [weight], dynamic=dynamic)
    assert_fused_as_bnsd(seen, sites=2, mode=mode, rows=None if dynamic else B * H if program == "heads_in_batch" else B)



@pytest.mark.parametrize("stage, partitioner", [("backward", "default"), ("joint", "min_cut")],
                         ids=["partitioned_backward", "min_cut"])
def test_rope_of_heads_folded_into_the_batch_fuses_after_the_partition_and_under_min_cut(stage, partitioner):
    """The backward graph after the partition (with its forward for provenance, as torchair's hook
    sees it), and the joint graph under min-cut: both rotations' backwards fuse, gradients as eager's."""
    seen = {}

    def around(gm, run):
        result = run()
        seen[result.graph] = (result, gm.graph)

    cos, sin = _tables()
    weight = torch.nn.Parameter(_seeded(4, 2 * H * D, 32) / 8)
    x = _seeded(1, B, S, 32).requires_grad_()
    torch._dynamo.reset()
    options = FusionOptions.from_mapping(dict({"strict": True, "target": "generic", "partitioner": partitioner},
                                              **ROPE_ON))
    compiled = torch.compile(lambda x: _neox_style_attention_scores(x, weight, cos, sin),
                             backend=aot_backend(options, around, stage=stage))
    check_gradients(compiled, lambda x: _neox_style_attention_scores(x, weight, cos, sin), [x], [weight])
    result, after = seen[stage]
    assert not result.misses and result.fused(ROPE_GRAD) == len(calls(after, ROPE_GRAD)) == 2, result.misses
    assert all(_shapes(call) == [(B * H, 1, S, D), (1, 1, S, D)] for call in calls(after, ROPE_GRAD))

def test_learned_sequence_tables_of_a_3d_q_fuse_with_their_gradients():
    """[S, D] tables that take a gradient: x is passed and dcos, dsin (summed over the folded axis, as
    the program sums them over q's first) come back in the tables' shape."""
    cos, sin = (torch.nn.Parameter(t) for t in _tables())
    q = _seeded(1, 8, S, D).requires_grad_()
    seen = compiled_step(lambda q: _half(q, cos, sin) * 2, [q], [cos, sin])
    result, after = seen["joint"]
    assert not result.misses and result.fused(ROPE) == result.fused(ROPE_GRAD) == 1, result.misses
    [site] = [s for s in result.sites if s.op == ROPE_GRAD]
    assert set(site.outputs) == {"dx", "dcos", "dsin"}
    [call] = calls(after, ROPE_GRAD)
    assert call.args[3] is not None and _shapes(call) == [(8, 1, S, D), (1, 1, S, D)]


# -- Atlas A2: BNSD with 11SD tables, within its limits on B = B*H ----------------------------------

@pytest.mark.parametrize("spelling", SPELLINGS)
def test_rope_of_a_3d_q_fuses_on_a2(spelling):
    rotation, mode = SPELLINGS[spelling]
    cos, sin = _tables()
    seen = compiled_step(lambda q: rotation(q, cos, sin) * 2, [_seeded(1, 8, S, D).requires_grad_()], target="a2")
    assert_fused_as_bnsd(seen, mode=mode, rows=8)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_rope_of_a_3d_q_over_a2s_batch_limit_is_one_recorded_miss_each_way(spelling):
    """1024 rows folded into B: over A2's limit of B (half) or B*N (interleave), said in the op's
    4-D terms; the op's TND reading is not the reason (the site is no TND rotation)."""
    rotation, _ = SPELLINGS[spelling]
    cos, sin = _tables()
    seen = compiled_step(lambda q: rotation(q, cos, sin) * 2, [_seeded(1, 1024, S, D).requires_grad_()], target="a2")
    for graph, ops in (("inference", [ROPE]), ("joint", [ROPE, ROPE_GRAD])):
        result, after = seen[graph]
        assert not result.sites and not calls(after, ROPE) and not calls(after, ROPE_GRAD)
        assert sorted(m.op for m in result.misses) == ops, result.misses
        for miss in result.misses:
            assert miss.reason.startswith("A2/A3") and "BNSD, B=1024, N=1" in miss.reason, miss.reason


# -- near misses: each stays as it is, one recorded miss each way -----------------------------------

#: the two rules' reasons for tables of two shapes (the forward op's input check; the backward's own)
SHAPES_DIFFER = r"cos and sin must have the same shape, got \[|cos \[6, 16\] and sin \[[0-9, ]+\] have different shapes"

NEAR_MISSES = {  # name: (q's rows, the rotation with its tables, what each miss says)
    "rotate_half_sign_flipped": (8, lambda q, cos, sin: _half_sign_flipped(q, cos, sin), "no mode's formula"),
    # sin [S, 1, D] broadcast over the sequence axis (rows == S), cos over the rows: two layouts
    "sin_broadcast_over_the_other_axis": (S, lambda q, cos, sin: _half(q, cos, sin[:, None]), SHAPES_DIFFER),
    # sin one row for every position: not cos's shape
    "sin_of_one_position": (8, lambda q, cos, sin: _half(q, cos, sin[:1]), SHAPES_DIFFER),
}


@pytest.mark.parametrize("near_miss", NEAR_MISSES)
def test_rope_of_a_3d_q_near_miss_is_one_recorded_miss_each_way(near_miss):
    rows, rotation, reason = NEAR_MISSES[near_miss]
    cos, sin = _tables()
    seen = compiled_step(lambda q: rotation(q, cos, sin) * 2, [_seeded(1, rows, S, D).requires_grad_()])
    for graph, ops in (("inference", [ROPE]), ("joint", [ROPE, ROPE_GRAD])):
        result, after = seen[graph]
        assert not result.sites and not calls(after, ROPE) and not calls(after, ROPE_GRAD)
        assert sorted(m.op for m in result.misses) == ops, (graph, result.misses)
        assert all(re.search(reason, m.reason) for m in result.misses), result.misses


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_rope_of_one_sequence_of_one_head_fuses_on_a2(spelling):
    """q ``[1, S, D]``: TND with T = 1 reads it too, but A2 takes only 4-D tensors; as BNSD with
    B = N = 1 and 11SD tables it fuses there."""
    rotation, mode = SPELLINGS[spelling]
    cos, sin = _tables()
    seen = compiled_step(lambda q: rotation(q, cos, sin) * 2, [_seeded(1, 1, S, D).requires_grad_()], target="a2")
    assert_fused_as_bnsd(seen, mode=mode, rows=1)
