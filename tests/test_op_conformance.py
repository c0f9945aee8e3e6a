"""Conformance tests generated from the fused-op registry (``lowering.FUSED_OPS``): every op, every
declared case, without per-op test code.

* numerics: the op (its reference kernel, through the dispatcher) against the unfused program
  it replaces, run in the inputs' dtype and in float64, by the shared float64 criterion
  (:func:`npu_fusion.measure.grads.assert_close_as_unfused`); shapes as the unfused program's;
* meta: the fake kernel's shapes and dtypes equal the reference kernel's;
* targets: every declared case passes the op's checks and runs on some chip, and on Ascend 950;
* schema: the declaration names as many outputs as the schema returns, and
  ``torch.library.opcheck`` holds on the first and last declared case (its checks are of the
  registration, not of the numbers);
* GE: the node the registered converter builds for each declared case, against the ``REG_OP``
  torchair generated in the torch_npu wheel of the installed torch's line (torchair's real
  sources, CANN stubbed; :mod:`npu_fusion_testing.torchair.npu_contracts`);
* NPU binding: the op's eager kernel against that wheel's schemas of its torch_npu op, both
  the compiled one and the codegen yaml's (``scripts/check_npu_contracts.py`` checks every line).

The GE and NPU tests skip only when the package index that has the wheel cannot be reached.
"""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import npu_fusion  # noqa: F401  (registers the fused ops)
from npu_fusion.lowering import FUSED_OPS
from npu_fusion.measure.grads import assert_close_as_unfused
from npu_fusion_testing.torchair import harness, npu_contracts

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


@pytest.mark.parametrize("op, number, case", CASES)
def test_declared_case_runs_on_every_chip(op, number, case):
    """Ascend 950 accepts every declared case (it takes all that A2/A3 take, RoPE's modes 2 and 3
    besides); so does ``common`` where the op's documented limits are every chip's."""
    assert op.target_problem("950", *case) is None
    if all(op.target_problem(chip, *case) is None for chip in ("a2", "a3")):
        assert op.target_problem("common", *case) is None


@pytest.mark.parametrize("op, case", [pytest.param(op, case, id=f"{op.name}-{end}") for op in FUSED_OPS
                                      for end, case in (("first", list(op.cases())[0]), ("last", list(op.cases())[-1]))])
def test_opcheck(op, case):
    torch.library.opcheck(op.overload, case)


@pytest.mark.parametrize("op", FUSED_OPS, ids=lambda op: op.name)
def test_declaration_matches_the_schema(op):
    assert len(op.overload._schema.returns) == len(op.outputs)
    assert op.argument_names() == tuple(a.name for a in op.overload._schema.arguments)
    assert set(op.npu.bound_names()) <= set(op.argument_names())
    assert {i.name for i in op.ge.inputs if not i.optional} <= set(op.argument_names())
    assert len(op.ge.outputs) == len(op.outputs)
    # the partitioner's hand-off reads what the op recomputes by its schema's argument names
    assert set(op.recomputable) <= set(op.argument_names())


def _or_skip(load):
    try:
        return load()
    except harness.TorchairUnavailable as error:
        if error.offline or error.unpublished:
            pytest.skip(f"needs the torch_npu wheel of this torch's line: {error}")
        raise


@pytest.fixture(scope="module")
def sources():
    return _or_skip(harness.contract_sources)


@pytest.fixture(scope="module")
def ge_irs(sources):
    from npu_fusion.lowering import ge_converters

    _or_skip(harness.load_torchair)
    assert ge_converters.register(), "npu_fusion's GE converters did not register with torchair"
    return npu_contracts.ir_definitions(sources)


@pytest.mark.parametrize("op, number, case", CASES)
def test_ge_node_matches_the_wheels_ir(ge_irs, op, number, case):
    problems = []
    converter = npu_contracts.registered_converter(op.overload)
    assert npu_contracts.check_case(op, case, ge_irs[op.ge.op], converter, problems)
    assert problems == []


@pytest.mark.parametrize("op", FUSED_OPS, ids=lambda op: op.name)
def test_npu_kernel_binds_to_the_wheels_schemas(sources, op):
    problems, seen = npu_contracts.check_eager_kernels(sources, ops=(op,))
    assert problems == []
    assert seen["calls"][op.npu.op] > 0
