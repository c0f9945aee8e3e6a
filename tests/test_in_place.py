"""A caller's in-place update between forward and backward (issue 30): a tensor the caller can
reach (a graph input, a returned tensor, a view of either) is saved for the backward only where
the unfused program saved it too, so every program eager allows runs compiled, on every rule
(RMSNorm and RoPE, forward and backward, paired or not), dtype and partitioner, with outputs and
gradients by the float64 criterion. The Inductor and torchair paths run the same programs in
``test_inductor.py`` and ``tests/torchair/``."""
import pytest
import torch

from npu_fusion.plugin import pass_manager
from npu_fusion.plugin.backend import aot_backend
from npu_fusion.plugin.options import FusionOptions
from npu_fusion.patterns import RULES
from npu_fusion_testing.in_place import UPDATED_PROGRAMS, assert_refused_as_unfused, assert_updated_as_eager

LEGAL = [(p, dtype) for p in UPDATED_PROGRAMS for dtype in p.legal]
ILLEGAL = [(p, dtype) for p in UPDATED_PROGRAMS
           for dtype in (torch.bfloat16, torch.float16, torch.float32) if dtype not in p.legal]


def _compiled(program, partitioner, forward):
    options = FusionOptions(target="generic", strict=True, partitioner=partitioner,
                            rms_norm_forward=forward, rope_forward=forward)
    torch._dynamo.reset()
    return torch.compile(program.fn, backend=aot_backend(options))


@pytest.mark.parametrize("forward", [True, False], ids=["paired", "backward_only"])
@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
@pytest.mark.parametrize("program, dtype", LEGAL, ids=[f"{p.name}-{str(d)[6:]}" for p, d in LEGAL])
def test_caller_update_legal_in_eager_is_legal_compiled(program, dtype, partitioner, forward):
    mark = pass_manager.HISTORY.mark()
    assert_updated_as_eager(_compiled(program, partitioner, forward), program, dtype)
    results = pass_manager.HISTORY.since(mark)
    fused = {op: sum(r.fused(op) for r in results) for op in program.fused}
    assert fused == {op: n if forward or op.endswith("_grad") else 0 for op, n in program.fused.items()}, results
    assert all(r.error is None for r in results), results


@pytest.mark.parametrize("program, dtype", ILLEGAL, ids=[f"{p.name}-{str(d)[6:]}" for p, d in ILLEGAL])
def test_the_dtypes_left_out_are_those_eager_refuses(program, dtype):
    """Where the unfused program saved the tensor the caller updates, eager raises: those dtypes
    are no claim of the test above (the program is not legal to begin with)."""
    with pytest.raises(RuntimeError, match="modified (by an )?inplace"):
        program.run(program.fn, dtype)


@pytest.mark.parametrize("forward", [True, False], ids=["paired", "backward_only"])
@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
@pytest.mark.parametrize("program, dtype", ILLEGAL, ids=[f"{p.name}-{str(d)[6:]}" for p, d in ILLEGAL])
def test_caller_update_eager_refuses_is_refused_as_unfused(program, dtype, partitioner, forward):
    """Where eager refuses the update, the pass does not let it through: the compiled program
    raises where the same compile with every rule off raises, and runs alike where it runs."""
    mark = pass_manager.HISTORY.mark()
    compiled = _compiled(program, partitioner, forward)
    unfused = torch.compile(program.fn, backend=aot_backend(FusionOptions(
        target="generic", strict=True, partitioner=partitioner, **{rule.option: False for rule in RULES})))
    assert_refused_as_unfused(compiled, unfused, program, dtype)
    assert sum(r.fused(op) for r in pass_manager.HISTORY.since(mark) for op in program.fused) > 0


def test_issue_reproducer_returned_residual_bf16():
    """The issue's program as it was reported: the returned sum doubled, then the backward of the
    output's float32 sum."""
    def f(x, r, w):
        h = x + r
        hf = h.float()
        return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype), h

    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(2, 6, 16, generator=gen).bfloat16().requires_grad_() for _ in range(2))
    w = torch.randn(16, generator=gen).bfloat16().requires_grad_()
    torch._dynamo.reset()
    y, h = torch.compile(f, backend="npu_fusion", options={"target": "generic"})(x, r, w)
    with torch.no_grad():
        h.mul_(2.0)
    y.float().sum().backward()
    assert x.grad is not None and w.grad is not None
