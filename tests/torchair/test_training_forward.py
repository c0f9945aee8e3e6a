"""The training forward fused through torchair's own backend after ``npu_fusion.install`` (issue 35), CANN stubbed.

torchair's hook sees the forward after the partition: what it returns for the backward is fixed.
The forward rules fuse there where that contract holds (a norm's y and rstd come from the fused op,
equal to what the backward was partitioned to read; an intermediate it saves stays computed), and
the backward rules fuse the backward against the forward as it was. A bf16 transformers Llama
trained one step: the forward GE graph holds ``RmsNorm`` and ``RotaryPositionEmbedding`` and no
decomposed norm or rotation, the backward GE graph their Grad ops; logits and gradients by the
float64 criterion. A rotation whose backward reads an intermediate the forward saved (tables that
take a gradient read the rotated half of q) stays, one recorded miss saying so."""
from __future__ import annotations

import copy

import pytest
import torch

import npu_fusion
from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, grad_failures
from npu_fusion.plugin import pass_manager

pytest.importorskip("transformers")

from npu_fusion_testing.torchair.llama_block import (  # noqa: E402
    FORWARD_FUSED, FUSED, decomposed_ops, tiny_transformers_llama)


def _logits_and_grads(model, forward, ids):
    model.zero_grad(set_to_none=True)
    out = forward(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_transformers_llama_bf16_trained_through_install_fuses_its_forward(ge):
    """Every norm (3) and rotation (2) of a 1-layer model fused in the partitioned forward and in its backward, no miss;
    the forward GE graph keeps no RMS statistic, rotate_half or slice of the rotation."""
    model, config = tiny_transformers_llama(layers=1)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    mark = pass_manager.HISTORY.mark()
    compiled = ge.compile(model, config=npu_fusion.install(ge.config(), target="a2", strict=True), fullgraph=False)
    logits, got = _logits_and_grads(model, compiled, ids)
    results = pass_manager.HISTORY.since(mark)
    eager_logits, eager = _logits_and_grads(model, model, ids)
    wide = copy.deepcopy(model).double()
    exact_logits, exact = _logits_and_grads(wide, wide, ids)
    exact = {n: g.to(eager[n].dtype) for n, g in exact.items()}
    assert not grad_failures(got, eager, exact, MODEL_FACTOR), grad_failures(got, eager, exact, MODEL_FACTOR)
    assert logits.dtype == eager_logits.dtype == torch.bfloat16
    assert_close_as_unfused(logits, eager_logits, exact_logits, factor=MODEL_FACTOR)

    assert [r.graph for r in results] == ["forward", "backward"], results
    assert not [m for r in results for m in r.misses] and not [r.error for r in results if r.error]
    fw, bw = results
    assert (fw.fused("rms_norm"), fw.fused("rotary_position_embedding")) == (3, 2), fw.sites
    assert (bw.fused("rms_norm_grad"), bw.fused("rotary_position_embedding_grad")) == (3, 2), bw.sites
    forward, backward = ge.forward(), ge.backward()
    assert forward.types()["RmsNorm"] == 3 and forward.types()["RotaryPositionEmbedding"] == 2, forward
    # no RMS statistic and no rotate_half's negation left (the tables' and the attention's concatenations stay)
    assert not {"Rsqrt", "ReduceMean", "Pow", "Neg"} & set(forward.types()), forward
    assert not FUSED & set(forward.types()) and not FORWARD_FUSED & set(backward.types())
    assert backward.types()["RmsNormGrad"] == 3 and backward.types()["RotaryPositionEmbeddingGrad"] == 2, backward
    assert not decomposed_ops(backward), backward


def test_rotation_whose_backward_reads_a_saved_intermediate_stays_one_miss(ge):
    """Tables that take a gradient (learned cos and sin): the backward of sin reads rotate_half(q),
    which the forward saves for it and the fused op does not compute. The forward rotation stays as
    it is, one recorded miss saying why; outputs and gradients by the float64 criterion."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)
    angles = torch.randn(2, 8, 16)
    cos, sin = angles.cos(), angles.sin()

    def run(fn, *tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        outs = fn(*leaves)
        gen = torch.Generator().manual_seed(1)
        torch.autograd.backward(outs, [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
                                       for o in outs])
        values = {f"out{i}": o.detach() for i, o in enumerate(outs)}
        values.update({f"grad{i}": t.grad for i, t in enumerate(leaves)})
        return values

    mark = pass_manager.HISTORY.mark()
    compiled = ge.compile(apply_rotary_pos_emb, config=npu_fusion.install(ge.config(), target="a2", strict=True))
    got = run(compiled, q, k, cos, sin)
    results = pass_manager.HISTORY.since(mark)
    eager = run(apply_rotary_pos_emb, q, k, cos, sin)
    exact = {n: v.to(eager[n].dtype) for n, v in run(apply_rotary_pos_emb, *(t.double() for t in (q, k, cos, sin))).items()}
    assert not grad_failures(got, eager, exact), grad_failures(got, eager, exact)

    fw = next(r for r in results if r.graph == "forward")
    assert fw.fused("rotary_position_embedding") == 0 and not fw.error
    assert len(fw.misses) == 2, fw.misses  # one per rotation (q and k), each once
    for miss in fw.misses:
        assert miss.op == "rotary_position_embedding" and "training forward saves" in miss.reason, miss
    assert "RotaryPositionEmbedding" not in ge.forward().types()
