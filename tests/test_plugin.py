"""The pass as a plain function on any FX GraphModule, its fail-safe and strict modes,
options and target detection."""
import logging

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from npu_fusion.plugin import pass_manager
from npu_fusion.plugin.options import FusionOptions
from npu_fusion.plugin.pass_manager import fuse_backward
from npu_fusion.plugin.targets import target_from_device_name

pytestmark = pytest.mark.smoke  # in the version matrix's smoke set: the pass

aten = torch.ops.aten


def rope_backward_by_hand(dy, cos, sin, extra_user):
    """The backward of q*cos + rotate_half(q)*sin, written as AOTAutograd writes it."""
    t = aten.mul.Tensor(dy, sin)
    a, b = aten.slice.Tensor(t, 3, 0, 8), aten.slice.Tensor(t, 3, 8, 16)
    r = aten.add.Tensor(aten.slice_backward.default(aten.neg.default(a), list(dy.shape), 3, 8, 16, 1),
                        aten.slice_backward.default(b, list(dy.shape), 3, 0, 8, 1))
    dx = aten.add.Tensor(r, aten.mul.Tensor(dy, cos))
    if extra_user:
        return dx, aten.mul.Tensor(t, 2.0)  # the partial product t feeds something else too
    return (dx,)


def traced(extra_user):
    args = (torch.randn(2, 4, 6, 16), torch.randn(2, 1, 6, 16), torch.randn(2, 1, 6, 16))
    gm = make_fx(lambda *a: rope_backward_by_hand(*a, extra_user), tracing_mode="fake")(*args)
    return gm, args


def test_plain_graph_module_is_rewritten_and_still_right():
    gm, args = traced(extra_user=False)
    expected = gm(*args)
    result = fuse_backward(gm, {"target": "generic"})
    assert result.fused("rotary_position_embedding_grad") == 1 and not result.misses
    assert result.nodes_after < result.nodes_before
    assert any(n.target == torch.ops.npu_fusion.rotary_position_embedding_grad.default for n in gm.graph.nodes)
    torch.testing.assert_close(gm(*args), expected)


def test_intermediate_with_another_user_stays_unfused():
    gm, args = traced(extra_user=True)
    expected = gm(*args)
    before = gm.code
    result = fuse_backward(gm, {"target": "generic"})
    assert result.fused("rotary_position_embedding_grad") == 0
    assert any("user outside the pattern" in m.reason for m in result.misses)
    assert gm.code == before
    torch.testing.assert_close(gm(*args), expected)


def test_internal_failure_leaves_the_graph_and_logs(monkeypatch, caplog):
    gm, args = traced(extra_user=False)
    before = gm.code

    def broken(*_args, **_kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(pass_manager, "_run_round", broken)
    with caplog.at_level(logging.WARNING, logger="npu_fusion"):
        result = fuse_backward(gm, {"target": "generic"})
    assert result.error == "RuntimeError: boom" and not result.sites
    assert gm.code == before
    assert "graph left unchanged" in caplog.text
    with pytest.raises(RuntimeError, match="boom"):
        fuse_backward(gm, {"target": "generic", "strict": True})


def test_options_are_checked():
    with pytest.raises(ValueError, match="unknown npu_fusion option"):
        FusionOptions.from_mapping({"tagret": "a2"})
    with pytest.raises(ValueError, match="target must be"):
        FusionOptions.from_mapping({"target": "910"})
    assert FusionOptions.from_mapping(None).resolved_target() == "generic"  # no NPU here


def test_dump_graphs_from_environment(monkeypatch):
    monkeypatch.setenv("NPU_FUSION_DUMP_GRAPHS", "1")
    assert FusionOptions.from_mapping({}).dump_graphs


def test_disabled_fusions_leave_the_graph():
    gm, _ = traced(extra_user=False)
    result = fuse_backward(gm, {"rope": False})
    assert not result.sites


@pytest.mark.parametrize("name, target", [
    ("Ascend910B1", "a2"), ("Ascend910B4", "a2"), ("Ascend910_9391", "a3"), ("Ascend910_9382", "a3"),
    ("Ascend950PR", "950"), ("Ascend950DT", "950"), ("Ascend310P3", "common"),
])
def test_target_from_device_name(name, target):
    assert target_from_device_name(name) == target


def _graph_record(gm):
    return [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs), n.meta.get("val") is not None)
            for n in gm.graph.nodes]


def test_failure_after_rewrites_rebuilds_the_graph_as_it_was(monkeypatch):
    """A failure after some sites were already rewritten in place (RMSNorm's, then
    RoPE's, then an error) still leaves the graph, its code and its results as they were."""
    from npu_fusion.models import bundled
    from npu_fusion_testing.capture import Capture

    model = bundled("llama", num_layers=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    capture = Capture(fuse=False)  # the backward graph as the partitioner made it: the test runs the pass
    torch.compile(lambda i: model.loss(i), backend=capture)(ids).backward()
    gm, forward = capture.backwards[0], capture.partition_forwards[0]
    before_code, before_nodes = gm.code, _graph_record(gm)
    values = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    real_round = pass_manager._run_round

    def round_then_fail(rule, graph, ctx):
        report = real_round(rule, graph, ctx)
        if rule.op.name == "rotary_position_embedding_grad":
            assert ctx.sites, "the failure should come after real rewrites"
            raise RuntimeError("late boom")
        return report

    monkeypatch.setattr(pass_manager, "_run_round", round_then_fail)
    result = fuse_backward(gm, {"target": "generic"}, forward=forward)
    assert result.error == "RuntimeError: late boom" and not result.sites
    assert gm.code == before_code and _graph_record(gm) == before_nodes
    assert all(n.meta.get("val") is values[n.name] for n in gm.graph.nodes)
    gm.graph.lint()


def test_process_state_is_bounded():
    """Many compilations keep only the newest results and forward graphs alive."""
    from torch._guards import CompileContext, CompileId, compile_context

    from npu_fusion.plugin import pass_manager

    gm, _ = traced(extra_user=False)
    mark = pass_manager.HISTORY.mark()
    for frame in range(300):
        with compile_context(CompileContext(CompileId(frame_id=frame, frame_compile_id=0))):
            pass_manager.remember_forward(gm)
            assert pass_manager.DEFAULT_SESSION.forwards[CompileContext.current_compile_id()] is gm.graph
        pass_manager.HISTORY.append(pass_manager.FusionResult(target=str(frame)))
    assert len(pass_manager.DEFAULT_SESSION.forwards) == pass_manager.FORWARD_GRAPHS_KEPT
    assert len(pass_manager.HISTORY) <= 256
    assert [r.target for r in pass_manager.HISTORY.since(pass_manager.HISTORY.mark() - 3)] == ["297", "298", "299"]
    assert len(pass_manager.HISTORY.since(mark)) == len(pass_manager.HISTORY)
