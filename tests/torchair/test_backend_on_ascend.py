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

pytest.importorskip("transformers")

from npu_fusion_testing.torchair.llama_block import (  # noqa: E402
    FUSED, LlamaBlock, assert_grads_close, decomposed_ops, grads, inputs)


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
