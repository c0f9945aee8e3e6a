"""The rules as classes: ``find`` reports its round (matches, misses, pending) and rewrites
nothing, the shared-intermediate step finds a site again without touching the round's
bookkeeping, a near-miss scan that fails names its candidate, and the options, the forms
and the run's state derive from the rule list and the run rather than the process."""
import gc
import threading

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import npu_fusion.patterns.rms_norm_grad.sites as rms_sites
from npu_fusion.patterns import (FORMS, RULES, FusionRule, RmsNormForwardRule, RmsNormGradRule, RopeForwardRule,
                                 RopeGradRule, RoundReport, SwigluForwardRule,
                                 SwigluGradRule)
from npu_fusion.patterns.context import PassContext
from npu_fusion.patterns.evaluator import Provenance
from npu_fusion.patterns.rewrite import RuleContext
from npu_fusion.plugin import pass_manager
from npu_fusion.plugin.options import FusionOptions
from npu_fusion.plugin.pass_manager import PassSession, fuse_backward

aten = torch.ops.aten
ROPE, RMS = "rotary_position_embedding_grad", "rms_norm_grad"


def rope_backward(dy, cos, sin, share):
    """The backward of ``(2 * q) * cos + rotate_half(2 * q) * sin`` as AOTAutograd writes it:
    dy is scaled before the rotation; with ``share`` the scaled dy is also returned."""
    dy2 = aten.mul.Tensor(dy, 2.0)
    t = aten.mul.Tensor(dy2, sin)
    a, b = aten.slice.Tensor(t, 3, 0, 8), aten.slice.Tensor(t, 3, 8, 16)
    r = aten.add.Tensor(aten.slice_backward.default(aten.neg.default(a), list(dy.shape), 3, 8, 16, 1),
                        aten.slice_backward.default(b, list(dy.shape), 3, 0, 8, 1))
    dx = aten.add.Tensor(r, aten.mul.Tensor(dy2, cos))
    return (dx, aten.exp.default(dy2)) if share else (dx,)


def rope_graph(share=False):
    args = (torch.randn(2, 4, 6, 16), torch.randn(2, 1, 6, 16), torch.randn(2, 1, 6, 16))
    return make_fx(lambda *a: rope_backward(*a, share), tracing_mode="fake")(*args), args


def rule_context(graph, rule, strict=False):
    return RuleContext(PassContext.of(graph, Provenance(None, graph), "generic", strict), rule.op.name)


def graph_record(graph):
    return [(n.name, str(n.target), str(n.args)) for n in graph.nodes]


def rope_rule():
    return next(r for r in RULES if isinstance(r, RopeGradRule))


def test_rule_list_is_ordered_and_typed():
    assert [type(r) for r in RULES] == [RmsNormGradRule, RopeGradRule, SwigluGradRule, RmsNormForwardRule,
                                        RopeForwardRule, SwigluForwardRule]
    assert all(isinstance(r, FusionRule) and r.domain for r in RULES)
    assert [r.stage for r in RULES] == ["backward", "backward", "backward", "joint", "joint", "joint"]
    assert [r.op.name for r in RULES] == [RMS, ROPE, "swiglu_grad", "rms_norm", "rotary_position_embedding", "swiglu"]
    # every rule counts its sites; the forward rules' sites are their backward's
    assert all(r.site_probe is not None and r.site_probe.kind == r.option for r in RULES)
    assert [r.site_probe.same_sites_as for r in RULES] == [None, None, None, "rms_norm", "rope", "swiglu"]
    # every rule on by default (SwiGLU's since the sweeps fused every counted site)
    assert [r.enabled_by_default for r in RULES] == [True] * 6


def test_forms_and_options_derive_from_the_rules():
    assert FORMS == [(r.op.name, f.form, f.seen_in) for r in RULES for f in r.forms]
    fields = {f.name for f in FusionOptions.__dataclass_fields__.values()}
    assert {"rope", "rms_norm"} <= fields and all(r.option in fields for r in RULES)
    off = FusionOptions.from_mapping({"rope": False, "rms_norm_forward": False, "rope_forward": False,
                                      "swiglu": False, "swiglu_forward": False})
    assert [r.op.name for r in RULES if off.enables(r)] == [RMS]
    with pytest.raises(ValueError, match="unknown npu_fusion option"):
        FusionOptions.from_mapping({"rotary": False})


def test_a_rule_needs_a_known_stage():
    with pytest.raises(TypeError, match="stage"):
        type("Sideways", (FusionRule,), {"stage": "sideways"})


def test_find_reports_the_round_and_rewrites_nothing():
    gm, _ = rope_graph()
    rule = rope_rule()
    ctx = rule_context(gm.graph, rule)
    before = graph_record(gm.graph)
    first, second = rule.find(gm.graph, ctx), rule.find(gm.graph, ctx)
    assert isinstance(first, RoundReport) and len(first.matches) == 1 and not first.misses and first.pending == 0
    assert [m.dx.name for m in first.matches] == [m.dx.name for m in second.matches]
    assert graph_record(gm.graph) == before and not ctx.sites and not ctx.misses


def test_shared_intermediate_is_found_again_as_a_leaf_without_bookkeeping():
    """The scaled dy is read by the rotation and returned: the site is found again with it as
    a leaf (dy is then that node), and finding it again records nothing; the pass fuses it."""
    gm, args = rope_graph(share=True)
    rule = rope_rule()
    ctx = rule_context(gm.graph, rule)
    (match,) = rule.find(gm.graph, ctx).matches
    shared = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor and n.args[1] == 2.0]
    again = rule.find_again(ctx, match, shared)
    assert again is not None and again.dx is match.dx and again.ev.leaves[again.dy[0]] is shared[0]
    resolved = rule.resolve_shared(ctx, match, rule.outputs(match), refreshed_outputs=True)
    assert resolved[0].ev.leaves[resolved[0].dy[0]] is shared[0]
    assert not ctx.misses and not ctx.sites and not ctx.context.transactions
    expected = gm(*args)
    result = fuse_backward(gm, {"target": "generic"})
    assert result.fused(ROPE) == 1 and not result.misses
    torch.testing.assert_close(gm(*args), expected)


def rms_norm_backward(x, rstd, w, tangents_1):
    """An RMSNorm's backward as AOTAutograd writes it for HF ``LlamaRMSNorm`` (fp32)."""
    g = aten.mul.Tensor(tangents_1, w)
    s = aten.sum.dim_IntList(aten.mul.Tensor(g, x), [-1], True)
    dvar = aten.div.Tensor(aten.mul.Tensor(aten.mul.Tensor(s, -0.5), aten.pow.Tensor_Scalar(rstd, 3)), 16)
    dx = aten.add.Tensor(aten.mul.Tensor(g, rstd), aten.mul.Tensor(
        aten.expand.default(dvar, [2, 3, 16]), aten.mul.Tensor(aten.pow.Tensor_Scalar(x, 1.0), 2)))
    return dx, aten.sum.dim_IntList(aten.mul.Tensor(tangents_1, aten.mul.Tensor(x, rstd)), [0, 1])


def test_near_miss_scan_failure_names_its_candidate(monkeypatch):
    """An error while reading one node for near misses is a miss at that node (not at the graph,
    whose IR would be the 'node'); the site still fuses, and the gradients stay right."""
    x = torch.randn(2, 3, 16)
    args = (x, torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5), torch.randn(16), torch.randn(2, 3, 16))
    gm = make_fx(rms_norm_backward, tracing_mode="fake")(*args)
    expected, names = gm(*args), {n.name for n in gm.graph.nodes}
    real, seen = rms_sites._near_miss_verdict, []

    def failing_once(ev, node, *rest):
        if not seen and node.target is aten.sum.dim_IntList:
            seen.append(node.name)
            raise KeyError("injected in the near-miss scan")
        return real(ev, node, *rest)

    monkeypatch.setattr(rms_sites, "_near_miss_verdict", failing_once)
    result = fuse_backward(gm, {"target": "generic"})
    (error,) = result.misses
    assert "injected" in error.reason and error.node == seen[0] and error.node in names
    assert result.error is None and result.fused(RMS) == 1
    for got, want in zip(gm(*args), expected):
        torch.testing.assert_close(got, want)


def test_runs_keep_their_state_in_their_session():
    gm, _ = rope_graph()
    session = PassSession(history_limit=4)
    mark = pass_manager.HISTORY.mark()
    result = fuse_backward(gm, {"target": "generic"}, session=session)
    assert list(session.history) == [result] and not pass_manager.HISTORY.since(mark)
    assert gc.isenabled()


def test_collections_pause_once_for_overlapping_runs():
    """The collector is the process's: overlapping runs pause it once, and only the last one to
    end enables it again."""
    paused = pass_manager._COLLECTIONS_PAUSED
    entered, release = threading.Event(), threading.Event()

    def other_run():
        with paused:
            entered.set()
            release.wait(10)

    assert gc.isenabled()
    thread = threading.Thread(target=other_run)
    thread.start()
    entered.wait(10)
    with paused:
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other run is still in progress
    release.set()
    thread.join()
    assert gc.isenabled()


def test_transactions_belong_to_the_run():
    import npu_fusion.patterns.rewrite as rewrite

    assert not hasattr(rewrite, "_OPEN")
    gm, _ = rope_graph()
    first, second = (rule_context(gm.graph, rope_rule()) for _ in range(2))
    assert first.context.transactions is not second.context.transactions
