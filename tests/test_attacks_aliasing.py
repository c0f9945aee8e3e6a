"""Attacks on the aliasing the pass leaves in Inductor: the caller's outputs after the backward.

Through ``install_inductor`` (static and ``dynamic=True``), programs return the normalized y, the
rotated q and k, the silu and the SwiGLU halves, the product and the projection, as themselves and as
views (views of views, slices, transposes, ``detach``, a view in another dtype, ``as_strided``), in
RMSNorm, RoPE and SwiGLU spellings fused and near misses (the silu taken apart again). Each group of
programs is one compile: every output is the same after the backward as right after the forward and
as eager's, the gradients are eager's, and no view the pass left is off its input's fake storage;
``mark_dynamic`` on a block's batch too. A caller's in-place update of a returned tensor that eager
and stock Inductor refuse at the backward is refused with the pass too."""
import pytest
import torch
import torch.nn.functional as F

from test_inductor import installed  # noqa: F401  (the fixture: the pass in Inductor, compile caches off)
import npu_fusion
from npu_fusion.compat import no_compile_caches
from npu_fusion.plugin.inductor import uninstall_inductor
from npu_fusion.plugin.pass_manager import COUNTER
from npu_fusion_testing.aliasing import views_checked

B, S, H, D = 2, 8, 4, 16
E, I, EPS = H * D, 32, 1e-6


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rms_hf(x, w):
    h = x.to(torch.float32)
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _tables():
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.outer(torch.arange(S).float(), inv).repeat(1, 2)
    return emb.cos(), emb.sin()


def _rot(x):
    return torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1)


def _rot_interleaved(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)


# -- RMSNorm: x [B, S, E], w [E], w2 [E, E] ----------------------------------------------------

def rms_norm_programs(x, w, w2):
    """y returned, as a view, a view of a view, slices, fed twice; the residual stream and y
    returned; the HF spelling; the unweighted norm returned; two norms; the rstd returned (a miss);
    the same y returned twice; ``detach``, ``as_strided`` and ``expand`` of y."""
    out = []
    y = _rms(x, w)
    out += [y @ w2, y, y.view(B * S, E), y.view(B * S, E).t(), y[..., :8], y[:, 1], y.unsqueeze(0)]
    h = x * 2 + 1
    y2 = _rms(h, w)
    out += [h + y2 @ w2, h.view(B * S, E), y2.transpose(0, 1)]
    y3 = _rms_hf(x * 1.5, w)
    out += [y3 @ w2, y3, y3.view(B, S, H, D)]
    n = (x * 0.5) * torch.rsqrt((x * 0.5).pow(2).mean(-1, keepdim=True) + EPS)
    y4 = n * w
    out += [y4 @ w2, n.view(B * S, E), y4.transpose(1, 2)]
    y5 = _rms(x * 0.75, w)
    z = _rms(y5 @ w2, w)
    out += [z.sum(-1), y5.view(-1), z.transpose(0, 2)]
    r = torch.rsqrt((x * 3).pow(2).mean(-1, keepdim=True) + EPS)
    y6 = (x * 3) * r * w
    out += [y6 @ w2, r.squeeze(-1), r.transpose(0, 1), y6.mT]
    y7 = _rms(x * 1.25, w)
    out += [y7 * y7, y7, y7, y7.view(B, S, H, D), y7.narrow(2, 4, 8).movedim(0, 2)]
    y8 = _rms(x * 0.25, w)
    out += [y8 @ w2, y8.as_strided((B, 4), (S * E, 2)), y8[None].expand(2, B, S, E)]
    return out


# -- RoPE: x [B, S, E], wq, wk [E, E], cos, sin [S, D] -------------------------------------------

def rope_programs(x, wq, wk, cos, sin):
    """q and k [B, N, S, D] rotated and returned as views; [B, S, N, D] with views; the rotation
    returned plainly with cos and sin; folded heads (3-D); the interleaved spelling; q and the
    rotation both returned; ``detach``, a view in another dtype, ``as_strided`` of the rotation."""
    out = []
    q = (x @ wq).view(B, S, H, D).transpose(1, 2)
    k = (x @ wk).view(B, S, H, D).transpose(1, 2)
    qr, kr = q * cos + _rot(q) * sin, k * cos + _rot(k) * sin
    out += [(qr @ kr.transpose(-1, -2)).softmax(-1), qr.transpose(1, 2), kr[:, :, :4]]
    q2 = (x * 2 @ wq).view(B, S, H, D)
    qr2 = q2 * cos[:, None] + _rot(q2) * sin[:, None]
    out += [(qr2 * (x @ wk).view(B, S, H, D)).sum(), qr2.reshape(B, S, E), qr2.permute(2, 0, 1, 3)]
    q3 = (x * 3 @ wq).view(B, S, H, D).transpose(1, 2)
    qr3 = q3 * cos + _rot(q3) * sin
    out += [qr3 * qr3, qr3, cos[None, None], sin.view(-1)]
    q4 = (x * 4 @ wq).view(B, S, H, D).transpose(1, 2).reshape(B * H, S, D)
    qr4 = q4 * cos + _rot(q4) * sin
    out += [qr4 * (x @ wk).view(B * H, S, D), qr4.view(B, H, S, D), qr4.unflatten(0, (B, H))[:, 1:]]
    q5 = (x * 5 @ wq).view(B, S, H, D).transpose(1, 2)
    ci, si = cos[:, :D // 2].repeat_interleave(2, -1), sin[:, :D // 2].repeat_interleave(2, -1)
    qr5 = q5 * ci + _rot_interleaved(q5) * si
    out += [qr5 * qr5.detach(), qr5.transpose(-1, -2)]
    q6 = (x * 6 @ wq).view(B, S, H, D).transpose(1, 2)
    qr6 = q6 * cos + _rot(q6) * sin
    out += [qr6 * 3, q6, qr6.select(1, 0)]
    q7 = (x * 7 @ wq).view(B, S, H, D).transpose(1, 2)
    qr7 = q7 * cos + _rot(q7) * sin
    out += [qr7 * qr7, qr7.detach(), qr7.view(torch.int32), qr7.as_strided((B, H), (1, D)), qr7.swapaxes(0, 3)]
    return out


# -- SwiGLU: x [B, S, 16], wg, wu [16, I], wgu [16, 2I] -----------------------------------------

def swiglu_programs(x, wg, wu, wgu):
    """The chunk's halves returned; the split spelling with the silu returned (a miss); the product
    as a view; the projection returned; the view-unbind spelling; unfused silus (taken apart again)
    returned as slices, transposes, ``detach``, a view in another dtype, ``as_strided``; a manual
    silu; a silu alone."""
    out = []
    a, b = (x @ wgu).chunk(2, -1)
    out += [F.silu(a) * b, a, b.transpose(0, 1)]
    a2, b2 = (x * 2 @ wgu).split(I, -1)
    s2 = F.silu(a2)
    out += [s2 * b2, s2.view(B * S, I)]
    p3 = F.silu(x * 3 @ wg) * (x * 3 @ wu)
    out += [p3.view(B * S, I) @ wu.t(), p3.transpose(1, 2)]
    gu = x * 4 @ wgu
    a4, b4 = gu.chunk(2, -1)
    out += [(F.silu(a4) * b4).sum(-1), gu, gu.view(B, S, 2, I)]
    a5, b5 = (x * 5 @ wgu).view(B, S, 2, I).unbind(2)
    p5 = F.silu(a5) * b5
    out += [p5 * 2, p5[..., ::2], a5]
    g6 = x * 6 @ wg
    s6 = F.silu(g6)
    out += [s6 * (x @ wu) + s6.sum(), s6[:, ::2], g6.transpose(0, 1), s6.view(torch.int32),
            s6.as_strided((4,), (3,)), s6.mT]
    g7 = x * 7 @ wg
    s7 = g7 * torch.sigmoid(g7)
    out += [s7 * (x * 7 @ wu), s7.transpose(1, 2)]
    s8 = F.silu(x * 8 @ wg)
    out += [s8.view(-1), s8 * s8]
    return out


# -- all three in one block: x [B, S, E], w [E], wq [E, E], wgu [E, 2I], wd [I, E], cos, sin ------

def block_programs(x, w, wq, wgu, wd, cos, sin):
    """A pre-norm block returning the norm's output, the rotation, the second norm, the product and
    the gate as views; the same block in bfloat16 (HF norm, casts), its outputs cast back or viewed."""
    h = _rms(x, w)
    q = (h @ wq).view(B, S, H, D).transpose(1, 2)
    qr = q * cos + _rot(q) * sin
    a = qr.transpose(1, 2).reshape(B, S, E) + x
    n = _rms(a, w)
    g, u = (n @ wgu).chunk(2, -1)
    m = F.silu(g) * u
    out = [a + m @ wd, h.view(B * S, E), qr.transpose(1, 2), n[..., :8], m.transpose(0, 1), g]
    hb = _rms_hf((x * 2).bfloat16(), w.bfloat16())
    qb = (hb @ wq.bfloat16()).view(B, S, H, D).transpose(1, 2)
    qrb = qb * cos.bfloat16() + _rot(qb) * sin.bfloat16()
    gb, ub = (hb @ wgu.bfloat16()).chunk(2, -1)
    mb = F.silu(gb) * ub
    out += [(mb @ wd.bfloat16()).float() + qrb.transpose(1, 2).reshape(B, S, E).float(), hb.float(), hb.view(-1),
            qrb.transpose(1, 2), mb.transpose(0, 1)]
    return out


def _inputs(name, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()

    cos, sin = _tables()
    return {"rms_norm": lambda: [r(B, S, E), r(E), r(E, E, scale=0.125)],
            "rope": lambda: [r(B, S, E), r(E, E, scale=0.125), r(E, E, scale=0.125), cos, sin],
            "swiglu": lambda: [r(B, S, 16), r(16, I, scale=0.25), r(16, I, scale=0.25), r(16, 2 * I, scale=0.25)],
            "block": lambda: [r(B, S, E), r(E), r(E, E, scale=0.125), r(E, 2 * I, scale=0.125),
                              r(I, E, scale=0.125), cos, sin]}[name]()


def _run(fn, inputs):
    """Outputs right after the forward, the same outputs after the backward, and the gradients."""
    for t in inputs:
        t.grad = None
    outs = fn(*inputs)
    snapshot = [o.detach().clone() for o in outs]
    weights = [torch.linspace(-1, 1, o.numel(), dtype=torch.float64).view(o.shape) for o in outs]
    sum((o.double() * w).sum() for o, w in zip(outs, weights) if o.is_floating_point()).backward()
    grads = [t.grad.clone() if t.grad is not None else None for t in inputs if t.requires_grad]
    return snapshot, [o.detach().clone() for o in outs], grads


_ROPE, _NORM, _SWIGLU = "rotary_position_embedding", "rms_norm", "swiglu"
#: each group and its sites, fused and missed (static and dynamic alike)
GROUPS = {"rms_norm": (rms_norm_programs, {_NORM: 6, f"{_NORM}_grad": 7, f"{_NORM}_missed": 3,
                                           f"{_NORM}_grad_missed": 3}),
          # qr2 (BSND, ``cos[:, None]``) shares the [S, D] tables the BNSD rotations read: fused too
          "rope": (rope_programs, {_ROPE: 8, f"{_ROPE}_grad": 8}),
          "swiglu": (swiglu_programs, {_SWIGLU: 2, f"{_SWIGLU}_grad": 2, f"{_SWIGLU}_missed": 2,
                                       f"{_SWIGLU}_grad_missed": 2}),
          "block": (block_programs, {_NORM: 3, f"{_NORM}_grad": 3, _ROPE: 2, f"{_ROPE}_grad": 2, _SWIGLU: 2,
                                     f"{_SWIGLU}_grad": 2})}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_returned_tensors_and_views_survive_the_backward(installed, group, dynamic):
    """Each group's outputs are bitwise the same after the backward as right after the forward, and
    eager's (float64 criterion loosened for bfloat16) with eager's gradients; the sites fuse."""
    fn, sites = GROUPS[group]
    inputs = _inputs(group)
    expected = _run(fn, inputs)
    with views_checked() as unaliased:
        got = _run(torch.compile(fn, dynamic=dynamic), inputs)
    assert unaliased and all(v == [] for v in unaliased), unaliased
    assert dict(torch._dynamo.utils.counters[COUNTER]) == sites
    for i, (before, after) in enumerate(zip(got[0], got[1])):
        assert torch.equal(before, after), f"output {i} changed by the backward"
    for what, g, e in zip(("outputs", "gradients"), (got[0], got[2]), (expected[0], expected[2])):
        for i, (a, b) in enumerate(zip(g, e)):
            if b is None:
                assert a is None, (what, i)
                continue
            loose = a.dtype == torch.bfloat16 or group == "block"
            torch.testing.assert_close(a, b, rtol=5e-2 if loose else 1e-4, atol=0.5 if loose else 1e-4,
                                       msg=lambda m: f"{what} {i}: {m}")


def silu_viewed_in_another_dtype(x, wg, wu, wgu):
    """An unfused silu (two readers: taken apart again) returned as views, one in another dtype."""
    s = F.silu(x @ wg)
    return s * (x @ wu) + s.sum(), s.view(torch.int32), s.as_strided((4,), (3,)), s.mT, s


def test_a_silu_viewed_in_another_dtype_stays_aliased_under_dynamic_shapes(installed):
    """With ``dynamic=True`` the silu taken apart again moves its views onto the trace's storage, the
    ``view(torch.int32)`` among them (the symbolic move left a view in another dtype behind, and
    ``views_checked`` reported ``aten.view.dtype`` of the silu's last node); outputs survive the backward."""
    inputs = _inputs("swiglu")
    expected = _run(silu_viewed_in_another_dtype, inputs)
    with views_checked() as unaliased:
        got = _run(torch.compile(silu_viewed_in_another_dtype, dynamic=True), inputs)
    assert unaliased == [[]]
    for a, b in zip(got[0], got[1]):
        assert torch.equal(a, b)
    for g, e in zip(got[0] + got[2], expected[0] + expected[2]):
        if e is not None:
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)

def block_of_any_batch(x, w, wq, wgu, wd, cos, sin):
    """The float32 block, its shapes read off ``x``, plus an unfused silu returned as views."""
    b, s, _ = x.shape
    h = _rms(x, w)
    q = (h @ wq).view(b, s, H, D).transpose(1, 2)
    qr = q * cos + _rot(q) * sin
    a = qr.transpose(1, 2).reshape(b, s, E) + x
    g, u = (_rms(a, w) @ wgu).chunk(2, -1)
    m = F.silu(g) * u
    sl = F.silu(h @ wgu[:, :I])
    return a + m @ wd + sl.sum(), h.view(-1, E), qr.transpose(1, 2), m.transpose(0, 1), g, sl.view(torch.int32), sl.mT


def test_a_block_with_a_dynamic_batch_keeps_its_outputs(installed):
    """``mark_dynamic`` on the batch (3, not the 2 of the other programs): every site fuses, no view
    is off its input's storage, the outputs survive the backward and the float ones are eager's."""
    inputs = _inputs("block")
    inputs[0] = torch.randn(3, S, E, generator=torch.Generator().manual_seed(1)).requires_grad_()
    expected = _run(block_of_any_batch, inputs)
    torch._dynamo.mark_dynamic(inputs[0], 0)
    with views_checked() as unaliased:
        got = _run(torch.compile(block_of_any_batch), inputs)
    assert unaliased == [[]]
    assert dict(torch._dynamo.utils.counters[COUNTER]) == {_NORM: 2, f"{_NORM}_grad": 2, _ROPE: 1, f"{_ROPE}_grad": 1,
                                                           _SWIGLU: 1, f"{_SWIGLU}_grad": 1}
    for a, b in zip(got[0], got[1]):
        assert torch.equal(a, b)
    for g, e in zip(got[0] + got[2], expected[0] + expected[2]):
        if e is not None and e.is_floating_point():
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4 * max(1.0, e.abs().max().item()))

# -- the caller's in-place update of a returned tensor the backward reads ----------------------

def rotation_returned(x, wq, wk, cos, sin):
    """A rotation of q [B, N, S, D] returned as it is and squared (its backward reads it), the
    tables returned as views of the inputs."""
    q = (x @ wq).view(B, S, H, D).transpose(1, 2)
    qr = q * cos + _rot(q) * sin
    return qr * qr, qr, cos[None, None], sin.view(-1)


def _updated(fn, k):
    """Run ``fn`` on the RoPE inputs, double its ``k``-th output in place, and run the backward."""
    inputs = _inputs("rope")
    outs = fn(*inputs)
    outs[k].mul_(2)
    sum((o.double() * torch.linspace(-1, 1, o.numel(), dtype=torch.float64).view(o.shape)).sum()
        for o in outs).backward()


@pytest.mark.parametrize("k", [1, 2], ids=["rotation", "cos-view"])
def test_an_update_eager_refuses_is_refused(installed, k):
    """Eager refuses (at the backward) the caller doubling the returned rotation, or a returned view
    of cos, that the backward reads; so does stock Inductor, whose saved tensor is the returned one
    or the input; so does the pass, whose fused output permuted back is returned as a copy the
    backward reads, and whose fused backward reads cos through views made in the backward (it used to
    save aliases of its own: nothing raised, gradients wrong by up to 38.9)."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _updated(rotation_returned, k)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _updated(torch.compile(rotation_returned), k)
