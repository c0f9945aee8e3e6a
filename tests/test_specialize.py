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


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(q, cos, sin):
    """HF's rotation of q ``[B, N, S, D]`` with tables ``[S, D]`` the caller passes."""
    return q * cos + rotate_half(q) * sin


def test_head_dim_is_specialized_under_a_guard_and_batch_and_sequence_stay_symbolic():
    """``dynamic=True`` makes q's head dim symbolic: the pass guards it to its value (the fused op
    is proved per position of a static head dim), so the rotation fuses both ways, and another
    batch and sequence length run the same graph."""
    results = []
    options = FusionOptions.from_mapping({"strict": True, "target": "generic"})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(rope, backend=aot_backend(options, lambda gm, run: results.append(run())), dynamic=True)
    for seed, (b, s) in enumerate(((2, 6), (3, 9))):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(b, 4, s, 16, generator=g).requires_grad_()
        angles = torch.randn(s, 16, generator=g)
        inputs = [q, angles.cos(), angles.sin()]
        got, grad_outputs = run_grads(compiled, inputs)
        eager, _ = run_grads(rope, inputs, (), grad_outputs)
        for f, e, exact in zip(got, eager, float64_grads(rope, inputs, (), grad_outputs)):
            assert f.dtype == e.dtype and f.shape == e.shape
            assert_close_as_unfused(f, e, exact, factor=MODEL_FACTOR)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "another batch and sequence recompiled"
    assert len(results) == 1 and not results[0].misses, results[0].misses
    assert results[0].fused("rotary_position_embedding") == results[0].fused("rotary_position_embedding_grad") == 1


def test_eps_passed_as_a_tensor_is_a_recorded_forward_miss():
    """An eps the caller passes as a tensor is data, not a constant: no guard can keep it, so the
    norm's forward stays (its backward, which reads no eps, fuses), recorded with the reason."""
    from npu_fusion.patterns.rms_norm.sites import EPS_TENSOR_REASON

    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
    w = torch.randn(32, generator=torch.Generator().manual_seed(1)).requires_grad_()
    eps = torch.tensor(1e-6)
    results = []
    options = FusionOptions.from_mapping({"strict": True, "target": "generic"})
    torch._dynamo.reset()
    compiled = torch.compile(norm, backend=aot_backend(options, lambda gm, run: results.append(run())))
    fn = lambda x, w: norm(x, w, eps, 1.0)  # noqa: E731
    got, grad_outputs = run_grads(lambda x, w: compiled(x, w, eps, 1.0), [x, w])
    eager, _ = run_grads(fn, [x, w], (), grad_outputs)
    for g, e, exact in zip(got, eager, float64_grads(fn, [x, w], (), grad_outputs)):
        assert_close_as_unfused(g, e, exact, factor=MODEL_FACTOR)
    (result,) = results
    assert result.fused("rms_norm_grad") == 1 and not result.fused("rms_norm")
    assert [m.reason for m in result.misses] == [EPS_TENSOR_REASON]
