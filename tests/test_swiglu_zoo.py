"""SwiGLU sites in transformers' own model code (tiny random configs, no downloads): every MLP the
SwiGLU rule's site probe counts (a module whose source calls one ``gate_up_proj``) fused forward
and backward, nothing else counted or missed, parameter gradients by the float64 criterion."""
import copy
import inspect
import re

import pytest
import torch

from npu_fusion.measure.grads import grad_failures
from npu_fusion.patterns import SwigluGradRule

pytest.importorskip("transformers")

from npu_fusion_testing import zoo  # noqa: E402

PROBE = re.compile(SwigluGradRule.site_probe.source)


def _probed_calls(model, ids) -> int:
    """Eager calls of the modules the probe matches whose output receives a gradient."""
    calls = []
    classes = {type(m) for m in model.modules() if PROBE.search(inspect.getsource(type(m).forward))}
    hooks = [m.register_forward_hook(lambda _m, _i, out: calls.append(out.requires_grad))
             for m in model.modules() if type(m) in classes]
    try:
        zoo.param_grads(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return sum(calls)


@pytest.mark.parametrize("model_type, sites", [("phi3", 1), ("llama", 0)])
def test_transformers_mlps(model_type, sites):
    (entry,) = zoo.discover([model_type], layers=1)
    model = zoo.build(entry, torch.bfloat16, 0)
    ids = torch.randint(0, entry.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    assert _probed_calls(model, ids) == sites
    eager = zoo.param_grads(model, ids)
    exact = zoo.param_grads(copy.deepcopy(model).double(), ids)
    fused, capture = zoo.compiled_grads(model, ids, swiglu=True, swiglu_forward=True)
    assert not grad_failures(fused, eager, exact), grad_failures(fused, eager, exact)
    assert (capture.fused_runs("swiglu"), capture.fused_runs("swiglu_grad")) == (sites, sites)
    assert not [m for r in capture.results for m in r.misses if m.op.startswith("swiglu")]
    assert not [r.error for r in capture.results if r.error]


@pytest.mark.parametrize("model_type", ["phi3", "mixtral"])
def test_zoo_sweep_counts_swiglu_sites_on_their_own(model_type):
    """The zoo sweep counts SwiGLU sites as their own kind (a dense MLP's gate activation, the MoE
    experts' once per expert that got tokens); with the options' defaults every one fuses backward
    and forward, nothing missed, gradients by the float64 criterion."""
    (entry,) = zoo.discover([model_type], layers=2)
    out, _ = zoo.run_model(entry)
    assert out.status == "ok", out.reason
    assert out.present["swiglu"] > 0
    assert out.fused["swiglu"] == out.forward_fused["swiglu"] == out.present["swiglu"], out
    assert out.grads_ok and not out.misses and not out.pass_errors, out
    assert "SwiGLU" in zoo.LABEL.values() and zoo.summary([out])["swiglu_sites"] == [out.present["swiglu"]] * 2
