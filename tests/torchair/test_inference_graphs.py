"""Forward fusion on inference graphs through torchair (issue 35), CANN stubbed: a bf16 transformers
Llama and Qwen3 in ``eval()`` under ``no_grad``, through ``backend="npu_fusion"`` as on an Ascend
host and through torchair's own backend after ``npu_fusion.install``. Every norm and rotation
fuses, the inference GE graph holds ``RmsNorm`` and ``RotaryPositionEmbedding`` and no RMS
statistic, and the logits pass the float64 criterion."""
from __future__ import annotations

import copy

import pytest
import torch

import npu_fusion
from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused
from npu_fusion.plugin import pass_manager
from npu_fusion.plugin.backend import get_backend

pytest.importorskip("transformers")

#: (architecture, RMSNorm calls, RoPE applications) of the 2-layer models: a norm before attention
#: and MLP of each layer and a final one, Qwen3's q/k norms per layer, RoPE on q and k per layer
MODELS = [("llama", 5, 4), ("qwen3", 9, 4)]


def _eval_model(architecture):
    from transformers import AutoModelForCausalLM

    from npu_fusion.report.subjects import tiny_hf_config

    torch.manual_seed(0)
    config = tiny_hf_config(architecture, 2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        exact = copy.deepcopy(model).double()(input_ids=ids).logits
    return model, ids, eager, exact


def _check(ge, compiled, ids, eager, exact, mark, norms, rotations):
    with torch.no_grad():
        got = compiled(input_ids=ids).logits
    results = pass_manager.HISTORY.since(mark)
    assert results and all(r.graph == "inference" for r in results), results
    assert [m for r in results for m in r.misses] == []
    assert sum(r.fused("rms_norm") for r in results) == norms
    assert sum(r.fused("rotary_position_embedding") for r in results) == rotations
    (graph,) = ge.graphs()  # the inference graph: no backward
    types = graph.types()
    assert types["RmsNorm"] == norms and types["RotaryPositionEmbedding"] == rotations, types
    assert not {"Rsqrt", "ReduceMean", "Pow"} & set(types), types  # no RMS statistic left
    assert got.dtype == eager.dtype and got.shape == eager.shape
    assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)


@pytest.mark.parametrize("architecture, norms, rotations", MODELS)
def test_eval_through_the_backend_on_an_ascend_host(ge, architecture, norms, rotations):
    model, ids, eager, exact = _eval_model(architecture)
    mark = pass_manager.HISTORY.mark()
    backend = get_backend({"target": "a2", "strict": True}, torchair_config=ge.config(), ascend_host=True)
    _check(ge, torch.compile(model, backend=backend), ids, eager, exact, mark, norms, rotations)


@pytest.mark.parametrize("architecture, norms, rotations", MODELS)
def test_eval_through_torchairs_backend_after_install(ge, architecture, norms, rotations):
    model, ids, eager, exact = _eval_model(architecture)
    mark = pass_manager.HISTORY.mark()
    config = npu_fusion.install(ge.config(), target="a2", strict=True)
    _check(ge, ge.compile(model, config=config, fullgraph=False), ids, eager, exact, mark, norms, rotations)
