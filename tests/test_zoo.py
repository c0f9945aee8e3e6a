"""The pass on real transformers model code beyond Llama: tiny random configs (no downloads),
full forward and backward of the causal-LM loss, compiled with the real pass.

For each model, in float32 and bfloat16 (and with dynamic batch and sequence for some):
every RoPE application and RMSNorm call, counted independently in an eager run, is one fused
op; nothing of the decomposed RoPE/RMSNorm backward is left (npu_fusion_testing.capture's
``decomposed_leftovers``, attributed to the forward code each node came from: GELU-tanh's pow or
partial rotary's ``x[..., :w]``/``x[..., w:]`` split around a fused op of width w are not RoPE's or
RMSNorm's); every parameter gradient is as close to float64 as eager's.

Model building, the independent counts and the attribution live in
``npu_fusion_testing.zoo`` (``benchmarks/zoo_coverage.py`` sweeps the whole zoo with it).
"""
import copy

import pytest
import torch

pytest.importorskip("transformers")
from npu_fusion_testing import zoo  # noqa: E402
from npu_fusion_testing.capture import Capture  # noqa: E402
from npu_fusion.measure.grads import assert_close_as_unfused  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16

#: model type -> the runs (dtype, dynamic batch and sequence)
ZOO = {
    "llama": [(F32, False), (BF16, True)],
    "qwen2": [(F32, False), (BF16, False)],
    "qwen3": [(F32, True), (BF16, False)],
    "mistral": [(F32, False), (BF16, False)],
    "gpt_neox": [(F32, False), (BF16, True)],
    "gptj": [(F32, False), (BF16, False)],
    "cohere": [(F32, False), (BF16, False)],
    "gemma": [(F32, False), (BF16, True)],
    "deepseek_v3": [(F32, False), (BF16, True)],
    "llama4_text": [(F32, False), (BF16, False)],
    "minicpm3": [(F32, False)],  # dy scaled by a constant (logits_scaling) before the LM head
    "phi3": [(F32, False)],  # full-width rotary with a zero-width pass-through slice
    # sandwich norms, post-norms, a gated norm input, per-position q scaling after RoPE
    "gemma2": [(F32, False)],
    "olmo2": [(F32, False)],
    "bitnet": [(F32, False)],
    "ministral3": [(F32, False)],
    "nanochat": [(F32, False)],  # cat(x2, -x1) rotation: mode 0 with sin negated
    "hrm_text": [(F32, False)],  # a weightless norm whose dy is the sum of three other norms' dx
}

#: models whose forms the matchers do not cover yet: strict, so a fix shows up as XPASS.
#: Diagnoses: benchmarks/zoo_coverage.py's report.
XFAIL = {}


def _param(model_type):
    marks = [pytest.mark.xfail(strict=True, reason=XFAIL[model_type])] if model_type in XFAIL else []
    return pytest.param(model_type, marks=marks, id=model_type)


def _entry(model_type):
    entry = zoo.discover([model_type], layers=2)[0]
    if entry.skip:
        pytest.skip(f"{model_type}: {entry.skip}")
    return entry


def _check(entry, dtype, dynamic):
    model = zoo.build(entry, dtype)
    ids = torch.randint(0, entry.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with zoo.count_sites(model, entry) as expected:
        eager = zoo.param_grads(model, ids)
    exact = zoo.param_grads(copy.deepcopy(model).double(), ids)
    assert expected["rope"] > 0, "the RoPE counting wrapper saw no application"

    torch._dynamo.reset()
    capture = Capture()
    compiled = torch.compile(model, backend=capture)
    if dynamic:
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(ids, 1)
    try:
        fused = zoo.param_grads(model, ids, run=compiled)
    finally:
        torch._dynamo.reset()

    where = f"{entry.model_type} {dtype} {'dynamic' if dynamic else 'static'}"
    misses = [f"{m.op} at {m.node}: {m.reason}" for m in capture.misses()]
    after = capture.after_counts()
    for kind, op in zoo.BACKWARD_OP.items():  # RoPE, RMSNorm and SwiGLU (each rule on by default)
        assert capture.fused(op) == expected[kind], (where, zoo.LABEL[kind], capture.fused(op), expected, misses)
        assert after.get(f"{op}.default", 0) == expected[kind]
    for graph in capture.after:
        left = zoo.site_leftovers(graph, entry)
        assert not (left["rope"] or left["rms_norm"] or left["unknown"]), (where, left)
    for name, grad in eager.items():
        assert name in fused, (where, name, "no gradient")
        assert fused[name].dtype == grad.dtype and fused[name].shape == grad.shape
        assert_close_as_unfused(fused[name], grad, exact[name], factor=4.0)


@pytest.mark.parametrize("model_type", [_param(m) for m in ZOO])
def test_zoo_model_backward_is_fused_and_correct(model_type):
    entry = _entry(model_type)
    for dtype, dynamic in ZOO[model_type]:
        _check(entry, dtype, dynamic)
