"""Attacks on the caller's in-place update of a table the fused RoPE backward reads.

The tables come in as views the unfused backward read too: a ``select`` of a stacked input, the
halves of a ``chunk`` or ``split`` of one input holding both. Eager refuses the caller doubling that
input between forward and backward; so must every compile path that refuses it unfused. Through
Inductor, min-cut's CSE merged the views the pass re-made in the backward with the forward's, saved
a view (an alias with a version counter of its own), and let the update through; on the backend,
a split's piece re-made in the backward read the forward's split, and the default partitioner failed
(``Node getitem_2 was invalid, but is output``). A returned rotation the backward does not read,
updated by the caller, failed at the backward on the backend (a view of the fused output)."""
import pytest
import torch

from test_inductor import installed  # noqa: F401  (the fixture: the pass in Inductor, compile caches off)
from npu_fusion.compat import inductor_config
from npu_fusion.patterns import RULES
from npu_fusion.plugin.backend import aot_backend
from npu_fusion.plugin.options import FusionOptions
from npu_fusion.plugin.pass_manager import COUNTER, HISTORY
from npu_fusion_testing.in_place import refused

B, H, S, D = 2, 2, 6, 16


def _rot(x):
    return torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1)


def _tables():
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.outer(torch.arange(S).float(), inv).repeat(1, 2)
    return emb.cos(), emb.sin()


def tables_as_views(qs, qc, qp, stacked, joined):
    """Three rotations of q [B, H, S, D]: the tables a ``select`` of ``stacked`` [2, S, D], the
    halves of a ``chunk`` and of a ``split`` of ``joined`` [S, 2D]."""
    c, s = joined.chunk(2, -1)
    c2, s2 = joined.split(D, -1)
    return (qs * stacked[0] + _rot(qs) * stacked.select(0, 1), qc * c + _rot(qc) * s, qp * c2 + _rot(qp) * s2)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    qs = [torch.randn(B, H, S, D, generator=gen).requires_grad_() for _ in range(3)]
    return qs + [torch.stack(_tables()), torch.cat(_tables(), -1)]


def _run(fn, update=None):
    """Outputs and the gradients of the q's, after ``update(inputs)`` under ``no_grad`` if given."""
    inputs = _inputs()
    outs = fn(*inputs)
    if update is not None:
        with torch.no_grad():
            update(inputs)
    gen = torch.Generator().manual_seed(5)
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=gen) for o in outs])
    return [o.detach() for o in outs] + [t.grad for t in inputs[:3]]


_UPDATES = {"stacked": lambda i: i[3].mul_(2.0), "joined": lambda i: i[4].mul_(2.0)}


def _assert_as_eager(compiled):
    for got, expected in zip(_run(compiled), _run(tables_as_views)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_tables_viewed_from_one_input_on_the_backend(partitioner):
    """Every rotation fused; outputs and gradients eager's; an update of either table input refused,
    as eager and the same compile with every rule off refuse it."""
    def compiled(**off):
        torch._dynamo.reset()
        return torch.compile(tables_as_views, backend=aot_backend(FusionOptions(
            target="generic", strict=True, partitioner=partitioner, **off)))

    torch._dynamo.utils.counters.clear()
    fused = compiled()
    _assert_as_eager(fused)
    assert dict(torch._dynamo.utils.counters[COUNTER]) == {"rotary_position_embedding": 3,
                                                            "rotary_position_embedding_grad": 3}
    unfused = compiled(**{rule.option: False for rule in RULES})
    for name, update in _UPDATES.items():
        assert refused(lambda: _run(tables_as_views, update)), name
        assert refused(lambda: _run(unfused, update)), name
        assert refused(lambda: _run(fused, update)), name


def test_tables_viewed_from_one_input_through_inductor(installed):
    """Through Inductor (min-cut, its CSE): every rotation fused, outputs and gradients eager's, and
    an update of either table input refused as stock Inductor refuses it (both were let through)."""
    with inductor_config().patch(joint_custom_pre_pass=None):
        stock = torch.compile(tables_as_views)
        stock_refused = {name: refused(lambda: _run(stock, update)) for name, update in _UPDATES.items()}
    assert stock_refused == {"stacked": True, "joined": True}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(tables_as_views)
    _assert_as_eager(compiled)
    assert dict(torch._dynamo.utils.counters[COUNTER]) == {"rotary_position_embedding": 3,
                                                            "rotary_position_embedding_grad": 3}
    for name, update in _UPDATES.items():
        assert refused(lambda: _run(compiled, update)), name


def rotation_returned_unread(q, cos, sin):
    """q [B, S, H, D] rotated as [B, H, S, D] (the fused op's output permuted back) and returned;
    the backward does not read the rotation."""
    qr = q.transpose(1, 2) * cos + _rot(q.transpose(1, 2)) * sin
    return qr * 3, qr


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_an_unread_returned_rotation_updated_in_place_on_the_backend(partitioner):
    """Eager allows the caller doubling the returned rotation (nothing saved it); so does the backend,
    which returns the fused output permuted back as a copy (a view of it, handed out by AOTAutograd as
    a view of its multi-output function, made autograd raise at the backward)."""
    cos, sin = _tables()
    q = torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(0))

    def run(fn):
        leaf = q.clone().requires_grad_()
        out, qr = fn(leaf, cos, sin)
        with torch.no_grad():
            qr.mul_(2.0)
        (out.sum() + (qr * torch.linspace(-1, 1, qr.numel()).view(qr.shape)).sum()).backward()
        return out.detach(), leaf.grad

    torch._dynamo.reset()
    mark = HISTORY.mark()
    compiled = torch.compile(rotation_returned_unread, backend=aot_backend(FusionOptions(
        target="generic", strict=True, partitioner=partitioner)))
    for got, expected in zip(run(compiled), run(rotation_returned_unread)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    (result,) = HISTORY.since(mark)
    assert result.fused("rotary_position_embedding") == 1  # its backward (through a transpose) a recorded miss
    assert [m.op for m in result.misses] == ["rotary_position_embedding_grad"], result.misses
