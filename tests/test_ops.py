"""The fused ops on their own: numerics against float64 autograd, meta shapes, opcheck, errors."""
import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import npu_fusion  # noqa: F401
from npu_fusion.lowering.constraints import FusedOpInputError
from reference import assert_close_as_unfused, rms_norm_grads, rope_grads

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


@pytest.mark.parametrize("dtypes", RMS_DTYPES, ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("case", RMS_CASES, ids=str)
@pytest.mark.parametrize("keepdim", [True, False], ids=["keepdim", "flat_rstd"])
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


def _fake_symbolic(shapes_and_dtypes, dynamic_dims):
    """Fake tensors whose chosen dims are symbolic (a ShapeEnv), like a dynamic-shape trace."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    out = []
    for i, (shape, dtype) in enumerate(shapes_and_dtypes):
        ctx = StatelessSymbolicContext(dynamic_sizes=[
            DimDynamic.DYNAMIC if d in dynamic_dims.get(i, ()) else DimDynamic.STATIC for d in range(len(shape))])
        out.append(mode.from_tensor(torch.empty(shape, dtype=dtype), source=ConstantSource(f"t{i}"),
                                    symbolic_context=ctx))
    return mode, out


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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", [((2, 3, 5, 8), (1, 1, 5, 8)), ((4, 8), (4, 8)), ((3, 2, 8), (3, 1, 8))])
def test_opcheck(dtype, shapes):
    dy_shape, cos_shape = shapes
    for mode, with_x in itertools.product(range(4), (True, False)):
        args = (torch.randn(dy_shape, dtype=dtype), torch.randn(cos_shape, dtype=dtype),
                torch.randn(cos_shape, dtype=dtype), torch.randn(dy_shape, dtype=dtype) if with_x else None, mode)
        torch.library.opcheck(rope_op, args)
    x = torch.randn(dy_shape, dtype=dtype)
    rstd = torch.rand(dy_shape[:-1] + (1,))
    gamma = torch.randn(dy_shape[-1:], dtype=torch.float32 if dtype == torch.float32 else dtype)
    torch.library.opcheck(rms_op, (torch.randn_like(x), x, rstd, gamma))


@pytest.mark.parametrize("call, message", [
    (lambda: rope_op(torch.randn(2, 4, 8), torch.randn(4, 8).half(), torch.randn(4, 8).half()), "cos dtype"),
    (lambda: rope_op(torch.randn(2, 4, 8), torch.randn(3, 8), torch.randn(3, 8)), "must broadcast to dy"),
    (lambda: rope_op(torch.randn(2, 4, 7), torch.randn(4, 7), torch.randn(4, 7)), "divisible by 2"),
    (lambda: rope_op(torch.randn(2, 4, 6), torch.randn(4, 6), torch.randn(4, 6), None, 2), "divisible by 4"),
    (lambda: rope_op(torch.randn(2, 4, 8), torch.randn(4, 8), torch.randn(4, 8), None, 5), "mode must be one of"),
    (lambda: rope_op(torch.randn(2, 4, 8), torch.randn(4, 8), torch.randn(1, 8)), "same shape"),
    (lambda: rope_op(torch.randn(2, 4, 8), torch.randn(4, 8), torch.randn(4, 8), torch.randn(2, 8)),
     "x shape"),
    (lambda: rms_op(torch.randn(2, 8), torch.randn(2, 8), torch.rand(3, 1), torch.randn(8)), "rstd shape"),
    (lambda: rms_op(torch.randn(2, 8), torch.randn(2, 8), torch.rand(2, 1), torch.randn(4)), "gamma shape"),
    (lambda: rms_op(torch.randn(2, 8), torch.randn(2, 8), torch.rand(2, 1).half(), torch.randn(8)), "rstd dtype"),
    (lambda: rms_op(torch.randn(2, 8).half(), torch.randn(2, 8).half(), torch.rand(2, 1),
                    torch.randn(8).bfloat16()), "unsupported dtype combination"),
    (lambda: rms_op(torch.randn(2, 8).double(), torch.randn(2, 8).double(), torch.rand(2, 1),
                    torch.randn(8)), "dy dtype must be"),
    (lambda: rms_op(torch.randn(2, 8), torch.randn(2, 4), torch.rand(2, 1), torch.randn(8)), "dy shape"),
])
def test_bad_inputs_name_the_constraint(call, message):
    with pytest.raises(FusedOpInputError, match=message):
        call()
