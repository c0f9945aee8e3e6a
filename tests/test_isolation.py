"""One candidate's internal failure costs that candidate only.

Failures are injected at one site of a real backward graph (the bundled one-layer
Llama: two RoPE and three RMSNorm sites): while examining it, while evaluating one of
its nodes, and while rewriting it. The failing site becomes a miss whose reason names
the error, every other site still fuses, the graph stays correct, and ``strict=True``
raises instead.
"""
import copy

import pytest
import torch

import npu_fusion.patterns.rms_norm_grad.emit as rms_emit
import npu_fusion.patterns.rope_grad.emit as rope_emit
import npu_fusion.patterns.rope_grad.sites as rope_sites
from npu_fusion.patterns.norm_algebra import NormEvaluator
from npu_fusion.models import bundled
from npu_fusion_testing.capture import Capture
from npu_fusion.measure.grads import assert_close_as_unfused

ROPE, RMS = "rotary_position_embedding_grad", "rms_norm_grad"


def train_step(monkeypatch_failure=None, **options):
    """One training step of the bundled one-layer Llama through the pass (not strict unless
    asked), its gradients checked against eager and float64; returns the pass's results."""
    model = bundled("llama", num_layers=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    params = dict(model.named_parameters())

    def grads(run):
        model.zero_grad(set_to_none=True)
        run(ids).backward()
        return {n: p.grad.clone() for n, p in params.items()}

    eager = grads(model.loss)
    exact_model = copy.deepcopy(model).double()
    exact_model.zero_grad(set_to_none=True)
    exact_model.loss(ids).backward()
    exact = {n: p.grad for n, p in exact_model.named_parameters()}
    torch._dynamo.reset()
    capture = Capture(**dict({"strict": False, "target": "generic"}, **options))
    got = grads(torch.compile(lambda i: model.loss(i), backend=capture))
    for name, grad in got.items():
        assert grad.dtype == eager[name].dtype and grad.shape == eager[name].shape
        assert_close_as_unfused(grad, eager[name], exact[name], factor=4.0)
    for graph in capture.after:
        graph.lint()
        assert all(n.users or n.op != "call_function" for n in graph.nodes), "dead nodes left behind"
    (result,) = capture.results
    assert result.error is None
    return result


def fail_once(monkeypatch, module, name, error):
    """Make ``module.name`` raise ``error`` on its first call only (fault injection into a
    collaborator of the transaction under test, not into the transaction)."""
    real = getattr(module, name)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)
    return calls


def internal_errors(result, op):
    return [m for m in result.misses if m.op == op and "internal error" in m.reason]


@pytest.mark.parametrize("module, name", [(rope_sites, "match_dx"), (rope_emit, "_role_node")], ids=["examine", "rewrite"])
def test_rope_failure_costs_one_site(monkeypatch, module, name):
    calls = fail_once(monkeypatch, module, name, ValueError(f"injected in {name}"))
    result = train_step()
    assert calls
    assert result.fused(ROPE) == 1 and result.fused(RMS) == 3
    (error,) = internal_errors(result, ROPE)
    assert f"ValueError: injected in {name}" in error.reason


def test_rms_norm_evaluator_failure_costs_one_node(monkeypatch):
    real = NormEvaluator._reduce
    seen = []

    def reduce_failing_once(self, node):
        if not seen and node.target is torch.ops.aten.sum.dim_IntList:
            seen.append(node.name)
            raise IndexError("injected in _reduce")
        return real(self, node)

    monkeypatch.setattr(NormEvaluator, "_reduce", reduce_failing_once)
    result = train_step()
    (error,) = internal_errors(result, RMS)
    assert error.node == seen[0] and "IndexError: injected in _reduce" in error.reason
    assert result.fused(ROPE) == 2 and result.fused(RMS) >= 2


def test_rms_norm_rewrite_failure_costs_one_site(monkeypatch):
    fail_once(monkeypatch, rms_emit, "gamma_dtype_for", RuntimeError("injected in gamma_dtype_for"))
    result = train_step()
    assert result.fused(RMS) == 2 and result.fused(ROPE) == 2
    (error,) = internal_errors(result, RMS)
    assert "RuntimeError: injected in gamma_dtype_for" in error.reason


def test_strict_raises_instead(monkeypatch):
    fail_once(monkeypatch, rope_emit, "_role_node", ValueError("injected"))
    with pytest.raises(Exception, match="injected"):
        train_step(strict=True)
