"""End to end: a Llama-style block trained through torchair with ``npu_fusion.install``.

The backward GE graph torchair builds must carry ``RmsNormGrad`` and
``RotaryPositionEmbeddingGrad`` instead of the decomposed RMSNorm and RoPE
backward ops; without ``install`` the decomposed ops are there. torchair's
``debug.run_eagerly`` executes the FX graphs on CPU (the fused ops on their
reference kernels), so the gradients are checked as well.
"""
from __future__ import annotations

import collections
import copy

import pytest
import torch

import npu_fusion
from npu_fusion.plugin import pass_manager

pytestmark = pytest.mark.smoke  # in the version matrix's smoke set: torchair

pytest.importorskip("transformers")

from npu_fusion_testing.torchair.llama_block import (  # noqa: E402
    DECOMPOSED, FORWARD_FUSED, FUSED, assert_grads_close, decomposed_ops, train_step)


def test_without_install_backward_is_decomposed(ge):
    got, eager, exact = train_step(ge)
    assert_grads_close(got, eager, exact)
    backward = ge.backward()
    types = set(backward.types())
    assert not FUSED & types, backward
    assert decomposed_ops(backward) == DECOMPOSED | {"Neg"}, backward


@pytest.mark.parametrize("target", ["a2", "950"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_install_fuses_the_backward_ge_graph(ge, dtype, target):
    pass_manager.HISTORY.clear()
    got, eager, exact = train_step(ge, dtype, install={"target": target})
    assert_grads_close(got, eager, exact)

    backward, forward = ge.backward(), ge.forward()
    counts = backward.types()
    assert counts["RmsNormGrad"] == 1 and counts["RotaryPositionEmbeddingGrad"] == 2, backward
    assert not decomposed_ops(backward), backward
    assert not FUSED & set(forward.types()) and not FORWARD_FUSED & set(backward.types())
    # the forward fused too, after the partition (what it saves for the backward unchanged or equal)
    assert forward.types()["RmsNorm"] == 1 and forward.types()["RotaryPositionEmbedding"] == 2, forward

    rms = backward.one("RmsNormGrad")
    assert backward.input_names(rms) == ["dy", "x", "rstd", "gamma"]
    assert backward.input_dtype(rms, "rstd") == torch.float32
    assert backward.input_shape(rms, "gamma") == [64]
    assert backward.output_dtype(rms, 1) == torch.float32
    for rope in backward.of_type("RotaryPositionEmbeddingGrad"):
        # cos/sin are constants of the step: no x, so no dcos/dsin (half mode)
        assert backward.input_names(rope) == ["dy", "cos", "sin"]
        assert backward.attrs(rope).get("mode", 0) == 0
        assert backward.output_dtype(rope, 0) == dtype
    # dgamma, float32 from GE, reaches the bf16 parameter's gradient through a Cast
    if dtype == torch.bfloat16:
        assert any(op.type == "Cast" for op, _ in backward.consumers(rms, 1)), backward
    ops = [(r.graph, r.target, r.fused("rms_norm"), r.fused("rotary_position_embedding"), r.fused("rms_norm_grad"),
            r.fused("rotary_position_embedding_grad"), len(r.misses)) for r in pass_manager.HISTORY]
    assert ops == [("forward", target, 1, 2, 0, 0, 0), ("backward", target, 0, 0, 1, 2, 0)]


@pytest.mark.parametrize("target,dims", [("a2", (1,)), ("a2", (0, 1)), ("generic", (0, 1))],
                         ids=["a2-seq", "a2-batch-seq", "generic-batch-seq"])
def test_install_with_dynamic_shapes(ge, target, dims):
    """Symbolic sequence (and batch) lengths, the sizes marked dynamic (cos/sin shared across the
    batch, [1, s, d]). A2's RoPE limit B < 1000 is not provable for a batch marked dynamic: the
    forward's hook keeps it under a guard (``mark_dynamic`` forbids only a guard that pins the
    batch to one value), and the backward proves it from the shape environment."""
    got, eager, exact = train_step(ge, install={"target": target}, dynamic_dims=dims, b=3, s=6, cos_batch=1)
    assert_grads_close(got, eager, exact)
    backward = ge.backward()
    counts = backward.types()
    assert counts["RmsNormGrad"] == 1 and counts["RotaryPositionEmbeddingGrad"] == 2, backward
    assert not decomposed_ops(backward), backward
    rms = backward.one("RmsNormGrad")
    symbolic = [not d.isdigit() for d in backward.input_meta_dims(rms, "dy")]
    assert symbolic == [0 in dims, True, False]  # [b, s, hidden]
    for rope in backward.of_type("RotaryPositionEmbeddingGrad"):
        dy = backward.input_meta_dims(rope, "dy")  # [b, n, s, d]
        assert [not d.isdigit() for d in dy] == [0 in dims, False, True, False]
        assert backward.input_meta_dims(rope, "cos")[:2] == ["1", "1"]


def test_user_pass_still_runs_with_install(ge):
    seen = []

    def user_pass(gm, example_inputs, config):
        seen.append(sorted({str(n.target) for n in gm.graph.nodes if "npu_fusion" in str(n.target)}))

    config = ge.config()
    config.post_grad_custom_pre_pass = user_pass
    got, eager, exact = train_step(ge, install={"target": "a2"}, config=config)
    assert_grads_close(got, eager, exact)
    # it ran on the forward and the backward graph, before npu-fusion rewrote anything
    assert seen == [[], []]
    assert FUSED <= set(ge.backward().types())


def test_tiny_llama_for_causal_lm(ge):
    """transformers' LlamaForCausalLM (1 layer: 3 RMSNorms, RoPE on q and k) trained one step."""
    from torch._decomp import get_decompositions
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))

    def step(run):
        model.zero_grad(set_to_none=True)
        run(input_ids=ids, labels=ids).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    eager = step(model)
    exact_model = copy.deepcopy(model).double()
    exact_model.zero_grad(set_to_none=True)
    exact_model(input_ids=ids, labels=ids).loss.backward()
    exact = {name: p.grad for name, p in exact_model.named_parameters()}

    # torch_npu would lower silu_backward for torchair; without it, decompose it
    compiled = ge.compile(model, config=npu_fusion.install(ge.config(), target="a2"), fullgraph=False,
                          decompositions=get_decompositions([torch.ops.aten.silu_backward]))
    got = step(compiled)
    assert_grads_close(list(got.values()), list(eager.values()), list(exact.values()))

    # torch 2.7 breaks this model into three graphs (so three backward GE graphs), later
    # releases into one: count over every backward graph
    backwards = [graph for graph in ge.graphs() if graph.is_backward]
    counts = sum((graph.types() for graph in backwards), collections.Counter())
    assert counts["RmsNormGrad"] == 3 and counts["RotaryPositionEmbeddingGrad"] == 2, counts
    assert not set().union(*(decomposed_ops(graph) for graph in backwards)), counts
