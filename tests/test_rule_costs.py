"""``benchmarks.rule_costs``' clock: each rule phase the pass calls is timed, and the rules are left as they were.

No measurement is asserted (times would be the only output); the benchmark itself is run by hand.
"""
from collections import Counter

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from benchmarks.rule_costs import PHASES, timed_phases
from npu_fusion.patterns import RULES
from npu_fusion.plugin.pass_manager import fuse_backward


def _norm_gradient(x, weight, dy):
    x = x.detach().requires_grad_()
    y = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    return torch.autograd.grad(y, x, dy)


def test_every_phase_the_pass_calls_is_timed_and_the_rules_are_restored():
    before = {(id(rule), phase): getattr(rule, phase) for rule in RULES for phase in PHASES}
    gm = make_fx(_norm_gradient, tracing_mode="fake")(torch.randn(2, 8, 64), torch.randn(64), torch.randn(2, 8, 64))
    clock = Counter()
    with timed_phases(clock):
        result = fuse_backward(gm, {"target": "generic"})
    assert result.fused("rms_norm_grad") == 1
    assert {("rms_norm_grad", phase) for phase in ("find", "emit", "unexplained")} <= set(clock)
    assert all(seconds >= 0 for seconds in clock.values())
    assert {(id(rule), phase): getattr(rule, phase) for rule in RULES for phase in PHASES} == before
