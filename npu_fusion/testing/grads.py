"""The gradient criterion of the tests and benchmarks: a compiled (fused) gradient is at least as
close to the float64 gradient as the eager (unfused) one, up to a factor, with a per-dtype floor."""
from __future__ import annotations

from typing import Dict, List

import torch

#: absolute floor per dtype, scaled by ``max(1, max |float64 result|) / 2``
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}


def assert_close_as_unfused(fused, unfused, exact, factor=2.0):
    """The fused result is at least as close to the float64 result as the unfused one, up to
    ``factor``, with a per-dtype absolute floor scaled by the reference's magnitude."""
    exact = exact.double()
    floor = TOLERANCE[fused.dtype] * max(1.0, exact.abs().max().item()) * 0.5
    err_fused = (fused.double() - exact).abs().max().item() if exact.numel() else 0.0
    err_unfused = (unfused.double() - exact).abs().max().item() if exact.numel() else 0.0
    assert err_fused <= factor * err_unfused + floor, (err_fused, err_unfused, floor)


def grad_failures(fused: Dict[str, torch.Tensor], eager: Dict[str, torch.Tensor],
                  exact: Dict[str, torch.Tensor], factor: float = 4.0) -> List[str]:
    """Parameters whose compiled gradient fails the float64 criterion, is missing, or has
    another dtype or shape than eager's; empty when every gradient passes."""
    bad = [f"{name}: gradient in the compiled run only" for name in sorted(set(fused) - set(eager))]
    for name, ref in eager.items():
        got = fused.get(name)
        if got is None:
            bad.append(f"{name}: no gradient")
        elif got.dtype != ref.dtype or got.shape != ref.shape:
            bad.append(f"{name}: {got.dtype}{list(got.shape)} vs {ref.dtype}{list(ref.shape)}")
        else:
            try:
                assert_close_as_unfused(got, ref, exact[name], factor=factor)
            except AssertionError as exc:
                bad.append(f"{name}: err fused/unfused/floor {exc}")
    return bad
