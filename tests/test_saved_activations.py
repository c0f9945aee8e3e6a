"""What the forward saves for a fused backward (``npu_fusion/plugin/saved_activations.py``):
x in its own dtype instead of the float32 upcast an HF-style norm makes, nothing the fused
backward no longer reads, gradients bit for bit those of the partitioner's own saved set."""
import collections

import pytest
import torch

from npu_fusion.plugin import backend as backend_module
from npu_fusion.plugin import pass_manager
from npu_fusion.plugin.backend import aot_backend
from npu_fusion.plugin.options import FusionOptions
from npu_fusion.plugin.saved_activations import saved_bytes, saved_nodes
from npu_fusion.testing.grads import MODEL_FACTOR, assert_close_as_unfused

B, S = 2, 16


def _tiny_llama():
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from npu_fusion.plugin.report import tiny_hf_config

    torch.manual_seed(0)
    config = tiny_hf_config("llama", 2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.to(torch.bfloat16).eval(), config


def _step(monkeypatch, partitioner, narrow_saved):
    """One compiled training step; returns (gradients, saved tensors' fake values, results)."""
    model, config = _tiny_llama()
    saved = []
    real = backend_module.narrow_saved_activations

    def observed(fw_gm, bw_gm):  # the real function, with the saved set read after it
        change = real(fw_gm, bw_gm)
        saved.extend(saved_nodes(fw_gm, bw_gm))
        return change

    monkeypatch.setattr(backend_module, "narrow_saved_activations", observed)
    options = FusionOptions(partitioner=partitioner, narrow_saved=narrow_saved, target="generic")
    torch._dynamo.reset()
    mark = pass_manager.HISTORY.mark()
    compiled = torch.compile(model, backend=aot_backend(options))
    ids = torch.randint(0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    compiled(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return grads, saved, pass_manager.HISTORY.since(mark)


def test_default_partition_saves_x_not_its_float32_upcast(monkeypatch):
    grads, saved, results = _step(monkeypatch, "default", narrow_saved=True)
    hidden = torch.Size([B, S, 64])
    kinds = collections.Counter((n.meta["val"].dtype, n.meta["val"].shape) for n in saved
                                if isinstance(n.meta.get("val"), torch.Tensor))
    assert kinds[(torch.float32, hidden)] == 0, kinds
    (result,) = results
    assert result.fused("rms_norm_grad") == 5 and result.saved is not None
    assert len(result.saved.narrowed) == 5, result.saved
    assert result.saved.bytes_after < result.saved.bytes_before
    assert saved_bytes(saved) == result.saved.bytes_after

    unchanged, saved_before, _ = _step(monkeypatch, "default", narrow_saved=False)
    assert not saved_before  # the option off leaves the partition alone
    for name, g in grads.items():  # exact casts only: the very same gradients
        assert torch.equal(g, unchanged[name]), name


def test_min_cut_partition_already_saves_no_upcast(monkeypatch):
    grads, saved, results = _step(monkeypatch, "min_cut", narrow_saved=True)
    hidden = torch.Size([B, S, 64])
    assert not [n for n in saved if isinstance(n.meta.get("val"), torch.Tensor)
                and n.meta["val"].dtype == torch.float32 and n.meta["val"].shape == hidden]
    (result,) = results
    assert result.saved is not None and result.saved.narrowed == []


def _widen_then(use):
    def fn(x, w):
        h = x.float()
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return use(w * y.to(x.dtype), h)
    return fn


@pytest.mark.parametrize("use, narrowed", [
    (lambda out, h: out, True),                           # the upcast only feeds the fused norm
    (lambda out, h: out + (h * h).to(out.dtype), False),  # the backward also reads it in float32
])
def test_upcast_narrowed_only_when_the_backward_only_narrows_it(monkeypatch, use, narrowed):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, S, 32, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(32, generator=gen).bfloat16().requires_grad_()
    fn = _widen_then(use)
    expected = torch.autograd.grad(fn(x, w).float().sum(), (x, w))
    wide = [t.detach().double().requires_grad_() for t in (x, w)]
    exact = torch.autograd.grad(fn(*wide).sum(), wide)
    torch._dynamo.reset()
    mark = pass_manager.HISTORY.mark()
    out = torch.compile(fn, backend=aot_backend(FusionOptions(target="generic")))(x, w)
    got = torch.autograd.grad(out.float().sum(), (x, w))
    (result,) = pass_manager.HISTORY.since(mark)
    assert result.fused("rms_norm_grad") == 1
    assert bool(result.saved and result.saved.narrowed) == narrowed, result.saved
    for g, e, r in zip(got, expected, exact):
        assert_close_as_unfused(g, e, r, factor=MODEL_FACTOR)
