"""Aliasing in the fake values the pass leaves: views share their input's storage.

AOTAutograd reads aliasing from the fake values after the partition: a saved tensor whose storage
no forward input and no user output shares is a donated buffer, which Inductor's backward may
overwrite in place. The fake value of a view the pass inserts is made on its input's fake storage
(:mod:`npu_fusion.patterns.fake_values`), and the program's views of a replaced node move onto the
replacement's storage (:func:`~npu_fusion.patterns.fake_values.move_views`); before, a rotated q
the caller held as a view was overwritten by the backward. The programs here compare outputs
(before and after the backward) and gradients with eager."""
import operator

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import fx_corpus
from test_inductor import installed  # noqa: F401  (the fixture: the pass in Inductor, compile caches off)
from npu_fusion.patterns import fake_values
from npu_fusion_testing.aliasing import unaliased_views as _unaliased_views, views_checked
from npu_fusion.plugin.pass_manager import COUNTER, fuse_backward, fuse_joint

aten = torch.ops.aten
B, S, H, D = 2, 8, 4, 16


def _storage(t):
    return t.untyped_storage()._cdata


# -- the fake values of inserted views ----------------------------------------------------------

VIEWS = {
    "view": (aten.view.default, lambda x: ((x, [8, 64]), {})),
    "permute": (aten.permute.default, lambda x: ((x, [1, 0, 2]), {})),
    "unsqueeze": (aten.unsqueeze.default, lambda x: ((x, 0), {})),
    "expand": (aten.expand.default, lambda x: ((x, [3, 2, 4, 64]), {})),
    "slice": (aten.slice.Tensor, lambda x: ((x, -1, 16, 48), {})),
    "slice-step": (aten.slice.Tensor, lambda x: ((x, -1, 1, 64, 2), {})),
    "split": (aten.split.Tensor, lambda x: ((x, 32, -1), {})),
    "flatten": (aten.flatten.using_ints, lambda x: ((x, 0, 1), {})),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_inserted_views_are_on_their_inputs_storage(name):
    """A view's fake value, computed by the meta kernel and then made from the remembered result (in
    another fake mode, the next layer's), is on its input's fake storage with the storage offset and
    strides of the fake mode's own dispatch, as tracing records it."""
    target, make = VIEWS[name]
    for _ in range(2):  # computed, then remembered
        mode = FakeTensorMode()
        with mode:
            x = torch.empty(2, 4, 64)
        args, kwargs = make(x)
        fast = fake_values.static_fake_value(mode, target, args, kwargs)
        assert fast is not None
        with mode:
            slow = target(*args, **kwargs)
        fast, slow = (fast, slow) if isinstance(slow, (tuple, list)) else ((fast,), (slow,))
        for f, s in zip(fast, slow):
            assert f.fake_mode is mode and _storage(s) == _storage(x)
            assert _storage(f) == _storage(x), name
            assert (f.shape, f.stride(), f.storage_offset(), f.dtype) == \
                (s.shape, s.stride(), s.storage_offset(), s.dtype)
    assert fake_values.geometry_key(target, args, kwargs) in fake_values.META_RESULTS


def test_a_view_in_another_dtype_is_on_its_inputs_storage():
    """``view_as_real`` (not remembered: its dtype is not its input's) is on the complex input's storage."""
    mode = FakeTensorMode()
    with mode:
        c = torch.empty(2, 4, 32, dtype=torch.complex64)
    for _ in range(2):
        real = fake_values.static_fake_value(mode, aten.view_as_real.default, (c,), {})
        assert _storage(real) == _storage(c) and real.shape == (2, 4, 32, 2) and real.dtype == torch.float32


def test_fresh_results_are_not_on_an_inputs_storage():
    """An op that writes new memory (a cast, a copy into other strides) shares no argument's storage."""
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(2, 4, 64).transpose(0, 1)
    for _ in range(2):
        for target, args, kwargs in ((aten._to_copy.default, (x,), {"dtype": torch.bfloat16}),
                                     (aten.clone.default, (x,), {"memory_format": torch.contiguous_format})):
            assert _storage(fake_values.static_fake_value(mode, target, args, kwargs)) != _storage(x)


# -- the program's views of a replaced node -----------------------------------------------------

def _graph_with_views(mode):
    """``y = x * 2`` and the program's views of y: a transpose of a view, and a split's halves."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    with mode:
        x.meta["val"] = torch.empty(B, S, 64)
    y = graph.call_function(aten.mul.Tensor, (x, 2))
    flat = graph.call_function(aten.view.default, (y, [B * S, 64]))
    turned = graph.call_function(aten.t.default, (flat,))
    halves = graph.call_function(aten.split.Tensor, (y, 32, -1))
    second = graph.call_function(operator.getitem, (halves, 1))
    graph.output((turned, second))
    with mode:
        y.meta["val"] = x.meta["val"] * 2
        flat.meta["val"] = y.meta["val"].view(B * S, 64)
        turned.meta["val"] = flat.meta["val"].t()
        halves.meta["val"] = y.meta["val"].split(32, -1)
        second.meta["val"] = halves.meta["val"][1]
    return graph, x, y, (flat, turned, halves, second)


def test_the_programs_views_of_a_replaced_node_move_to_its_replacement():
    """After a replacement (the rewrite's commit), the program's views of the replaced node (a view of a
    view, a split's halves and their getitem) are on the replacement's storage, their geometry kept and
    the getitem's value still the split's own."""
    mode = FakeTensorMode()
    graph, x, y, (flat, turned, halves, second) = _graph_with_views(mode)
    new = fx.Node(graph, "fused", "call_function", aten.mul.Tensor, (x, 2), {})
    with mode:
        new.meta["val"] = torch.empty(B, S, 64)
    geometry = [(v.shape, v.stride(), v.storage_offset()) for v in (flat.meta["val"], turned.meta["val"],
                                                                   *halves.meta["val"])]
    assert _storage(turned.meta["val"]) != _storage(new.meta["val"])
    fake_values.move_views(y, new)
    for node in (flat, turned, second):
        assert _storage(node.meta["val"]) == _storage(new.meta["val"]), node.name
        assert node.meta["val"].fake_mode is mode
    assert all(_storage(h) == _storage(new.meta["val"]) for h in halves.meta["val"])
    assert second.meta["val"] is halves.meta["val"][1]
    assert [(v.shape, v.stride(), v.storage_offset()) for v in (flat.meta["val"], turned.meta["val"],
                                                                *halves.meta["val"])] == geometry


def test_views_stay_where_the_replacement_has_other_strides():
    """A replacement in other strides than the replaced node's: the program's views (computed on the
    replaced node's strides) are left as they were."""
    mode = FakeTensorMode()
    graph, x, y, (flat, turned, halves, second) = _graph_with_views(mode)
    new = fx.Node(graph, "fused", "call_function", aten.mul.Tensor, (x, 2), {})
    with mode:
        new.meta["val"] = torch.empty(S, B, 64).transpose(0, 1)
    before = turned.meta["val"]
    fake_values.move_views(y, new)
    assert turned.meta["val"] is before and _storage(before) == _storage(y.meta["val"])


@pytest.mark.parametrize("name", sorted(fx_corpus.PROGRAMS))
def test_every_view_is_on_its_inputs_storage_after_the_pass(name):
    """Every view node of a captured graph after the pass (the pass's own and the program's views of the
    nodes it replaced; 3 to 15 of them had a storage of their own before) has its fake value on its
    input's storage, as it had before the pass."""
    entry = fx_corpus.load(name)
    assert _unaliased_views(entry.gm.graph)[0] == []
    options = {"target": "generic", "strict": True, "rms_norm_forward": True, "rope_forward": True}
    result = fuse_joint(entry.gm, options) if entry.stage == "joint" else \
        fuse_backward(entry.gm, options, forward=entry.forward)
    bad, checked = _unaliased_views(entry.gm.graph)
    assert checked and bad == []
    if any(entry.sites.values()):
        assert result.sites


# -- programs: the caller's tensors after the backward ------------------------------------------

def _tables():
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.outer(torch.arange(S).float(), inv).repeat(1, 2)
    return emb.cos(), emb.sin()


def _rotate_half(x):
    return torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1)


def rope_bhsd_returned(x, wq, cos, sin, v):
    """HF's rotation of q [B, H, S, D], a transposed view of a projection, the rotated q returned as
    it is and multiplied by ``v`` (its backward reads it): the pass's result is its own view (the fused
    op's output permuted back), which the caller holds while the backward runs."""
    q = (x @ wq).view(B, S, H, D).transpose(1, 2)
    qr = q * cos[None, None] + _rotate_half(q) * sin[None, None]
    return qr * v, qr


def rope_bhsd_returned_as_view(x, wq, cos, sin, v):
    """The same, the caller holding a view of the rotated q (the program's view of the pass's view)."""
    z, qr = rope_bhsd_returned(x, wq, cos, sin, v)
    return z, qr.transpose(1, 2)


def rope_bshd_returned_as_view(x, wq, cos, sin, v):
    """A rotation of q [B, S, H, D] in its own memory order (no layout view), the program's view of it
    returned (the fused op's output itself is saved)."""
    q = (x @ wq).view(B, S, H, D)
    c, s = cos[:, None], sin[:, None]
    qr = q * c + _rotate_half(q) * s
    return qr * v.transpose(1, 2), qr.view(B, S, H * D)


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    cos, sin = _tables()
    return [torch.randn(B, S, 64, generator=gen).requires_grad_(), (torch.randn(64, 64, generator=gen) / 8).requires_grad_(),
            cos, sin, torch.randn(B, H, S, D, generator=gen).requires_grad_()]


def _run(fn, inputs):
    """Outputs right after the forward, the same outputs after the backward, and the gradients."""
    for t in inputs:
        t.grad = None
    outs = fn(*inputs)
    snapshot = [o.detach().clone() for o in outs]
    weights = [torch.linspace(-1, 1, o.numel(), dtype=torch.float64).view(o.shape) for o in outs]
    sum((o.double() * w).sum() for o, w in zip(outs, weights)).backward()
    return snapshot, [o.detach().clone() for o in outs], [t.grad.clone() for t in inputs if t.requires_grad]


PROGRAMS = [rope_bhsd_returned, rope_bhsd_returned_as_view, rope_bshd_returned_as_view]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_a_returned_rotation_survives_the_backward_in_inductor(installed, fn, dynamic):
    """Through ``install_inductor``: the rotated q the caller holds is the same after the backward as
    before it and as eager's; the gradients are eager's. Before the fake values aliased, AOTAutograd
    took the saved fused output for a donated buffer and Inductor's backward wrote a gradient into it."""
    inputs = _inputs()
    expected = _run(fn, inputs)
    with views_checked() as unaliased:
        got = _run(torch.compile(fn, dynamic=dynamic), inputs)
    assert unaliased == [[]]  # one joint graph, every view on its input's storage after the pass
    assert dict(torch._dynamo.utils.counters[COUNTER]) == {"rotary_position_embedding": 1,
                                                           "rotary_position_embedding_grad": 1}
    for what, g, e in zip(("outputs", "outputs after the backward", "gradients"), got, expected):
        for a, b in zip(g, e):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


# -- programs: the caller's view of a silu the pass took apart again ------------------------------

I = 32


def _silu_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, 16, generator=gen).requires_grad_(), torch.randn(16, I, generator=gen).requires_grad_(),
            torch.randn(16, I, generator=gen).requires_grad_()]


def silu_returned_as_view(x, wg, wu):
    """``silu(gate)`` returned as a view and read by the backward (``d up = silu(gate) * dz``)."""
    h = torch.nn.functional.silu(x @ wg)
    return h * (x @ wu), h.view(B * S, I)


def silu_returned_transposed(x, wg, wu):
    """The same, the silu also scaled (two readers) and returned transposed."""
    h = torch.nn.functional.silu(x @ wg)
    return h * (x @ wu) + (h * 2).sum(), h.transpose(0, 1)


def silu_returned_as_a_slice(x, wg, wu):
    """The same, a slice of the silu returned."""
    h = torch.nn.functional.silu(x @ wg)
    return (h * (x @ wu)).sum(-1), h[:, :, :4]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fn", [silu_returned_as_view, silu_returned_transposed, silu_returned_as_a_slice],
                         ids=lambda f: f.__name__)
def test_a_returned_silu_survives_the_backward_in_inductor(installed, fn, dynamic):
    """Through ``install_inductor``: Inductor's table decomposes ``silu``, the pass puts the call back for
    the SwiGLU rules and, the site unfused (its silu has other readers), takes it apart again; the
    program's views of the call then read the trace's last node, and were left on the call's fake
    storage: the saved silu seemed to alias no output, and Inductor's backward overwrote the view the
    caller holds (by up to 20.6). The views now move onto the trace's storage (symbolic ones too)."""
    inputs = _silu_inputs()
    expected = _run(fn, inputs)
    with views_checked() as unaliased:
        got = _run(torch.compile(fn, dynamic=dynamic), inputs)
    assert unaliased == [[]]  # one joint graph, every view on its input's storage after the pass
    for what, g, e in zip(("outputs", "outputs after the backward", "gradients"), got, expected):
        for a, b in zip(g, e):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")
