"""Forward RMSNorm and RoPE on values laid out in another memory order than their shape's
(:mod:`npu_fusion.patterns.layout`): the q/k norms of Gemma 3, Apertus, EXAONE 4 and others run
on ``q.view(B, S, H, D).transpose(1, 2)``, BHSD in shape and BSHD in memory, and the rotation
then reads the norm's output. Each fused op runs in that memory order, so every output keeps
exactly the program's strides (the ``view`` a later node does on them stays valid); outputs and
gradients pass the float64 criterion. Where no dense order of the shape has the op's axes
innermost (Zaya's q, BHDS in memory), the op runs in the shape's order and its outputs are copied
into the program's layout."""
import pytest
import torch
import torch.fx as fx

from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_output
from npu_fusion.patterns.layout import memory_order
from npu_fusion.patterns.pairing import source
from npu_fusion.plugin.options import forward_options
from test_forward_fusion import _compile, calls, check_gradients

NORM, NORM_GRAD = "rms_norm", "rms_norm_grad"
ROPE, ROPE_GRAD = "rotary_position_embedding", "rotary_position_embedding_grad"
BOTH = dict.fromkeys(forward_options(), True)  # the forward rules' switches
EPS = 1e-6
B, S, D = 2, 5, 8


def _outputs(out):
    return out if isinstance(out, (tuple, list)) else (out,)


def check(fn, inputs, params=(), mark_dynamic=(), **options):
    """``fn`` compiled with the pass: each output has eager's dtype, shape and strides and passes
    the float64 criterion, and so does every gradient. Returns (result, forward graph, backward
    graph)."""
    compiled, seen = _compile(fn, options)
    for tensor, dims in mark_dynamic:
        for dim in dims:
            torch._dynamo.mark_dynamic(tensor, dim)
    with torch.no_grad():
        eager, exact = _outputs(fn(*inputs)), _outputs(float64_output(fn, inputs, params))
        got = _outputs(compiled(*inputs))
    for g, e, x in zip(got, eager, exact):
        assert g.dtype == e.dtype and g.shape == e.shape and g.stride() == e.stride(), (g.stride(), e.stride())
        assert_close_as_unfused(g, e, x, factor=MODEL_FACTOR)
    check_gradients(compiled, fn, inputs, params)
    return seen["result"], seen["fw"].graph, seen["bw"].graph


def _weight(dtype, seed):
    return torch.nn.Parameter(torch.randn(D, generator=torch.Generator().manual_seed(seed)).to(dtype))


def hf_norm(x, w):  # LlamaRMSNorm / Gemma 3's q_norm: statistics in float32
    x32 = x.to(torch.float32)
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def rotate(x, cos, sin):  # HF apply_rotary_pos_emb, tables [S, D] broadcast over B and H
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


def _tables(s=S):
    angles = torch.randn(s, D, generator=torch.Generator().manual_seed(2))
    return angles.cos(), angles.sin()


def _projections(dtype, heads=(3, 2), s=S):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(B, s, h * D, generator=g).to(dtype).requires_grad_() for h in heads]


def _heads(p):  # [B, S, H*D] -> [B, H, S, D], BSHD in memory
    b, s, width = p.shape
    return p.view(b, s, width // D, D).transpose(1, 2)


def _merged(y):  # the attention output's view: valid only on y's BSHD memory order
    b, h, s, d = y.shape
    return y.transpose(1, 2).reshape(b, s, h * d)


def _assert_paired(fw, bw, sites):
    """Each fused backward's rstd is a fused forward op's (saved, through the permute and copy
    into the program's keep-dim layout)."""
    by_name = {n.name: n for n in fw.nodes}
    forward_ops = calls(fw, NORM)
    assert len(forward_ops) == sites and not calls(fw, "rsqrt")
    grads = calls(bw, NORM_GRAD)
    assert len(grads) == sites
    for grad in grads:
        rstd = source(grad.args[2])
        assert rstd.op == "placeholder" and source(by_name[rstd.name]) in forward_ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_qk_norms_of_transposed_views_fuse_in_their_memory_order(dtype):
    """q and k normalized per head on their transposed views (different head counts, so
    different strides), each output read by a view valid only on its own strides."""
    wq, wk = _weight(dtype, 3), _weight(dtype, 4)
    q, k = _projections(dtype)

    def attention_inputs(q, k):
        qn, kn = hf_norm(_heads(q), wq), hf_norm(_heads(k), wk)
        return qn, _merged(qn) * 2, _merged(kn)

    result, fw, bw = check(attention_inputs, [q, k], [wq, wk], **BOTH)
    assert not result.misses, result.misses
    assert result.fused(NORM) == result.fused(NORM_GRAD) == 2
    _assert_paired(fw, bw, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rotation_of_a_transposed_norm_output_fuses(dtype):
    """Gemma 3's attention inputs: the rotation reads the q/k norm's output. Unfused, the norm's
    forward left the rotation's x a product the rotation rule cannot read as x, and its miss read
    "no forward RoPE form reads its forward"; with the norm fused both fuse."""
    wq, wk = _weight(dtype, 3), _weight(dtype, 4)
    q, k = _projections(dtype)
    cos, sin = (t.to(dtype) for t in _tables())

    def attention_inputs(q, k):
        return rotate(hf_norm(_heads(q), wq), cos, sin), rotate(hf_norm(_heads(k), wk), cos, sin)

    result, fw, bw = check(attention_inputs, [q, k], [wq, wk], **BOTH)
    assert not result.misses, result.misses
    assert result.fused(NORM) == result.fused(NORM_GRAD) == 2
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == 2 and len(calls(fw, ROPE)) == 2
    _assert_paired(fw, bw, 2)


def test_unfused_graph_has_the_same_output_strides():
    """The strides the fused graph returns are the unfused graph's (both compiled), not only
    eager's."""
    w = _weight(torch.float32, 3)
    (q,) = _projections(torch.float32, heads=(3,))
    cos, sin = _tables()

    def fn(q):
        n = hf_norm(_heads(q), w)
        return n, rotate(n, cos, sin)

    strides = {}
    for name, options in (("unfused", {"rms_norm_forward": False, "rope_forward": False}),
                          ("fused", BOTH)):
        compiled, seen = _compile(fn, options)
        strides[name] = [o.stride() for o in compiled(q)]
        assert seen["result"].fused(NORM) == (1 if name == "fused" else 0)
    assert strides["fused"] == strides["unfused"] == [(120, 8, 24, 1)] * 2


def test_symbolic_batch_and_sequence():
    """A symbolic batch (the tables fix the sequence): the memory order is read off symbolic
    strides, compared as expressions, no guard."""
    w = _weight(torch.float32, 3)
    q, k = _projections(torch.float32, s=6)
    cos, sin = _tables(6)

    def fn(q, k):
        return rotate(hf_norm(_heads(q), w), cos, sin), _merged(hf_norm(_heads(k), w))

    result, fw, bw = check(fn, [q, k], [w], mark_dynamic=[(q, (0,)), (k, (0,))], **BOTH)
    assert not result.misses, result.misses
    assert result.fused(NORM) == 2 and result.fused(ROPE) == 1
    assert any(not isinstance(s, int) for n in calls(fw, NORM) for s in n.args[0].meta["val"].shape)


# -- the op's axis not innermost in memory: the op in the shape's order, its result copied -------

def test_norm_over_an_axis_not_innermost_in_memory_fuses_with_its_output_copied_into_that_layout():
    """x = p.view(B, D, S).transpose(1, 2): D is its last axis but outermost of the two in
    memory; no order of the leading axes makes it innermost, so the op runs in the shape's
    order and its outputs are copied into the program's layouts (the output's strides, checked
    by ``check``, are eager's); the backward reads the forward op's rstd."""
    w = _weight(torch.float32, 3)
    p = torch.randn(B, D * S, requires_grad=True)
    result, fw, _ = check(lambda p: hf_norm(p.view(B, D, S).transpose(1, 2), w) * 2, [p], [w], **BOTH)
    assert result.fused(NORM) == 1 == result.fused(NORM_GRAD) and not calls(fw, "rsqrt"), result.misses
    assert not [m for m in result.misses if m.op == NORM] and calls(fw, "clone"), result.misses


def test_rotation_with_its_axis_not_innermost_fuses_with_its_output_copied_into_that_layout():
    """Zaya's layout: q of shape [B, H, S, D] stored as [B, H, D, S] (``sin`` keeps the transposed
    layout and is a leaf of the rotation). No order makes D innermost, so the fused op runs in
    the shape's order and its output is copied into the program's layout, where later views
    rely on it; the backward fuses too, its dx copied likewise."""
    p = torch.randn(B, 3 * D * S, requires_grad=True)
    cos, sin = _tables()
    result, fw, _ = check(lambda p: rotate(torch.sin(p.view(B, 3, D, S).transpose(2, 3)), cos, sin) * 2, [p],
                          **BOTH)
    assert result.fused(ROPE) == len(calls(fw, ROPE)) == 1 == result.fused(ROPE_GRAD), result.misses
    assert not [m for m in result.misses if m.op == ROPE] and calls(fw, "clone"), result.misses


def _node(value):
    graph = fx.Graph()
    node = graph.placeholder("x")
    node.meta["val"] = value
    return node


@pytest.mark.parametrize("value,inner,order", [
    (torch.empty(2, 5, 3, 8).transpose(1, 2), 1, [0, 2, 1, 3]),      # BSHD memory of a BHSD shape
    (torch.empty(5, 2, 3, 8).permute(1, 2, 0, 3), 1, [2, 0, 1, 3]),  # SBHD memory
    (torch.empty(2, 3, 1, 8).transpose(1, 2), 1, [0, 1, 2, 3]),      # a size-1 axis: any stride
    (torch.empty(2, 5, 3, 4, 8).transpose(1, 2), 2, [0, 2, 1, 3, 4]),  # two normalized axes
    (torch.empty(2, 5, 8, 3).transpose(2, 3), 1, None),              # the last axis not innermost
    (torch.empty(2, 5, 3, 4, 8).transpose(3, 4), 2, None),           # the two inner axes swapped
    (torch.empty(2, 5, 3, 16)[..., :8], 1, None),                    # padded: not dense
    (torch.empty(2, 1, 8).expand(2, 5, 8), 1, None),                 # overlapping: stride 0
])
def test_memory_order(value, inner, order):
    assert memory_order(_node(value), inner) == order


# -- rounds: what the layout misses used to hide -----------------------------------------------

def test_chain_of_post_norms_fuses_every_forward():
    """Post-norms on one residual stream (EXAONE 4, Kolibri): a norm whose x still holds an unfused
    norm's output is undecided until that one fuses, a round later. It counts as pending, so the
    rounds go on; before, the pass stopped once a round left no recorded miss (the q/k norms'
    layout misses had kept it going) and the last norms ended "no forward RMSNorm form matched"."""
    weights = [_weight(torch.float32, i) for i in range(5)]
    mixes = [torch.randn(D, D, generator=torch.Generator().manual_seed(10 + i)) / 3 for i in range(4)]
    x = torch.randn(B, S, D, requires_grad=True)

    def post_norms(x):
        h = x
        for m, w in zip(mixes, weights):
            h = h + hf_norm(h @ m.to(h.dtype), w)
        return hf_norm(h, weights[4])

    result, fw, bw = check(post_norms, [x], weights, **BOTH)
    assert not result.misses, result.misses
    assert result.fused(NORM) == result.fused(NORM_GRAD) == 5
    _assert_paired(fw, bw, 5)
