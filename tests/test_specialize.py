"""``dynamic=True`` passes Python floats as graph inputs: the backend specializes a norm's eps
under a guard (:mod:`npu_fusion.plugin.specialize`), and nothing else."""
import torch

from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_grads, run_grads
from npu_fusion.plugin.backend import aot_backend
from npu_fusion.plugin.options import FusionOptions


def norm(x, w, eps, scale):
    """An fp32-statistic RMSNorm whose eps and output scale are floats the caller passes."""
    xf = x.float()
    return (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)) * scale


def test_eps_is_specialized_under_a_guard_and_a_scale_stays_symbolic():
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)).requires_grad_()
    w = torch.randn(32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    results = []
    options = FusionOptions.from_mapping({"strict": True, "target": "generic"})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(norm, backend=aot_backend(options, lambda gm, run: results.append(run())),
                             dynamic=True)
    for eps, scale in ((1e-6, 0.5), (1e-6, 3.0), (1e-2, 3.0)):
        fn = lambda x, w: norm(x, w, eps, scale)  # noqa: E731
        got, grad_outputs = run_grads(lambda x, w: compiled(x, w, eps, scale), [x, w])
        eager, _ = run_grads(fn, [x, w], (), grad_outputs)
        for g, e, exact in zip(got, eager, float64_grads(fn, [x, w], (), grad_outputs)):
            assert g.dtype == e.dtype and g.shape == e.shape
            assert_close_as_unfused(g, e, exact, factor=MODEL_FACTOR)
    # another scale ran the first graph (it stays an input); another eps failed the guard and recompiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert len(results) == 2 and all(r.fused("rms_norm") == r.fused("rms_norm_grad") == 1 for r in results)
    assert not any(r.misses for r in results)


def test_without_the_forward_rule_nothing_is_specialized():
    """With ``rms_norm_forward`` off no fused op takes eps as a number: no guard, no recompile."""
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
    w = torch.randn(32, generator=torch.Generator().manual_seed(1)).requires_grad_()
    options = FusionOptions.from_mapping({"strict": True, "target": "generic", "rms_norm_forward": False})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(norm, backend=aot_backend(options), dynamic=True)
    for eps in (1e-6, 1e-2):
        out = compiled(x, w, eps, 2.0)
        torch.testing.assert_close(out, norm(x, w, eps, 2.0))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
