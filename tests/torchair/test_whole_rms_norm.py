"""The whole RMSNorm ops through torchair (CANN stubbed), with the CPU routing ``F.rms_norm`` to
``aten._fused_rms_norm`` as a device with its own kernel does (:mod:`npu_fusion_testing.whole_rms_norm`).

torchair has no converter for either op in any torch_npu line from 2.6.0 to 2.14.0. With the forward
decomposed (``custom_decompositions``), the backward ``_fused_rms_norm_backward`` reaches the pass
whole and becomes ``RmsNormGrad``; left whole, the forward stops torchair's compile with its own error.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import npu_fusion
from npu_fusion.plugin import pass_manager
from npu_fusion.measure.grads import assert_close_as_unfused, float64_grads, run_grads
from npu_fusion_testing.whole_rms_norm import device_rms_norm_kernels, forward_decomposition, unavailable

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable())


def norm_then_tanh(x, w):
    return F.rms_norm(x * 2, (64,), w, 1e-6).tanh()


def inputs(dtype):
    torch.manual_seed(0)
    return [torch.randn(2, 8, 64, dtype=dtype, requires_grad=True),
            (1 + 0.1 * torch.randn(64)).to(dtype).requires_grad_()]


@pytest.mark.parametrize("target", ["a2", "950"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_whole_backward_becomes_rms_norm_grad(ge, dtype, target):
    pass_manager.HISTORY.clear()
    config = npu_fusion.install(ge.config(), target=target)
    args = inputs(dtype)
    with device_rms_norm_kernels():
        compiled = ge.compile(norm_then_tanh, config=config, decompositions=forward_decomposition())
        got, grad_outputs = run_grads(compiled, args)
        eager, _ = run_grads(norm_then_tanh, args, grad_outputs=grad_outputs)
        exact = float64_grads(norm_then_tanh, args, (), grad_outputs)
    for g, e, x in zip(got, eager, exact):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert_close_as_unfused(g, e, x)
    backward = ge.backward()
    assert backward.types()["RmsNormGrad"] == 1, backward
    forward, result = pass_manager.HISTORY  # the training forward (its whole norm decomposed), then the backward
    assert forward.graph == "forward" and not forward.error and result.graph == "backward"
    assert result.target == target and result.misses == [] and result.sites[0].replaced_targets.get("_fused_rms_norm_backward.default") == 1


def test_whole_forward_has_no_torchair_converter(ge):
    """What the pass's miss for a whole forward says: torchair cannot lower it."""
    config = npu_fusion.install(ge.config(), target="a2")
    with device_rms_norm_kernels():
        compiled = ge.compile(norm_then_tanh, config=config)
        with pytest.raises(Exception, match=r"converter for aten\._fused_rms_norm\.default"):
            compiled(*inputs(torch.float32))
