"""The gradient criterion: is a compiled gradient as close to float64 as eager's.

The gradient criterion of the tests, the benchmarks and ``npu-fusion report``: a compiled (fused)
gradient is at least as close to the float64 gradient as the eager (unfused) one, up to a factor,
with a per-dtype floor; :func:`ulps_apart`, which sees what the float64 run cannot (a rounding the
program does and the compiled run dropped); the helpers that compute the gradients compared; and
:func:`compare_gradients`, the per-parameter table the report prints."""
from __future__ import annotations

import contextlib

import dataclasses
import math
from typing import Any, Dict, List

import torch

#: absolute floor per dtype, scaled by ``max(1, max |float64 result|) / 2``
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}
#: the factor for whole models and compiled functions: a compiled gradient may be this many times
#: further from float64 than eager's (single fused ops are held to the default 2)
MODEL_FACTOR = 4.0


@dataclasses.dataclass(frozen=True)
class GradError:
    """The criterion's quantities for one gradient: ``max |g - float64|`` of the fused and the
    unfused result, the floor and the factor."""
    fused: float
    unfused: float
    floor: float
    factor: float

    @property
    def bound(self) -> float:
        return self.factor * self.unfused + self.floor

    @property
    def ok(self) -> bool:
        return self.fused <= self.bound  # False for a non-finite error


def grad_error(fused, unfused, exact, factor=2.0, precision=None) -> GradError:
    """:class:`GradError` of ``fused`` and ``unfused`` against the float64 result ``exact``. The
    floor is that of the result's dtype, or of ``precision`` where that is coarser: the dtype
    the program computed the value's inputs in (a float32 loss of bf16 logits is as exact as bf16,
    and a sum's error can cancel by chance in one run and not in the other)."""
    exact = exact.double()
    dtype = fused.dtype if precision is None else max(fused.dtype, precision, key=TOLERANCE.get)
    floor = TOLERANCE[dtype] * max(1.0, exact.abs().max().item() if exact.numel() else 0.0) * 0.5
    err_fused = (fused.double() - exact).abs().max().item() if exact.numel() else 0.0
    err_unfused = (unfused.double() - exact).abs().max().item() if exact.numel() else 0.0
    return GradError(err_fused, err_unfused, floor, factor)


def assert_close_as_unfused(fused, unfused, exact, factor=2.0):
    """The fused result is at least as close to the float64 result as the unfused one, up to
    ``factor``, with a per-dtype absolute floor scaled by the reference's magnitude."""
    error = grad_error(fused, unfused, exact, factor)
    assert error.ok, (error.fused, error.unfused, error.floor)


def ulps_apart(got: torch.Tensor, ref: torch.Tensor, precision: torch.dtype, elementwise: bool = False) -> float:
    """``max |got - ref|`` in units in the last place of ``precision`` (the program's final
    rounding of the value): at the magnitude of ``ref``'s largest element, or with
    ``elementwise`` at each element's own. A float64 run that reads every dtype as float64 has
    no rounding to compare with; this compares with the program's own result instead."""
    got, ref = got.double(), ref.double()
    eps = torch.finfo(precision).eps
    if elementwise:
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(torch.finfo(precision).tiny)))) * eps
        return (got - ref).abs().div(ulp).max().item() if ref.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    ulp = 2.0 ** math.floor(math.log2(scale)) * eps if scale > 0 else torch.finfo(precision).tiny
    return (got - ref).abs().max().item() / ulp if ref.numel() else 0.0


def grad_failures(fused: Dict[str, torch.Tensor], eager: Dict[str, torch.Tensor],
                  exact: Dict[str, torch.Tensor], factor: float = MODEL_FACTOR, precision=None) -> List[str]:
    """Parameters whose compiled gradient fails the float64 criterion, is missing, or has
    another dtype or shape than eager's; empty when every gradient passes. ``precision``: see
    :func:`grad_error`."""
    bad = [f"{name}: gradient in the compiled run only" for name in sorted(set(fused) - set(eager))]
    for name, ref in eager.items():
        got = fused.get(name)
        if got is None:
            bad.append(f"{name}: no gradient")
        elif got.dtype != ref.dtype or got.shape != ref.shape:
            bad.append(f"{name}: {got.dtype}{list(got.shape)} vs {ref.dtype}{list(ref.shape)}")
        else:
            try:
                error = grad_error(got, ref, exact[name], factor, precision)
                assert error.ok, (error.fused, error.unfused, error.floor)
            except AssertionError as exc:
                bad.append(f"{name}: err fused/unfused/floor {exc}")
    return bad


def run_grads(fn, inputs, params=(), grad_outputs=None):
    """Forward + backward; returns the grads of the leaves that require grad, in order, and the
    output gradients used (random with a fixed seed unless given)."""
    leaves = [t for t in list(inputs) + list(params) if t.requires_grad]
    for t in leaves:
        t.grad = None
    out = fn(*inputs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if grad_outputs is None:
        gen = torch.Generator().manual_seed(123)
        grad_outputs = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
    torch.autograd.backward(outs, grad_outputs)
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return grads, grad_outputs


@contextlib.contextmanager
def parameters_in_float64(params):
    """The parameters' data in float64 inside the block, restored after it."""
    params = list(params)
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.data.double()
        yield params
    finally:
        for p, s in zip(params, saved):
            p.data = s


def float64_output(fn, inputs, params=()):
    """``fn``'s output with the inputs and the parameters in float64 (the parameters are restored afterwards)."""
    with parameters_in_float64(params):
        return fn(*[t.detach().double() for t in inputs])


def float64_grads(fn, inputs, params, grad_outputs):
    """:func:`run_grads` of ``fn`` with the inputs, the parameters and the output gradients in
    float64 (the parameters are restored afterwards)."""
    with parameters_in_float64(params) as params:
        wide = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
        grads, _ = run_grads(fn, wide, params, [g.double() for g in grad_outputs])
    return grads


def compare_gradients(fused: Dict[str, torch.Tensor], eager: Dict[str, torch.Tensor],
                      exact: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """Compare each parameter's compiled and eager gradients with float64 by the criterion.

    Per parameter, the float64 criterion (:func:`grad_error`, factor :data:`MODEL_FACTOR`):
    ``err(compiled) <= 4 * err(eager) + floor``, ``err`` the max abs difference to the float64
    gradient and the floor per dtype; it must hold for every parameter. ``max |compiled - eager|``
    is reported beside it, per dtype."""
    per_dtype: Dict[str, Dict[str, Any]] = {}
    failures = []
    missing = sorted(set(eager) ^ set(fused))
    for name in sorted(set(eager) & set(fused)):
        g, e = fused[name], eager[name]
        row = per_dtype.setdefault(str(g.dtype).replace("torch.", ""), {
            "params": 0, "max_abs_diff_vs_eager": 0.0, "worst_param": None, "max_err_compiled_vs_fp64": 0.0,
            "max_err_eager_vs_fp64": 0.0, "as_close_to_fp64_as_eager": True})
        failures += _compare_parameter(name, g, e, exact[name], row)
    return {"per_dtype": per_dtype, "failures": failures, "params_without_grad_in_one_run": missing,
            "passed": not failures and not missing and bool(per_dtype)}


def _compare_parameter(name: str, g: torch.Tensor, e: torch.Tensor, x: torch.Tensor,
                       row: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One parameter's gradient into its dtype's ``row``; its failures (none when it passes)."""
    row["params"] += 1
    if g.dtype != e.dtype or g.shape != e.shape:
        row["as_close_to_fp64_as_eager"] = False
        return [{"param": name, "error": f"{g.dtype}{list(g.shape)} vs eager {e.dtype}{list(e.shape)}"}]
    diff = (g.double() - e.double()).abs().max().item() if g.numel() else 0.0
    error = grad_error(g, e, x, factor=MODEL_FACTOR)
    if diff >= row["max_abs_diff_vs_eager"]:
        row["max_abs_diff_vs_eager"], row["worst_param"] = diff, name
    row["max_err_compiled_vs_fp64"] = max(row["max_err_compiled_vs_fp64"], error.fused)
    row["max_err_eager_vs_fp64"] = max(row["max_err_eager_vs_fp64"], error.unfused)
    row["as_close_to_fp64_as_eager"] &= error.ok
    failures = []
    if not error.ok:
        failures.append({"param": name, "err_compiled_vs_fp64": error.fused, "err_eager_vs_fp64": error.unfused,
                         "floor": error.floor, "bound": error.bound, "max_abs_diff_vs_eager": diff})
    if not math.isfinite(diff):
        failures.append({"param": name, "error": "non-finite gradient"})
    return failures
