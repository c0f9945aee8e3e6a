"""What the forward saves for a fused backward, now that the backend fuses the joint graph before
the partition (``npu_fusion/plugin/joint.py``): x in its own dtype instead of the float32 upcast
an HF-style norm makes, under either partitioner, at or below what the min-cut partitioner saves
for the unfused graph; and never a tensor the caller can update in place where the unfused
program saved a copy."""
import collections

import pytest
import torch

from npu_fusion.plugin import pass_manager
from npu_fusion.plugin.backend import aot_backend
from npu_fusion.plugin.options import FusionOptions
from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, grad_failures

B, S, H = 2, 16, 64


def _tiny_llama():
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from npu_fusion.report.subjects import tiny_hf_config

    torch.manual_seed(0)
    config = tiny_hf_config("llama", 2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.to(torch.bfloat16).eval(), config


def _step(partitioner, stage, rms_norm=True, forward=False):
    """One compiled training step of the tiny bf16 Llama; returns (gradients, the pass's result).
    The forward rules are off unless ``forward``: only a joint graph has a forward to fuse."""
    model, config = _tiny_llama()
    options = FusionOptions(partitioner=partitioner, target="generic", rms_norm=rms_norm, rope=rms_norm,
                            rms_norm_forward=forward, rope_forward=forward)
    torch._dynamo.reset()
    mark = pass_manager.HISTORY.mark()
    compiled = torch.compile(model, backend=aot_backend(options, stage=stage))
    ids = torch.randint(0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    compiled(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    (result,) = pass_manager.HISTORY.since(mark)
    return grads, result


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_joint_graph_saves_x_not_its_float32_upcast(partitioner):
    grads, result = _step(partitioner, "joint")
    assert result.graph == "joint" and result.fused("rms_norm_grad") == 5 and not result.copies
    assert result.saved.count(torch.float32, (B, S, H)) == 0, result.saved.kinds
    post, after_partition = _step(partitioner, "backward")  # fused after the partition: torchair's hook
    assert after_partition.fused("rms_norm_grad") == 5
    _, unfused_min_cut = _step("min_cut", "joint", rms_norm=False)
    assert not unfused_min_cut.sites
    for name, g in grads.items():  # the same fused ops on the same values: the very same gradients
        assert torch.equal(g, post[name]), name
    # with the forward fused too the forward saves no more than with the backward fused alone
    _, both = _step(partitioner, "joint", forward=True)
    assert both.fused("rms_norm") == 5 and both.fused("rotary_position_embedding") == 4
    assert both.saved.bytes <= result.saved.bytes, (both.saved.kinds, result.saved.kinds)
    if partitioner == "min_cut":  # it already saved x rather than the upcast; the pass changes nothing
        assert result.saved.bytes <= after_partition.saved.bytes
        assert result.saved.bytes <= unfused_min_cut.saved.bytes
    else:  # after the partition, the default partitioner's upcasts stay saved
        assert after_partition.saved.count(torch.float32, (B, S, H)) == 5
        assert result.saved.bytes < after_partition.saved.bytes
        # above min-cut's unfused set only by what the default partitioner saves and min-cut
        # recomputes: the two MLP activations (silu outputs, [B, S, 128] bf16), nothing a fused op reads
        assert result.saved.bytes - unfused_min_cut.saved.bytes == 2 * B * S * 128 * 2


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_caller_updating_the_input_in_place_before_backward(partitioner):
    """Legal in eager and unfused: the forward saved the upcast, a copy. The fused op reads x,
    which the caller holds: it must read a copy saved by the forward, not the caller's tensor."""
    from npu_fusion_testing.in_place import grads_after_updating_the_input as updated, hf_rms_norm

    expected = updated(hf_rms_norm)
    exact = updated(hf_rms_norm, torch.float64)
    torch._dynamo.reset()
    mark = pass_manager.HISTORY.mark()
    got = updated(torch.compile(hf_rms_norm, backend=aot_backend(FusionOptions(target="generic",
                                                                             partitioner=partitioner))))
    (result,) = pass_manager.HISTORY.since(mark)
    assert result.fused("rms_norm_grad") == 1 and result.copies, result
    for g, e, x in zip(got, expected, exact):  # the gradients of x as it was at the forward
        assert_close_as_unfused(g, e, x, factor=MODEL_FACTOR)


def test_regional_compilation_copies_only_the_layer_input():
    """Each layer compiled alone (its input a graph input): the first norm reads a copy of the
    input, as the unfused program saved the upcast; x of later norms are the layer's own values."""
    from npu_fusion.models import bundled

    model = bundled("llama", num_layers=2).to(torch.bfloat16)
    for layer in model.layers:
        layer.compile(backend=aot_backend(FusionOptions(target="generic")))
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    mark = pass_manager.HISTORY.mark()
    model.loss(ids).backward()
    results = pass_manager.HISTORY.since(mark)
    assert results and all(r.fused("rms_norm_grad") == 2 and len(r.copies) == 1 for r in results), results


def _widen_then(use):
    def fn(x, w):
        h = x.float()
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return use(w * y.to(x.dtype), h)
    return fn


@pytest.mark.parametrize("use, upcast_saved", [
    (lambda out, h: out, 0),                           # the upcast only feeds the fused norm
    (lambda out, h: out + (h * h).to(out.dtype), 1),   # the backward also reads it in float32
])
def test_upcast_saved_only_where_the_fused_backward_reads_it(use, upcast_saved):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, S, 32, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(32, generator=gen).bfloat16().requires_grad_()
    fn = _widen_then(use)
    expected = torch.autograd.grad(fn(x, w).float().sum(), (x, w))
    wide = [t.detach().double().requires_grad_() for t in (x, w)]
    exact = torch.autograd.grad(fn(*wide).sum(), wide)
    torch._dynamo.reset()
    mark = pass_manager.HISTORY.mark()
    out = torch.compile(fn, backend=aot_backend(FusionOptions(target="generic")))(x, w)
    got = torch.autograd.grad(out.float().sum(), (x, w))
    (result,) = pass_manager.HISTORY.since(mark)
    assert result.fused("rms_norm_grad") == 1
    assert result.saved.count(torch.float32, (B, S, 32)) == upcast_saved, result.saved
    for g, e, r in zip(got, expected, exact):
        assert_close_as_unfused(g, e, r, factor=MODEL_FACTOR)


@pytest.mark.parametrize("checkpoint", ["full", "selective"])
@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_activation_checkpointing_keeps_its_saved_set(checkpoint, partitioner):
    """The backward nodes the pass inserts into a checkpointed joint graph stay backward nodes: the
    forward still saves only what checkpointing saves (nothing more than without the pass, no
    float32 upcast), no fused backward op lands in the forward (the fused forward ops do, each
    site's), and the gradients pass the float64 criterion."""
    from npu_fusion.models import bundled
    from npu_fusion.plugin.backend import run_keeping_unfused

    model = bundled("llama", num_layers=2, dtype=torch.bfloat16, checkpoint=checkpoint)
    ids = torch.randint(0, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    wide = bundled("llama", num_layers=2, dtype=torch.float64, checkpoint="none")
    wide.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    eager, exact = _grads(model, lambda: model.loss(ids)), _grads(wide, lambda: wide.loss(ids))
    seen = {}

    def around_pass(gm, run):
        seen["result"], _, seen["unfused"] = run_keeping_unfused(gm, run)
        seen["run"] = run

    torch._dynamo.reset()
    options = FusionOptions(target="generic", partitioner=partitioner, strict=True)
    compiled = torch.compile(lambda i: model.loss(i), backend=aot_backend(options, around_pass))
    got = _grads(model, lambda: compiled(ids))
    result, unfused = seen["result"], seen["unfused"]
    assert result.fused("rms_norm_grad") == 5 and result.fused("rotary_position_embedding_grad") == 4
    assert result.saved.bytes <= unfused.bytes, (result.saved, unfused)
    assert result.saved.count(torch.float32, (B, S, 64)) == 0
    forward = seen["run"].partitioned[0].graph
    fused_in_forward = collections.Counter(str(n.target) for n in forward.nodes if str(n.target).startswith("npu_fusion."))
    assert fused_in_forward == {"npu_fusion.rms_norm.default": 5, "npu_fusion.rotary_position_embedding.default": 4}
    for name, g in got.items():
        assert_close_as_unfused(g, eager[name], exact[name], factor=MODEL_FACTOR)


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_the_retired_narrowing_option_is_an_error_naming_it():
    with pytest.raises(ValueError, match="narrow_saved"):
        FusionOptions.from_mapping({"narrow_saved": False})


def test_inductors_partition_saves_no_more_than_for_the_unfused_graph():
    """The joint graph as Inductor partitions it (its decompositions, min-cut): the fused RoPE op
    reads the tables through a hand-off (``plugin/joint.py``), so min-cut still recomputes them
    from the positions, as for the unfused graph, instead of saving them."""
    from npu_fusion.compat import inductor_decompositions
    from npu_fusion.plugin.backend import run_keeping_unfused

    model, config = _tiny_llama()
    exact = _tiny_llama()[0].double()
    captured = {}

    def around_pass(gm, run):
        captured["result"], _, captured["unfused_saved"] = run_keeping_unfused(gm, run)

    options = FusionOptions(partitioner="min_cut", target="generic")
    backend = aot_backend(options, around_pass, stage="joint", decompositions=inductor_decompositions())
    torch._dynamo.reset()
    ids = torch.randint(0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss.backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    eager_model = _tiny_llama()[0]
    eager_model(input_ids=ids, labels=ids).loss.backward()
    exact(input_ids=ids, labels=ids).loss.backward()
    eager = {n: p.grad for n, p in eager_model.named_parameters()}
    wide = {n: p.grad.to(eager[n].dtype) for n, p in exact.named_parameters()}
    assert not grad_failures(got, eager, wide, MODEL_FACTOR)
    result = captured["result"]
    assert result.fused("rms_norm_grad") == 5 and result.fused("rotary_position_embedding_grad") == 4
    assert result.saved.count(torch.float32, (B, S, H)) == 0, result.saved.kinds
    assert result.saved.bytes <= captured["unfused_saved"].bytes, (result.saved.kinds, captured["unfused_saved"].kinds)
