"""The forward fused too, through ``backend="npu_fusion"`` as on an Ascend host (CANN stubbed):
the forward GE graph holds ``RmsNorm`` and ``RotaryPositionEmbedding`` and no decomposed norm or
rotation, the backward GE graph their Grad ops, and ``RmsNormGrad`` reads the forward ``RmsNorm``'s
rstd (followed along GE and FX edges: :mod:`npu_fusion_testing.torchair.saved_tensors`). Outputs and
gradients by the float64 criterion. The forward options are passed explicitly."""
from __future__ import annotations

import copy

import pytest
import torch

from npu_fusion.measure.grads import MODEL_FACTOR, grad_failures
from npu_fusion.plugin import pass_manager
from npu_fusion.plugin.backend import get_backend

pytest.importorskip("transformers")

from npu_fusion_testing.torchair.llama_block import (  # noqa: E402
    FORWARD_DECOMPOSED, FORWARD_FUSED, FUSED, LlamaBlock, decomposed_forward_ops, decomposed_ops, inputs,
    outputs_and_grads)
from npu_fusion_testing.torchair.saved_tensors import FxRecorder, forward_output_feeding, is_output_of  # noqa: E402

FORWARD = {"rms_norm_forward": True, "rope_forward": True}
#: the backward fused alone (explicit: the forward options may be on by default)
BACKWARD_ALONE = {"rms_norm_forward": False, "rope_forward": False}
#: A2/A3 run interleave only with tables shared by the batch (11SD/1S1D/S11D)
SHARED_TABLES = {"half": None, "interleave": 1, "interleave_half": 1}
MODES = {"half": 0, "interleave": 1, "interleave_half": 3}


def _step(ge, options, dtype, rope):
    """One training step through the backend as on an Ascend host, checked by the float64 criterion;
    returns the pass's result and the FX graphs torchair compiled (forward, backward)."""
    block = LlamaBlock(dtype=dtype, rope=rope)
    args = inputs(dtype, cos_batch=SHARED_TABLES[rope])
    config, recorder = ge.config(), FxRecorder()
    config.post_grad_custom_pre_pass = recorder
    torch._dynamo.reset()
    mark = pass_manager.HISTORY.mark()
    backend = get_backend({"target": options.pop("target"), **options}, torchair_config=config, ascend_host=True)
    got = outputs_and_grads(block, args, torch.compile(block, backend=backend, fullgraph=True))
    (result,) = pass_manager.HISTORY.since(mark)
    eager = outputs_and_grads(block, args)
    exact = outputs_and_grads(copy.deepcopy(block).double(), [a.double() for a in args])
    assert not grad_failures(got, eager, exact, MODEL_FACTOR), grad_failures(got, eager, exact, MODEL_FACTOR)
    return result, recorder.forward_and_backward()


def _rstd_is_the_forward_rms_norms(ge, fx_graphs):
    forward, backward = ge.forward(), ge.backward()
    rms_grad = backward.one("RmsNormGrad")
    fx_node, producer, index = forward_output_feeding(backward, rms_grad, "rstd", forward, *fx_graphs, n_user=2)
    assert is_output_of(fx_node, torch.ops.npu_fusion.rms_norm.default, 1), fx_node.format_node()
    assert producer is forward.one("RmsNorm") and forward.output_names(producer)[index] == "rstd"
    assert backward.input_dtype(rms_grad, "rstd") == torch.float32


@pytest.mark.smoke  # in the version matrix's smoke set: the forward fused through torchair
@pytest.mark.parametrize("rope", ["half", "interleave"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a2_forward_and_backward_ge_graphs_fused(ge, dtype, rope):
    result, fx_graphs = _step(ge, {"target": "a2", **FORWARD}, dtype, rope)
    assert result.graph == "joint" and not result.misses, result.misses
    assert [result.fused(op) for op in ("rms_norm", "rotary_position_embedding")] == [1, 2]
    forward, backward = ge.forward(), ge.backward()
    assert forward.types()["RmsNorm"] == 1 and forward.types()["RotaryPositionEmbedding"] == 2, forward
    assert not decomposed_forward_ops(forward), forward
    assert backward.types()["RmsNormGrad"] == 1 and backward.types()["RotaryPositionEmbeddingGrad"] == 2, backward
    assert not decomposed_ops(backward) and not FORWARD_FUSED & set(backward.types()), backward
    for rotation in forward.of_type("RotaryPositionEmbedding"):
        assert forward.input_names(rotation) == ["x", "cos", "sin"]
        assert forward.attrs(rotation).get("mode", 0) == MODES[rope]
        assert forward.output_dtype(rotation) == dtype
    norm = forward.one("RmsNorm")
    assert [forward.output_dtype(norm, i) for i in (0, 1)] == [dtype, torch.float32]
    assert forward.attrs(norm)["epsilon"] == pytest.approx(1e-6)
    _rstd_is_the_forward_rms_norms(ge, fx_graphs)


@pytest.mark.parametrize("rope", ["half", "interleave"])
def test_without_the_forward_options_the_forward_is_decomposed(ge, rope):
    """What :data:`FORWARD_DECOMPOSED` names is there when only the backward is fused."""
    _step(ge, {"target": "a2", **BACKWARD_ALONE}, torch.bfloat16, rope)
    forward = ge.forward()
    assert not FORWARD_FUSED & set(forward.types()) and FUSED <= set(ge.backward().types())
    rotation = {"half": "ConcatV2", "interleave": "Pack"}[rope]
    assert decomposed_forward_ops(forward) == FORWARD_DECOMPOSED - {"ConcatV2", "Pack"} | {rotation}, forward


@pytest.mark.parametrize("rope", ["half", "interleave", "interleave_half"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_950_forward_and_backward_ge_graphs_fused(ge, dtype, rope):
    """Ascend 950 runs RotaryPositionEmbedding in every mode and RmsNorm(Grad) (the public CANN
    operator sources list it for both): the forward GE graph holds RmsNorm and the rotations, the
    backward graph their Grad ops, RmsNormGrad reading the forward RmsNorm's rstd; no miss."""
    result, fx_graphs = _step(ge, {"target": "950", **FORWARD}, dtype, rope)
    assert result.target == "950" and not result.misses, result.misses
    assert [result.fused(op) for op in ("rms_norm", "rms_norm_grad", "rotary_position_embedding",
                                        "rotary_position_embedding_grad")] == [1, 1, 2, 2]
    forward, backward = ge.forward(), ge.backward()
    assert forward.types()["RmsNorm"] == 1 and forward.types()["RotaryPositionEmbedding"] == 2, forward
    assert not decomposed_forward_ops(forward), forward
    assert backward.types()["RmsNormGrad"] == 1 and backward.types()["RotaryPositionEmbeddingGrad"] == 2, backward
    assert not decomposed_ops(backward) and not FORWARD_FUSED & set(backward.types()), backward
    for rotation in forward.of_type("RotaryPositionEmbedding") + backward.of_type("RotaryPositionEmbeddingGrad"):
        assert (forward if rotation in forward.ops else backward).attrs(rotation).get("mode", 0) == MODES[rope]
    norm = forward.one("RmsNorm")
    assert [forward.output_dtype(norm, i) for i in (0, 1)] == [dtype, torch.float32]
    assert forward.attrs(norm)["epsilon"] == pytest.approx(1e-6)
    _rstd_is_the_forward_rms_norms(ge, fx_graphs)


def test_a2_symbolic_sequence_fp16(ge):
    """A symbolic sequence length (tables shared by the batch, as A2's limits need for a batch the
    pass cannot bound otherwise): both forward ops and both Grad ops with the symbolic size, in fp16."""
    block, args = LlamaBlock(dtype=torch.float16), inputs(torch.float16, b=3, s=6, cos_batch=1)
    mark = pass_manager.HISTORY.mark()
    backend = get_backend({"target": "a2", **FORWARD}, torchair_config=ge.config(), ascend_host=True)
    got = outputs_and_grads(block, args, torch.compile(block, backend=backend, fullgraph=True), dynamic_dims=(1,))
    (result,) = pass_manager.HISTORY.since(mark)
    eager = outputs_and_grads(block, args)
    exact = outputs_and_grads(copy.deepcopy(block).double(), [a.double() for a in args])
    assert not grad_failures(got, eager, exact, MODEL_FACTOR), grad_failures(got, eager, exact, MODEL_FACTOR)
    assert not result.misses and result.fused("rms_norm") == 1 and result.fused("rotary_position_embedding") == 2
    forward, backward = ge.forward(), ge.backward()
    norm = forward.one("RmsNorm")
    assert [d.isdigit() for d in forward.input_meta_dims(norm, "x")] == [True, False, True]
    for rotation in forward.of_type("RotaryPositionEmbedding"):  # BSND, tables 1S1D
        assert [d.isdigit() for d in forward.input_meta_dims(rotation, "x")] == [True, False, True, True]
        assert forward.input_meta_dims(rotation, "cos")[0] == "1"
    assert backward.types()["RmsNormGrad"] == 1 and backward.types()["RotaryPositionEmbeddingGrad"] == 2
    assert not decomposed_forward_ops(forward) and not decomposed_ops(backward)


def test_forward_graph_handed_to_ge(ge):
    """Without run_eagerly torchair hands the forward GE graph to GE (the stub, which refuses to
    run it): RmsNorm and RotaryPositionEmbedding there with the IR input names GE matches by."""
    from npu_fusion_testing.torchair import cann_stub

    block, args = LlamaBlock(dtype=torch.bfloat16), inputs(torch.bfloat16, cos_batch=1)
    backend = get_backend({"target": "a2", **FORWARD}, torchair_config=ge.config(run_eagerly=False),
                          ascend_host=True)
    with pytest.raises(cann_stub.CannUnavailableError):
        outputs_and_grads(block, args, torch.compile(block, backend=backend, fullgraph=True), dynamic_dims=(1,))
    (loaded,) = ge.loaded()
    names = {op.type: [s.decode() for s in op.attr["_input_name_key"].list.s] for op in loaded.ops
             if op.type in FORWARD_FUSED}
    assert names == {"RmsNorm": ["x", "gamma"], "RotaryPositionEmbedding": ["x", "cos", "sin"]}, loaded
    assert loaded.types()["RotaryPositionEmbedding"] == 2 and not decomposed_forward_ops(loaded), loaded
    assert ("compile", (loaded.name,)) in cann_stub.CALLS


@pytest.mark.smoke  # in the version matrix's smoke set: the forward's saved set through torchair
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_fused_saves_no_more_than_the_backward_alone(ge, dtype):
    """The forward ops hand the backward what it read before (the norm's rstd is the rsqrt it
    saved): the saved set is no larger than with the backward fused alone, and keeps no float32
    upcast of x."""
    with_forward, _ = _step(ge, {"target": "a2", **FORWARD}, dtype, "half")
    backward_alone, _ = _step(ge, {"target": "a2", **BACKWARD_ALONE}, dtype, "half")
    assert with_forward.saved.bytes <= backward_alone.saved.bytes, (with_forward.saved.kinds,
                                                                   backward_alone.saved.kinds)
    if dtype == torch.bfloat16:
        assert with_forward.saved.count(torch.float32, (2, 8, 64)) == 0, with_forward.saved.kinds
