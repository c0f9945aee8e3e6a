"""``backend="npu_fusion"`` as on an Ascend host (``ascend_host=True``; CANN stubbed): its own
AOTAutograd with the pass on the joint graph, torchair's compiler for the forward and backward
graphs. GE gets the fused ops, and the forward saves what it saves on the CPU path."""
from __future__ import annotations

import collections
import copy

import pytest
import torch

from npu_fusion.plugin import pass_manager
from npu_fusion.plugin.backend import get_backend
from npu_fusion_testing.in_place import UPDATED_PROGRAMS

pytest.importorskip("transformers")

from npu_fusion_testing.torchair.llama_block import (  # noqa: E402
    FUSED, LlamaBlock, assert_grads_close, decomposed_ops, grads, inputs, tiny_transformers_llama)


def _step(backend, dtype):
    block = LlamaBlock(dtype=dtype)
    args = inputs(dtype)
    torch._dynamo.reset()
    mark = pass_manager.HISTORY.mark()
    got = grads(block, args, torch.compile(block, backend=backend, fullgraph=True))
    (result,) = pass_manager.HISTORY.since(mark)
    return block, args, got, result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backend_on_an_ascend_host_fuses_the_joint_graph_for_ge(ge, dtype):
    config = ge.config()
    block, args, got, result = _step(get_backend({"target": "a2"}, torchair_config=config, ascend_host=True), dtype)
    eager = grads(block, args)
    exact = grads(copy.deepcopy(block).double(), [a.double() for a in args])
    assert_grads_close(got, eager, exact)
    assert result.graph == "joint" and not result.misses
    backward, forward = ge.backward(), ge.forward()
    counts = backward.types()
    assert counts["RmsNormGrad"] == 1 and counts["RotaryPositionEmbeddingGrad"] == 2, backward
    assert not decomposed_ops(backward), backward
    assert not FUSED & set(forward.types())
    if dtype == torch.bfloat16:  # no float32 upcast of x saved (in fp32, x itself is float32)
        assert result.saved.count(torch.float32, (2, 8, 64)) == 0, result.saved.kinds

    _, _, _, on_cpu = _step(get_backend({"target": "a2"}, ascend_host=False), dtype)
    assert collections.Counter(map(str, result.saved.kinds)) == collections.Counter(map(str, on_cpu.saved.kinds))
    assert result.saved.bytes == on_cpu.saved.bytes and result.copies == on_cpu.copies


def test_options_a_path_cannot_honour_are_errors(torchair):
    import npu_fusion

    with pytest.raises(ValueError, match="partitioner"):
        npu_fusion.install(torchair.CompilerConfig(), partitioner="min_cut")
    with pytest.raises(ValueError, match="torchair_config"):
        get_backend({}, torchair_config=torchair.CompilerConfig(), ascend_host=False)


def test_caller_updating_the_input_in_place_before_backward(ge):
    """The in-place program through the backend as on an Ascend host: backward runs, gradients
    as eager (the fused op reads the forward's copy of the caller's tensor)."""
    from npu_fusion_testing.in_place import grads_after_updating_the_input as updated, hf_rms_norm

    expected, exact = updated(hf_rms_norm), updated(hf_rms_norm, torch.float64)
    mark = pass_manager.HISTORY.mark()
    backend = get_backend({"target": "a2"}, torchair_config=ge.config(), ascend_host=True)
    got = updated(torch.compile(hf_rms_norm, backend=backend, fullgraph=True))
    (result,) = pass_manager.HISTORY.since(mark)
    assert result.fused("rms_norm_grad") == 1 and result.copies
    assert ge.backward().types()["RmsNormGrad"] == 1
    assert_grads_close(got, expected, exact)


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_transformers_llama_bf16_on_an_ascend_host(ge, partitioner):
    """A 2-layer bf16 transformers Llama through the backend as on an Ascend host: every site fused
    (5 RMSNorm, 4 RoPE), the fused ops in the backward GE graph and no decomposed site left, the
    gradients by the float64 criterion, no float32 upcast saved, and under min-cut no more saved
    than min-cut saves for the unfused graph."""
    model, config = tiny_transformers_llama()
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))

    def param_grads(m, forward):
        m.zero_grad(set_to_none=True)
        forward(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in m.named_parameters()}

    options = {"target": "a2", "partitioner": partitioner}
    mark = pass_manager.HISTORY.mark()
    backend = get_backend(options, torchair_config=ge.config(), ascend_host=True)
    got = param_grads(model, torch.compile(model, backend=backend))
    results = pass_manager.HISTORY.since(mark)
    eager = param_grads(model, model)
    wide = copy.deepcopy(model).double()
    exact = {n: g.to(eager[n].dtype) for n, g in param_grads(wide, wide).items()}
    from npu_fusion.measure.grads import MODEL_FACTOR, grad_failures

    assert not grad_failures(got, eager, exact, MODEL_FACTOR)
    assert sum(r.fused("rms_norm_grad") for r in results) == 5
    assert sum(r.fused("rotary_position_embedding_grad") for r in results) == 4
    assert not [m for r in results for m in r.misses], [m for r in results for m in r.misses]
    (result,) = [r for r in results if r.sites]
    assert result.graph == "joint" and result.saved.count(torch.float32, (2, 16, config.hidden_size)) == 0
    backward = ge.backward()
    assert backward.types()["RmsNormGrad"] == 5 and backward.types()["RotaryPositionEmbeddingGrad"] == 4
    assert not decomposed_ops(backward), backward
    if partitioner == "min_cut":
        torch._dynamo.reset()
        unfused = pass_manager.HISTORY.mark()
        plain = get_backend({**options, "rms_norm": False, "rope": False}, ascend_host=False)
        param_grads(model, torch.compile(model, backend=plain))
        (without,) = [r for r in pass_manager.HISTORY.since(unfused) if r.saved is not None]
        assert result.saved.bytes <= without.saved.bytes, (result.saved.kinds, without.saved.kinds)


_UPDATED = [pytest.param(p, d, id=f"{p.name}-{str(d)[6:]}") for p in UPDATED_PROGRAMS for d in p.legal]


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
@pytest.mark.parametrize("program, dtype", _UPDATED)
def test_caller_updates_in_place_what_it_holds(ge, program, dtype, partitioner):
    """Every program of ``tests/test_in_place.py`` through the backend as on an Ascend host (the
    joint graph fused, forward and backward paired, torchair's compilers): no raise where eager
    allows the update, outputs and gradients by the float64 criterion, every site fused."""
    from npu_fusion.measure.grads import MODEL_FACTOR
    from npu_fusion_testing.in_place import assert_updated_as_eager

    mark = pass_manager.HISTORY.mark()
    backend = get_backend({"target": "a2", "partitioner": partitioner}, torchair_config=ge.config(), ascend_host=True)
    assert_updated_as_eager(torch.compile(program.fn, backend=backend, fullgraph=True), program, dtype,
                            factor=MODEL_FACTOR)
    results = pass_manager.HISTORY.since(mark)
    assert {op: sum(r.fused(op) for r in results) for op in program.fused} == program.fused, results
