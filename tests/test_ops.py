"""The backward fused ops on their own, beyond their declared cases: numerics against float64
autograd on more layouts and splits, symbolic meta shapes, errors. Every op's declared cases
(numerics, meta, opcheck, GE, NPU binding) are ``tests/test_op_conformance.py``'s."""
import contextlib
import os
import re
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental import symbolic_shapes
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import npu_fusion  # noqa: F401
from npu_fusion import compat
from npu_fusion.lowering.checks import FusedOpInputError
from npu_fusion.lowering.ops.rope_grad import ROPE_MAX_D
from npu_fusion.measure.grads import assert_close_as_unfused
from npu_fusion_testing.reference import rms_norm_grads, rope_grads

pytestmark = pytest.mark.smoke  # in the version matrix's smoke set: the fused ops

rope_op = torch.ops.npu_fusion.rotary_position_embedding_grad
rms_op = torch.ops.npu_fusion.rms_norm_grad

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (dy shape, cos/sin shape): BNSD with 11SD/B1SD/BNSD, BSND with 1S1D/BS1D, SBND with S11D, TND with T1D, 2-D tables
LAYOUTS = [
    ((2, 3, 5, 16), (1, 1, 5, 16)),
    ((2, 3, 5, 16), (2, 1, 5, 16)),
    ((2, 3, 5, 16), (2, 3, 5, 16)),
    ((2, 5, 3, 16), (1, 5, 1, 16)),
    ((2, 5, 3, 16), (2, 5, 1, 16)),
    ((5, 2, 3, 16), (5, 1, 1, 16)),
    ((7, 3, 16), (7, 1, 16)),
    ((2, 3, 5, 16), (5, 16)),
]


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_x", [True, False], ids=["x", "no_x"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "x".join(map(str, l[1])))
def test_rope_grad_matches_autograd(mode, dtype, with_x, layout):
    torch.manual_seed(mode)
    dy_shape, cos_shape = layout
    dy, x = torch.randn(dy_shape, dtype=dtype), torch.randn(dy_shape, dtype=dtype)
    cos, sin = torch.randn(cos_shape, dtype=dtype), torch.randn(cos_shape, dtype=dtype)
    dx, dcos, dsin = rope_op(dy, cos, sin, x if with_x else None, mode)
    exact = rope_grads(dy, cos, sin, x, mode)
    unfused = rope_grads(dy, cos, sin, x, mode, dtype=dtype)
    assert dx.shape == dy.shape and dx.dtype == dtype
    assert_close_as_unfused(dx, unfused[0], exact[0])
    if with_x:
        for got, low, ref in zip((dcos, dsin), unfused[1:], exact[1:]):
            assert got.shape == cos.shape and got.dtype == dtype
            assert_close_as_unfused(got, low, ref)
    else:
        assert dcos.shape == (0,) and dsin.shape == (0,) and dcos.dtype == dtype


RMS_CASES = [  # (x shape, n): gamma = x.shape[n:]
    ((4, 7, 32), 2), ((3, 64), 1), ((2, 3, 4, 8), 2), ((2, 3, 4, 8), 3), ((16,), 0),
]
RMS_DTYPES = [(torch.float32, torch.float32), (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
              (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)]


# rstd has 1 to 8 axes (the original document), so n = 0 comes only with the keep-dim rstd
RMS_RSTD_FORMS = [pytest.param(case, keepdim, id=f"{case}-{'keepdim' if keepdim else 'flat_rstd'}")
                  for case in RMS_CASES for keepdim in (True, False) if keepdim or case[1] > 0]


@pytest.mark.parametrize("dtypes", RMS_DTYPES, ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("case, keepdim", RMS_RSTD_FORMS)
def test_rms_norm_grad_matches_autograd(dtypes, case, keepdim):
    torch.manual_seed(0)
    dtype, gamma_dtype = dtypes
    shape, n = case
    x, dy = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    gamma = torch.randn(shape[n:], dtype=gamma_dtype)
    eps = 1e-6
    dims = tuple(range(n, len(shape)))
    rstd = torch.rsqrt(x.double().pow(2).mean(dims, keepdim=keepdim) + eps).float()
    dx, dgamma = rms_op(dy, x, rstd, gamma)
    exact = rms_norm_grads(dy, x, gamma, eps, n)
    unfused = rms_norm_grads(dy, x, gamma.to(dtype), eps, n, dtype=dtype)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert dgamma.dtype == torch.float32 and dgamma.shape == gamma.shape
    assert_close_as_unfused(dx, unfused[0], exact[0])
    assert_close_as_unfused(dgamma.to(dtype), unfused[1], exact[1])


def test_rms_norm_grad_empty_and_non_contiguous():
    x = torch.randn(0, 8)
    dx, dgamma = rms_op(x, x, torch.ones(0, 1), torch.ones(8))
    assert dx.shape == (0, 8) and torch.equal(dgamma, torch.zeros(8))
    base = torch.randn(8, 6)
    x, dy = base.t(), torch.randn(8, 6).t()  # non-contiguous [6, 8]
    gamma = torch.randn(8)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    dx, dgamma = rms_op(dy, x, rstd, gamma)
    ref_dx, ref_dg = rms_op(dy.contiguous(), x.contiguous(), rstd, gamma)
    assert torch.allclose(dx, ref_dx) and torch.allclose(dgamma, ref_dg)


def _symbolic(mode, tensor, name, dims):
    """A fake of ``tensor`` whose axes ``dims`` are symbolic sizes of ``mode``'s ShapeEnv."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    ctx = StatelessSymbolicContext(dynamic_sizes=[
        DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(tensor.dim())])
    return mode.from_tensor(tensor, source=ConstantSource(name), symbolic_context=ctx)


def _fake_symbolic(shapes_and_dtypes, dynamic_dims):
    """Fake tensors whose chosen dims are symbolic (a ShapeEnv), like a dynamic-shape trace."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    return mode, [_symbolic(mode, torch.empty(shape, dtype=dtype), f"t{i}", dynamic_dims.get(i, ()))
                  for i, (shape, dtype) in enumerate(shapes_and_dtypes)]


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_rope_meta_shapes_match_reference_including_symbolic(mode):
    dy, cos = torch.randn(2, 3, 5, 16), torch.randn(2, 1, 5, 16)
    real = rope_op(dy, cos, cos, dy, mode)
    with FakeTensorMode() as fm:
        fake = rope_op(fm.from_tensor(dy), fm.from_tensor(cos), fm.from_tensor(cos), fm.from_tensor(dy), mode)
    assert [t.shape for t in fake] == [t.shape for t in real]
    assert [t.dtype for t in fake] == [t.dtype for t in real]
    fm, (sdy, scos) = _fake_symbolic([((2, 3, 5, 16), torch.float32), ((2, 1, 5, 16), torch.float32)],
                                     {0: (0, 2), 1: (0, 2)})
    with fm:
        dx, dcos, dsin = rope_op(sdy, scos, scos, sdy, mode)
        no_x = rope_op(sdy, scos, scos, None, mode)
    assert any(isinstance(s, torch.SymInt) for s in dx.shape)
    assert tuple(dx.shape) == tuple(sdy.shape) and tuple(dcos.shape) == tuple(scos.shape)
    assert tuple(no_x[1].shape) == (0,)


def test_rms_norm_meta_shapes_match_reference_including_symbolic():
    x, rstd, gamma = torch.randn(2, 5, 32, dtype=torch.bfloat16), torch.rand(2, 5, 1), torch.randn(32)
    real = rms_op(x, x, rstd, gamma)
    with FakeTensorMode() as fm:
        fake = rms_op(*(fm.from_tensor(t) for t in (x, x, rstd, gamma)))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
    fm, (sx, sr, sg) = _fake_symbolic([((2, 5, 32), torch.bfloat16), ((2, 5, 1), torch.float32),
                                       ((32,), torch.float32)], {0: (0, 1), 1: (0, 1)})
    with fm:
        dx, dgamma = rms_op(sx, sx, sr, sg)
    assert tuple(dx.shape) == tuple(sx.shape) and any(isinstance(s, torch.SymInt) for s in dx.shape)
    assert tuple(dgamma.shape) == (32,) and dgamma.dtype == torch.float32


# -- every input outside docs/fused-ops.md is refused, in every setting ------------------

class T(NamedTuple):
    """A tensor argument of a call, made anew in each setting (eager, fake, symbolic, meta)."""
    shape: tuple
    dtype: torch.dtype = torch.float32
    device: str = "cpu"


F16, BF16, F64, I32 = torch.float16, torch.bfloat16, torch.float64, torch.int32
BNSD, TABLE = (2, 3, 4, 8), (4, 8)  # a 4-D dy and a cos/sin that broadcasts to it


def rope(dy, cos, sin, x=None, mode=0):
    return rope_op, (dy, cos, sin, x, mode)


def rope_d(d, mode=0):
    return rope(T((1, 2, 3, d)), T((3, d)), T((3, d)), None, mode)


def rms(dy, x, rstd, gamma):
    return rms_op, (dy, x, rstd, gamma)


def rms_2d(dtype=torch.float32, rstd=T((2, 1)), gamma=T((8,))):
    return rms(T((2, 8), dtype), T((2, 8), dtype), rstd, gamma)


BAD_INPUTS = {  # name: (call, the constraint its message must name)
    "rope-mode-5": (rope(T(BNSD), T(TABLE), T(TABLE), mode=5), "mode must be an int, one of [0, 1, 2, 3]"),
    "rope-mode-negative": (rope(T(BNSD), T(TABLE), T(TABLE), mode=-1), "mode must be an int, one of"),
    "rope-dy-float64": (rope(T(BNSD, F64), T(TABLE, F64), T(TABLE, F64)),
                        "dy dtype must be float16, bfloat16 or float32"),
    "rope-dy-int32": (rope(T(BNSD, I32), T(TABLE, I32), T(TABLE, I32)), "dy dtype must be float16"),
    "rope-cos-dtype": (rope(T(BNSD), T(TABLE, F16), T(TABLE)), "cos dtype torch.float16 must equal dy dtype"),
    "rope-sin-dtype": (rope(T(BNSD), T(TABLE), T(TABLE, BF16)), "sin dtype torch.bfloat16 must equal dy dtype"),
    "rope-x-dtype": (rope(T(BNSD), T(TABLE), T(TABLE), T(BNSD, F16)), "x dtype torch.float16 must equal dy dtype"),
    "rope-cos-on-meta": (rope(T(BNSD), T(TABLE, device="meta"), T(TABLE)), "must be on the same device"),
    "rope-x-on-meta": (rope(T(BNSD), T(TABLE), T(TABLE), T(BNSD, device="meta")), "must be on the same device"),
    "rope-dy-rank-2": (rope(T(TABLE), T(TABLE), T(TABLE)), "dy must have 3 or 4 dimensions"),
    "rope-dy-rank-5": (rope(T((2,) + BNSD), T(TABLE), T(TABLE)), "dy must have 3 or 4 dimensions"),
    "rope-cos-rank-above-dy": (rope(T(BNSD), T((1,) + BNSD), T((1,) + BNSD)),
                               "cos/sin must have between 1 and dy.dim()=4 dimensions"),
    "rope-cos-0d": (rope(T(BNSD), T(()), T(())), "cos/sin must have between 1 and dy.dim()=4 dimensions"),
    "rope-cos-sin-shapes-differ": (rope(T(BNSD), T(TABLE), T((1, 8))), "cos and sin must have the same shape"),
    "rope-cos-not-broadcastable": (rope(T(BNSD), T((3, 8)), T((3, 8))), "must broadcast to dy shape"),
    "rope-cos-enlarges-dy": (rope(T((2, 1, 4, 8)), T(BNSD), T(BNSD)), "without enlarging it"),
    "rope-tnd-cos-2d": (rope(T((7, 3, 8)), T((3, 8)), T((3, 8))), "cos/sin must be T1D or TND"),
    "rope-tnd-cos-11d": (rope(T((7, 3, 8)), T((1, 1, 8)), T((1, 1, 8))), "cos/sin must be T1D or TND"),
    "rope-cos-last-axis": (rope(T(BNSD), T((4, 6)), T((4, 6))), "must equal dy last dimension D=8"),
    "rope-D2048": (rope_d(2048), f"D=2048 must be <= {ROPE_MAX_D}"),
    "rope-D1026": (rope_d(1026), f"D=1026 must be <= {ROPE_MAX_D}"),
    "rope-D2048-quarter": (rope_d(2048, mode=2), f"D=2048 must be <= {ROPE_MAX_D}"),
    "rope-D7-half": (rope_d(7), "D=7 must be divisible by 2 in half mode"),
    "rope-D7-interleave-half": (rope_d(7, mode=3), "D=7 must be divisible by 2 in interleave-half mode"),
    "rope-D6-quarter": (rope_d(6, mode=2), "D=6 must be divisible by 4 in quarter mode"),
    "rope-x-shape": (rope(T(BNSD), T(TABLE), T(TABLE), T((3, 4, 8))), "x shape [3, 4, 8] must equal dy shape"),
    "rope-x-broadcast-only": (rope(T(BNSD), T(TABLE), T(TABLE), T((1, 3, 4, 8))), "must equal dy shape"),
    "rms-dy-float64": (rms_2d(F64), "dy dtype must be float16, bfloat16 or float32"),
    "rms-dy-int32": (rms_2d(I32), "dy dtype must be float16, bfloat16 or float32"),
    "rms-x-dtype": (rms(T((2, 8)), T((2, 8), F16), T((2, 1)), T((8,))), "x dtype torch.float16 must equal dy"),
    "rms-rstd-float16": (rms_2d(rstd=T((2, 1), F16)), "rstd dtype must be float32"),
    "rms-rstd-float64": (rms_2d(rstd=T((2, 1), F64)), "rstd dtype must be float32"),
    "rms-gamma-bf16-for-fp16": (rms_2d(F16, gamma=T((8,), BF16)), "unsupported dtype combination"),
    "rms-gamma-fp16-for-fp32": (rms_2d(gamma=T((8,), F16)), "unsupported dtype combination"),
    "rms-gamma-float64": (rms_2d(gamma=T((8,), F64)), "unsupported dtype combination"),
    "rms-x-0d": (rms(T(()), T(()), T((1,)), T((1,))), "x must have 1 to 8 dimensions, got 0"),
    "rms-x-rank-9": (rms(T((1,) * 8 + (8,)), T((1,) * 8 + (8,)), T((1,) * 9), T((8,))),
                     "x must have 1 to 8 dimensions, got 9"),
    "rms-dy-shape": (rms(T((2, 4)), T((2, 8)), T((2, 1)), T((8,))), "dy shape [2, 4] must equal x shape"),
    "rms-gamma-not-trailing": (rms_2d(gamma=T((4,))), "gamma shape [4] must equal x.shape[n:]"),
    "rms-gamma-rank-above-x": (rms_2d(gamma=T((1, 2, 8))), "gamma shape [1, 2, 8] must equal x.shape[n:]"),
    "rms-gamma-middle-axes": (rms(T((2, 3, 8)), T((2, 3, 8)), T((2, 1, 1)), T((2, 8))), "must equal x.shape[n:]"),
    "rms-rstd-shape": (rms_2d(rstd=T((3, 1))), "rstd shape [3, 1] must equal x.shape[:1]"),
    "rms-rstd-not-keepdim": (rms_2d(rstd=T((2, 8))), "rstd shape [2, 8] must equal x.shape[:1]"),
    "rms-rstd-0d": (rms(T((8,)), T((8,)), T(()), T((8,))), "rstd must have 1 to 8 dimensions, got 0"),
    "rms-rstd-on-meta": (rms_2d(rstd=T((2, 1), device="meta")), "must be on the same device"),
    "rms-gamma-on-meta": (rms_2d(gamma=T((8,), device="meta")), "must be on the same device"),
}

VALID_INPUTS = {  # the edges of the same constraints, which must pass
    "rope-D1024-with-x": rope(T((1, 2, 3, ROPE_MAX_D)), T((3, ROPE_MAX_D)), T((3, ROPE_MAX_D)),
                              T((1, 2, 3, ROPE_MAX_D))),
    "rope-bnsd-b1sd": rope(T(BNSD, BF16), T((2, 1, 4, 8), BF16), T((2, 1, 4, 8), BF16), T(BNSD, BF16), 1),
    "rope-tnd-t1d-quarter": rope(T((7, 3, 8), F16), T((7, 1, 8), F16), T((7, 1, 8), F16), None, 2),
    "rope-d-table-interleave-half": rope(T(BNSD), T((8,)), T((8,)), T(BNSD), 3),
    "rms-8d-keepdim": rms(T((1,) * 7 + (8,)), T((1,) * 7 + (8,)), T((1,) * 8), T((8,))),
    "rms-n0-keepdim": rms(T((2, 8), F16), T((2, 8), F16), T((1, 1)), T((2, 8))),
    "rms-flat-rstd-fp16-gamma": rms(T((2, 3, 8), F16), T((2, 3, 8), F16), T((2,)), T((3, 8), F16)),
    "rms-empty": rms(T((0, 8), BF16), T((0, 8), BF16), T((0, 1)), T((8,), BF16)),
}


def _real(t: T):
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device)


def _run(call, make, mode=None):
    op, args = call
    args = tuple(make(a) if isinstance(a, T) else a for a in args)
    with mode if mode is not None else contextlib.nullcontext():
        return op(*args)


def _run_fake(call):
    mode = FakeTensorMode()
    return _run(call, lambda t: mode.from_tensor(_real(t)), mode)


def _run_symbolic(call):
    """Every axis a symbolic size, as in a dynamic-shape trace (sizes 0 and 1 stay static)."""
    mode, names = FakeTensorMode(shape_env=ShapeEnv()), iter(range(10))
    return _run(call, lambda t: _symbolic(mode, _real(t), f"a{next(names)}", range(len(t.shape))), mode)


def _run_meta(call):
    return _run(call, lambda t: torch.zeros(t.shape, dtype=t.dtype, device="meta"))


SETTINGS = {"eager": lambda call: _run(call, _real), "fake": _run_fake, "symbolic": _run_symbolic,
            "meta": _run_meta}


def _on_one_device(call):
    return all(a.device == "cpu" for a in call[1] if isinstance(a, T))


def _runs(calls):
    """(name, setting) pairs, numbered: on meta only the calls whose devices meta does not change."""
    pairs = [(name, setting) for name, call in calls.items() for setting in SETTINGS
             if setting != "meta" or _on_one_device(call)]
    return [pytest.param(name, setting, id=f"{i + 1:03d}-{name}-{setting}") for i, (name, setting) in
            enumerate(pairs)]


def test_bad_input_table_covers_both_ops():
    ops = [call[0] for call, _ in BAD_INPUTS.values()]
    assert ops.count(rope_op) >= 20 and ops.count(rms_op) >= 15, (ops.count(rope_op), ops.count(rms_op))


@pytest.mark.parametrize("name, setting", _runs({name: call for name, (call, _) in BAD_INPUTS.items()}))
def test_bad_input_is_refused_naming_the_constraint(name, setting):
    call, constraint = BAD_INPUTS[name]
    with pytest.raises(FusedOpInputError, match=re.escape(constraint)):
        SETTINGS[setting](call)


@pytest.mark.parametrize("name, setting", _runs(VALID_INPUTS))
def test_valid_input_is_accepted(name, setting):
    op, args = VALID_INPUTS[name]
    outs = SETTINGS[setting](VALID_INPUTS[name])
    assert tuple(outs[0].shape) == args[0].shape and outs[0].dtype == args[0].dtype


def test_guard_or_true_fallback_agrees_with_torch():
    """The fallback used by torch releases without ``guard_or_true`` (2.6, 2.7) gives the same answers."""
    mode, (t,) = _fake_symbolic([((5, 8), torch.float32)], {0: (0, 1)})
    s0, s1 = t.shape
    u0 = mode.shape_env.create_unbacked_symint()
    conditions = [s0 == 5, s0 == 4, s0 == s1, s0 * 2 == s0, u0 == 3, u0 + 1 == u0]
    expected = [True, False, False, False, True, False]
    assert [compat._guard_or_true_by_guard(c) for c in conditions] == expected
    if hasattr(symbolic_shapes, "guard_or_true"):
        assert [bool(symbolic_shapes.guard_or_true(c)) for c in conditions] == expected


@pytest.mark.parametrize("name", [n for n, (call, _) in BAD_INPUTS.items() if _on_one_device(call)])
def test_bad_symbolic_input_is_refused_with_the_fallback(monkeypatch, name):
    monkeypatch.setattr(compat, "_GUARD_OR_TRUE", compat._guard_or_true_by_guard)
    call, constraint = BAD_INPUTS[name]
    with pytest.raises(FusedOpInputError, match=re.escape(constraint)):
        _run_symbolic(call)


def test_valid_meta_call_in_a_fresh_process():
    """The first call in a process, on meta tensors, needs no module another import happened to load."""
    code = ("import torch, npu_fusion\n"
            "m = lambda *s: torch.empty(s, device='meta')\n"
            "dx, dcos, _ = torch.ops.npu_fusion.rotary_position_embedding_grad(m(2, 3, 5, 16), m(5, 16), "
            "m(5, 16), m(2, 3, 5, 16), 0)\n"
            "dx2, dg = torch.ops.npu_fusion.rms_norm_grad(m(2, 5, 32), m(2, 5, 32), m(2, 5, 1), m(32))\n"
            "print(list(dx.shape), list(dcos.shape), list(dx2.shape), list(dg.shape), dx.device)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[0] == "[2, 3, 5, 16] [5, 16] [2, 5, 32] [32] meta"
