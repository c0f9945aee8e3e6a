"""Forward sites counted independently of the pass and accounted for: each RMSNorm call and RoPE
application is a forward site as well as a backward site (issue 24), fused or a recorded miss
with its reason, never silent; the sweeps' harness and ``npu-fusion report --forward`` show them."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_grads, run_grads
from npu_fusion.measure.sites import FORWARD_OPS, KINDS, PROBES, kinds_enabled
from npu_fusion.patterns import RULES
from npu_fusion.plugin.backend import aot_backend
from npu_fusion.plugin.options import FusionOptions, forward_options
from npu_fusion_testing.capture import compile_and_compare
from npu_fusion.report import command as report

FORWARD = dict.fromkeys(forward_options(), True)  # the forward rules' switches
EPS = 1e-6


def test_forward_probes_count_the_backward_sites():
    probes = {r.option: r.site_probe for r in RULES}
    assert probes["rms_norm_forward"].counted_kind == "rms_norm"
    assert probes["rope_forward"].counted_kind == "rope"
    assert KINDS["rms_norm_forward"] == "rms_norm" and KINDS["rope_forward"] == "rotary_position_embedding"
    assert FORWARD_OPS == {"rms_norm", "rotary_position_embedding", "swiglu"}
    assert set(kinds_enabled(FusionOptions())) == {r.option for r in RULES if r.enabled_by_default}
    assert set(kinds_enabled(FusionOptions(**FORWARD))) == {r.option for r in RULES
                                                            if r.enabled_by_default or r.option in FORWARD}


def _step(fn, inputs, params, **options):
    """``fn`` compiled with the pass (forward rules on): its result; output and gradients checked
    against eager with the float64 criterion."""
    seen = {}

    def around(gm, run):
        seen["result"] = run()

    torch._dynamo.reset()
    options = FusionOptions.from_mapping(dict({"strict": True, "target": "generic"}, **FORWARD, **options))
    compiled = torch.compile(fn, backend=aot_backend(options, around))
    fused, grad_outputs = run_grads(compiled, inputs, params)
    eager, _ = run_grads(fn, inputs, params, grad_outputs)
    for f, e, x in zip(fused, eager, float64_grads(fn, inputs, params, grad_outputs)):
        assert f.dtype == e.dtype and f.shape == e.shape
        assert_close_as_unfused(f, e, x, factor=MODEL_FACTOR)
    return seen["result"]


@pytest.mark.smoke  # in the version matrix's smoke set: a recorded forward miss
def test_reciprocal_of_the_root_is_a_recorded_forward_miss():
    """``x * reciprocal(sqrt(mean(x*x) + eps))``: no RMSNorm form of either direction (``x / sqrt``
    fuses, tests/test_spellings.py); the forward is one recorded miss, and the backward fused or one
    recorded miss, never silence."""
    w = torch.nn.Parameter(torch.randn(16, generator=torch.Generator().manual_seed(3)))
    x = torch.randn(2, 3, 16, requires_grad=True)
    result = _step(lambda x: x * torch.reciprocal(torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)) * w, [x], [w])
    forward = [m for m in result.misses if m.op == "rms_norm"]
    backward = [m for m in result.misses if m.op == "rms_norm_grad"]
    # the backward is accounted for once: fused where this torch's decomposition of the
    # reciprocal gives a form it reads (torch 2.6), else one recorded miss
    assert len(forward) == 1 and not result.fused("rms_norm"), result.misses
    assert result.fused("rms_norm_grad") + len(backward) == 1, (result.sites, result.misses)


def complex_rope(x, freqs_cis):
    """torchtitan's rotation: x's pairs as complex numbers times ``freqs_cis``."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis).flatten(3).type_as(x)


@pytest.mark.smoke  # in the version matrix's smoke set: a complex rotation fused forward and backward
def test_complex_rotation_fuses_forward_and_backward():
    """A complex ``freqs_cis`` rotation: its forward fuses with the real cos and sin tables
    rebuilt from freqs_cis's parts (and checked by value), beside its fused backward."""
    angles = torch.outer(torch.arange(6.0), torch.rand(8))
    freqs_cis = torch.polar(torch.ones_like(angles), angles)[:, None, :]
    x = torch.randn(2, 6, 4, 16, requires_grad=True)
    result = _step(lambda x: complex_rope(x, freqs_cis) * 1.5, [x], [])
    assert result.fused("rotary_position_embedding_grad") == result.fused("rotary_position_embedding") == 1
    assert not result.misses, result.misses


def test_framework_model_accounts_for_every_forward_site():
    """torchtitan's Llama 3 (complex RoPE over a projection viewed into heads): 5 forward norms
    and 4 forward rotations fused, nothing unexplained, gradients within the criterion."""
    frameworks = pytest.importorskip("npu_fusion_testing.frameworks")
    pytest.importorskip("torchtitan")
    coverage = frameworks.measure(frameworks.FRAMEWORKS["torchtitan:llama3"], torch.float32, strict=False,
                                  target="generic", **FORWARD)
    sites = coverage.sites
    assert (sites["rms_norm_forward"].counted, sites["rms_norm_forward"].fused) == (5, 5)
    assert (sites["rope_forward"].counted, sites["rope_forward"].fused) == (4, 4), sites["rope_forward"].misses
    assert all(a.unexplained == 0 for a in sites.values()) and not coverage.grad_failures


def test_framework_accounting_leaves_out_forward_kinds_when_their_rules_are_off():
    frameworks = pytest.importorskip("npu_fusion_testing.frameworks")
    pytest.importorskip("torchtitan")
    coverage = frameworks.measure(frameworks.FRAMEWORKS["torchtitan:llama3"], torch.float32, strict=False,
                                  target="generic", **dict.fromkeys(forward_options(), False))
    assert set(coverage.sites) == {"rope", "rms_norm", "swiglu"}


def test_report_forward_rows_expect_the_counted_sites(capsys):
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    status = report.run(parser.parse_args(["--json", "--forward", "--layers", "1", "--target", "generic"]))
    r = json.loads(capsys.readouterr().out)
    assert status == 0 and not r["accounting_errors"] and r["settings"]["forward"]
    for forward, backward in (("rms_norm", "rms_norm_grad"), ("rotary_position_embedding",
                                                               "rotary_position_embedding_grad")):
        assert r["ops"][forward]["expected"] == r["ops"][backward]["expected"] == r["ops"][forward]["fused"]


def test_whole_fused_rms_norm_forward_is_a_recorded_forward_miss():
    """Where the device keeps a whole ``aten._fused_rms_norm`` (simulated on the CPU), its backward
    fuses and its forward is a recorded forward miss saying how to fuse it."""
    from npu_fusion.patterns.rms_statistic import WHOLE_FORWARD_REASON

    whole = pytest.importorskip("npu_fusion_testing.whole_rms_norm")
    if whole.unavailable():
        pytest.skip(whole.unavailable())
    w = torch.nn.Parameter(1 + 0.1 * torch.randn(64))
    x = torch.randn(2, 8, 64, requires_grad=True)
    with whole.device_rms_norm_kernels():
        result = _step(lambda x: torch.nn.functional.rms_norm(x * 2, (64,), w, 1e-6).tanh(), [x], [w], strict=False)
    forward = [m for m in result.misses if m.op == "rms_norm"]
    assert result.fused("rms_norm_grad") == 1 and len(forward) == 1, result.misses
    assert forward[0].reason == WHOLE_FORWARD_REASON and "decompose it" in forward[0].reason


PER_POSITION_WEIGHT = torch.nn.Parameter(torch.randn(5, 32, generator=torch.Generator().manual_seed(1)))


def test_norm_whose_weight_gradient_no_form_matches_is_still_accounted_for():
    """A weight per position on an input that takes no gradient: the backward is only the
    weight's gradient, ``sum(dy * x_hat)`` over the batch, which no RmsNormGrad form computes (a
    recorded backward miss). The forward fuses (a norm without weight, the per-position weight
    multiplied after it), and the backward's no-silent-miss scan reads the fused op's normalized
    output as it reads the decomposed one: the backward's miss is still recorded, not silent."""
    def fn(x):
        return PER_POSITION_WEIGHT * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    capture = compile_and_compare(fn, [x], params=[PER_POSITION_WEIGHT], rms_norm_forward=True, rope_forward=True)
    assert capture.fused("rms_norm") == 1 and not capture.fused("rms_norm_grad")
    reasons = {m.op: m.reason for m in capture.misses()}
    assert "summed as a weight's gradient" in reasons["rms_norm_grad"], capture.misses()


SCALE, SHIFT = (torch.nn.Parameter(torch.randn(2, 32, generator=torch.Generator().manual_seed(s))) for s in (4, 5))
MIX = torch.nn.Parameter(torch.randn(32, 32, generator=torch.Generator().manual_seed(6)) / 6)


def _modulated(x):
    """DiT's adaLN: a norm without weight, modulated per batch, then a projection."""
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return (normed * (1 + SCALE[:, None]) + SHIFT[:, None]) @ MIX


@pytest.mark.parametrize("partitioner", ["min_cut", "default"])
@pytest.mark.parametrize("x_grad", [True, False], ids=["x_trained", "x_without_gradient"])
def test_modulated_norm_saves_no_more_with_its_forward_fused(x_grad, partitioner):
    """With the forward rules on, the forward saves no more than with the backward alone (as
    test_saved_activations asserts of a Llama), here under min-cut for a modulated norm without
    weight: the backward reads y for the modulation's gradient ``sum(dy * y)``, which min-cut
    recomputes from x and rstd unfused; the opaque fused y it saved (twice the activations, three
    times in bf16 with a copy of x). The backward's readers now read the program's y, computed
    from the fused rstd. The default partitioner (torchair's) saves y either way, and there the
    backward reads the fused y (the program's would be computed twice in the forward). Left: the
    fused pair's weight of ones (one per hidden element) is saved."""
    from test_forward_fusion import check

    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0)).requires_grad_(x_grad)
    params = [SCALE, SHIFT, MIX]
    alone, _, _ = check(_modulated, [x], params, partitioner=partitioner, rms_norm_forward=False, rope_forward=False)
    both, _, _ = check(_modulated, [x], params, partitioner=partitioner, **FORWARD)
    assert both.fused("rms_norm") == 1
    ones = 32 * 4 if x_grad else 0  # the [H] ones both fused ops read (x trained: the backward fuses)
    assert both.saved.bytes <= alone.saved.bytes + ones, (both.saved.kinds, alone.saved.kinds)
