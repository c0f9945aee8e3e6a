"""Conformance tests generated from the fused-op registry (``lowering.FUSED_OPS``): every op, every
declared case, without per-op test code.

* numerics: the op (its reference kernel, through the dispatcher) against the unfused program
  it replaces, run in the inputs' dtype and in float64, by the shared float64 criterion
  (:func:`npu_fusion.testing.grads.assert_close_as_unfused`); shapes as the unfused program's;
* meta: the fake kernel's shapes and dtypes equal the reference kernel's;
* targets: every declared case passes the op's checks and runs on some chip;
* schema: the declaration names as many outputs as the schema returns.

The GE and NPU-binding halves run per op and case in ``tests/torchair/test_op_contracts.py``
(they need torchair's sources and a torch_npu wheel).
"""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import npu_fusion  # noqa: F401  (registers the fused ops)
from npu_fusion.lowering import FUSED_OPS
from npu_fusion.testing.grads import assert_close_as_unfused

CASES = [pytest.param(op, number, case, id=f"{op.name}-{number}")
         for op in FUSED_OPS for number, case in enumerate(op.cases())]


def _outputs(result):
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _wide(case):
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in case)


@pytest.mark.parametrize("op, number, case", CASES)
def test_op_is_as_close_to_float64_as_the_unfused_program(op, number, case):
    fused = _outputs(op.overload(*case))
    unfused, exact = _outputs(op.unfused(*case)), _outputs(op.unfused(*_wide(case)))
    assert len(fused) == len(unfused) == len(op.outputs)
    for name, got, low, ref in zip(op.outputs, fused, unfused, exact):
        assert got.shape == low.shape, (name, got.shape, low.shape)
        if got.numel():  # RoPE's backward without x: dcos/dsin are [0]-shaped
            assert_close_as_unfused(got, low, ref)


@pytest.mark.parametrize("op, number, case", CASES)
def test_meta_kernel_agrees_with_the_reference(op, number, case):
    real = _outputs(op.overload(*case))
    with FakeTensorMode() as mode:
        fake = _outputs(op.overload(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in case)))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


@pytest.mark.parametrize("op, number, case", CASES)
def test_declared_case_is_valid_on_some_chip(op, number, case):
    op.check_inputs(*case)
    assert any(op.target_problem(target, *case) is None for target in ("a2", "a3", "950"))


@pytest.mark.parametrize("op", FUSED_OPS, ids=lambda op: op.name)
def test_declaration_matches_the_schema(op):
    assert len(op.overload._schema.returns) == len(op.outputs)
    assert op.argument_names() == tuple(a.name for a in op.overload._schema.arguments)
    assert set(op.npu.bound_names()) <= set(op.argument_names())
    assert {i.name for i in op.ge.inputs if not i.optional} <= set(op.argument_names())
    assert len(op.ge.outputs) == len(op.outputs)
