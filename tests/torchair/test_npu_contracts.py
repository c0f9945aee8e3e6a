"""The NPU-side contract checks themselves, against the default torch_npu line (the wheel matching
the installed torch): what the wheel states, and that a deliberately wrong copy of each call
fails the check. That every op's kernel and converter hold the contract, case by case, is
``tests/test_op_conformance.py``'s (generated from the registry); ``scripts/check_npu_contracts.py``
runs the checks for every torch_npu line."""
from __future__ import annotations

import pytest
import torch

from npu_fusion.lowering import FUSED_OPS, RMS_NORM, RMS_NORM_GRAD, ROPE, ROPE_GRAD, npu
from npu_fusion_testing.torchair import harness, npu_contracts

ROPE_GRAD_CASES = list(ROPE_GRAD.cases())
#: RoPE backward cases torch_npu runs eagerly (x given, mode half or interleave), and those with
#: x in modes 2 and 3
ROPE_GRAD_EAGER = sum(1 for *_, x, mode in ROPE_GRAD_CASES if x is not None and mode in npu.TORCH_NPU_ROTARY_MODES)
ROPE_GRAD_950 = sum(1 for *_, x, mode in ROPE_GRAD_CASES if x is not None and mode not in npu.TORCH_NPU_ROTARY_MODES)
RMS_NORM_GRAD_CASES = len(list(RMS_NORM_GRAD.cases()))
RMS_NORM_CASES = len(list(RMS_NORM.cases()))


@pytest.fixture(scope="module")
def sources():
    try:
        return harness.contract_sources()
    except harness.TorchairUnavailable as error:
        if error.offline:
            pytest.skip(f"the contract check needs the torch_npu wheel and the package index is unreachable: {error}")
        raise


# -- eager kernels ------------------------------------------------------------

def test_wheel_states_every_schema_and_the_eager_modes(sources):
    for schemas in (sources["registered_schemas"], sources["yaml_schemas"]):
        assert set(schemas) == {op.npu.op for op in FUSED_OPS}
    assert npu_contracts.eager_rotary_modes(sources) == ["half", "interleave"]
    assert npu_contracts.eager_values(sources, ROPE) == {"mode": ["half", "interleave"]}


def test_every_mode_torch_npu_runs_eagerly_is_used(sources):
    """A mode torch_npu's eager kernel accepts, and torchair maps to the same GE mode, does not
    fall back to the reference kernel (forward and backward)."""
    for op in (ROPE, ROPE_GRAD):
        torchair_modes = {name: int(number) for name, number in sources["torchair_value_maps"][op.npu.op]}
        usable = {torchair_modes[name]: name for name in npu_contracts.eager_values(sources, op)["mode"]}
        assert op.npu.values["mode"] == usable


def _rms_norm_grad_rstd_and_gamma_swapped(dy, x, rstd, gamma):
    return torch.ops.npu.npu_rms_norm_backward(dy, x, rstd, gamma)


def _rms_norm_x_and_gamma_swapped(x, gamma, eps):
    return torch.ops.npu.npu_rms_norm(gamma, x, epsilon=eps)


def _rope_grad_mode_as_int(dy, cos, sin, x=None, mode=0):
    if x is None:
        return ROPE_GRAD.reference(dy, cos, sin, x, mode)
    return torch.ops.npu.npu_rotary_mul_backward(dy, x, cos, sin, rotary_mode=mode)


def _rope_cos_and_sin_swapped(x, cos, sin, mode):
    if mode not in npu.TORCH_NPU_ROTARY_MODES:
        return ROPE.reference(x, cos, sin, mode)
    return torch.ops.npu.npu_rotary_mul(x, sin, cos, rotary_mode=npu.TORCH_NPU_ROTARY_MODES[mode])


def test_wrong_eager_calls_fail_the_check(sources):
    problems, _ = npu_contracts.check_eager_kernels(
        sources, {RMS_NORM_GRAD.name: _rms_norm_grad_rstd_and_gamma_swapped}, ops=(RMS_NORM_GRAD,))
    assert len(problems) == 2 * RMS_NORM_GRAD_CASES and all("rms_norm_grad(" in p for p in problems)

    problems, _ = npu_contracts.check_eager_kernels(sources, {RMS_NORM.name: _rms_norm_x_and_gamma_swapped},
                                                    ops=(RMS_NORM,))
    # gamma in x's place: every call refused by the op's own checks, read from torch_npu's positions
    assert len(problems) == 2 * RMS_NORM_CASES and all("FusedOpInputError: rms_norm:" in p for p in problems)

    problems, _ = npu_contracts.check_eager_kernels(sources, {ROPE_GRAD.name: _rope_grad_mode_as_int},
                                                    ops=(ROPE_GRAD,))
    *unbound, unused = problems  # every call with x refused (modes 2, 3 as well), so nothing reached torch_npu
    assert len(unbound) == 2 * (ROPE_GRAD_EAGER + ROPE_GRAD_950) and all("rotary_mode" in p for p in unbound)
    assert unused == ("never reached torch_npu: ['npu_rotary_mul_backward half', "
                      "'npu_rotary_mul_backward interleave', 'npu_rotary_mul_backward']")

    problems, _ = npu_contracts.check_eager_kernels(sources, {ROPE.name: _rope_cos_and_sin_swapped}, ops=(ROPE,))
    eager = sum(1 for *_, mode in ROPE.cases() if mode in npu.TORCH_NPU_ROTARY_MODES)
    assert len(problems) == 2 * eager and all("differs from the reference kernel" in p for p in problems)


def _rope_every_mode_eagerly(x, cos, sin, mode):
    names = {0: "half", 1: "interleave", 2: "quarter", 3: "interleave-half"}
    return torch.ops.npu.npu_rotary_mul(x, cos, sin, rotary_mode=names[mode])


def test_a_kernel_that_never_calls_torch_npu_fails_the_check(sources):
    problems, _ = npu_contracts.check_eager_kernels(sources, {RMS_NORM.name: RMS_NORM.reference}, ops=(RMS_NORM,))
    assert problems == ["never reached torch_npu: ['npu_rms_norm']"]


def test_a_mode_the_eager_kernel_refuses_fails_the_check(sources):
    problems, _ = npu_contracts.check_eager_kernels(sources, {ROPE.name: _rope_every_mode_eagerly}, ops=(ROPE,))
    refused = sum(1 for *_, mode in ROPE.cases() if mode not in npu.TORCH_NPU_ROTARY_MODES)
    assert len(problems) == 2 * refused
    assert all("The rotary_mode of npu_rotary_mul should be half or interleave, but got" in p for p in problems)

    claimed = {ROPE_GRAD.name: {"mode": {**npu.TORCH_NPU_ROTARY_MODES, 2: "quarter"}}}
    assert npu_contracts.check_value_tables(sources, (ROPE_GRAD,), claimed) == [
        "npu_rotary_mul_backward mode 'quarter' (mode 2): torch_npu's eager kernel accepts only half or interleave"]
    swapped = {ROPE.name: {"mode": {0: "interleave", 1: "half"}}}
    assert len(npu_contracts.check_value_tables(sources, (ROPE,), swapped)) == 2


# -- GE converters ------------------------------------------------------------

def test_reg_op_definitions_parse(sources):
    irs = npu_contracts.ir_definitions(sources)
    rope = irs["RotaryPositionEmbeddingGrad"]
    assert [(n, optional) for n, optional, _ in rope.inputs] == [
        ("dy", False), ("cos", False), ("sin", False), ("x", True)]
    assert [n for n, _ in rope.outputs] == ["dx", "dcos", "dsin"]
    assert rope.attrs == {"mode": ("Int", "0")}
    rms = irs["RmsNormGrad"]
    assert [n for n, _, _ in rms.inputs] == ["dy", "x", "rstd", "gamma"]
    assert rms.inputs[2][2] == {"DT_FLOAT"} and rms.outputs[1] == ("dgamma", frozenset({"DT_FLOAT"}))
    assert rms.inputs[0][2] == {"DT_FLOAT", "DT_FLOAT16", "DT_BF16"}
    norm = irs["RmsNorm"]
    assert [n for n, _ in norm.outputs] == ["y", "rstd"] and norm.attrs == {"epsilon": ("Float", "1e-6")}
    assert [(n, optional) for n, optional, _ in irs["RotaryPositionEmbedding"].inputs][-1] == ("rotate", True)


def test_builders_in_use(torchair, sources):
    npu_contracts.check_ge_converters(sources, ops=())  # the converters are registered by the fixture
    assert npu_contracts.builders_in_use() == {
        "RmsNormGrad": "torchair", "RotaryPositionEmbeddingGrad": "torchair",
        "RotaryPositionEmbeddingGrad without x": "own", "RmsNorm": "torchair", "RotaryPositionEmbedding": "torchair",
        "RotaryPositionEmbedding without rotate": "torchair", "SwiGlu": "torchair", "SwiGluGrad": "torchair"}


def _ge_rms_norm_grad_rstd_and_gamma_swapped(dy, x, rstd, gamma, meta_outputs=None):
    from torchair._ge_concrete_graph import ge_apis as ge

    return ge.RmsNormGrad(dy, x, gamma, rstd)


def _ge_rms_norm_epsilon_as_int(x, gamma, eps, meta_outputs=None):
    from npu_fusion.lowering.ge_converters.builders import ir_builder
    from npu_fusion.lowering.fused_op import GeAttr
    import dataclasses

    ir = dataclasses.replace(RMS_NORM.ge, attrs=(GeAttr("epsilon", "Int", 0, "eps"),))
    return ir_builder(ir)(x, gamma, epsilon=1)


def _ge_rope_grad_mode_as_float(dy, cos, sin, x=None, mode=0, meta_outputs=None):
    from torchair._ge_concrete_graph.compat_ir import IrDef, ge_op
    from torchair.ge import attr

    kinds = "DT_FLOAT16, DT_FLOAT, DT_BFLOAT16"
    ir = IrDef("RotaryPositionEmbeddingGrad").input("dy", kinds).input("cos", kinds).input("sin", kinds)
    ir = ir.optional_input("x", kinds).attr("mode", attr.Float(0.0))
    ir = ir.output("dx", kinds).output("dcos", kinds).output("dsin", kinds)
    return ge_op(op_type="RotaryPositionEmbeddingGrad", inputs={"dy": dy, "cos": cos, "sin": sin, "x": x},
                 attrs={"mode": attr.Float(float(mode))}, outputs=["dx", "dcos", "dsin"], ir=ir)


def _ge_rope_cos_and_sin_swapped(x, cos, sin, mode, meta_outputs=None):
    from torchair._ge_concrete_graph import ge_apis as ge

    return ge.RotaryPositionEmbedding(x, sin, cos, mode=mode)


def test_wrong_ge_converters_fail_the_check(torchair, sources):
    problems, _ = npu_contracts.check_ge_converters(
        sources, {RMS_NORM_GRAD.overload: _ge_rms_norm_grad_rstd_and_gamma_swapped}, ops=(RMS_NORM_GRAD,))
    assert sum("IR input 'rstd' is fed from our argument 'gamma'" in p for p in problems) == RMS_NORM_GRAD_CASES

    problems, _ = npu_contracts.check_ge_converters(sources, {RMS_NORM.overload: _ge_rms_norm_epsilon_as_int},
                                                    ops=(RMS_NORM,))
    assert sum("attribute 'epsilon' is 'i', the IR's type Float wants 'f'" in p for p in problems) == RMS_NORM_CASES

    problems, _ = npu_contracts.check_ge_converters(
        sources, {ROPE_GRAD.overload: _ge_rope_grad_mode_as_float}, ops=(ROPE_GRAD,))
    # modes 1-3 as a float attribute; mode 0 is the IR default, left out either way
    assert sum("attribute 'mode' is 'f'" in p for p in problems) == sum(1 for *_, m in ROPE_GRAD_CASES if m)

    problems, _ = npu_contracts.check_ge_converters(sources, {ROPE.overload: _ge_rope_cos_and_sin_swapped},
                                                    ops=(ROPE,))
    assert sum("IR input 'cos' is fed from our argument 'sin'" in p for p in problems) == len(list(ROPE.cases()))


def test_an_ir_that_differs_from_our_nodes_fails_the_check(torchair, sources):
    """Our (correct) converters against a wheel whose IR were different."""
    changed = dict(sources, ge_ir=dict(sources["ge_ir"]))
    changed["ge_ir"]["RotaryPositionEmbeddingGrad"] = sources["ge_ir"]["RotaryPositionEmbeddingGrad"].replace(
        ".OPTIONAL_INPUT(x,", ".INPUT(x,").replace("ATTR(mode, Int, 0)", "ATTR(mode, Float, 0.0)")
    changed["ge_ir"]["RmsNormGrad"] = sources["ge_ir"]["RmsNormGrad"].replace(
        "OUTPUT(dgamma, TensorType({DT_FLOAT, DT_FLOAT, DT_FLOAT}))", "OUTPUT(dgamma, TensorType({DT_FLOAT16}))")
    changed["ge_ir"]["RmsNorm"] = sources["ge_ir"]["RmsNorm"].replace(".OUTPUT(rstd,", ".OUTPUT(std,")
    problems, _ = npu_contracts.check_ge_converters(changed)
    without_x = sum(1 for *_, x, _ in ROPE_GRAD_CASES if x is None)
    assert sum("the IR with these arguments wants ['dy', 'cos', 'sin', 'x']" in p for p in problems) == without_x
    assert sum("attribute 'mode' is 'i', the IR's type Float" in p for p in problems) == sum(
        1 for *_, m in ROPE_GRAD_CASES if m)
    assert sum("output dgamma declared DT_FLOAT, not in the IR's ['DT_FLOAT16']" in p
               for p in problems) == RMS_NORM_GRAD_CASES
    assert sum("outputs ['y', 'rstd'], the IR's are ['y', 'std']" in p for p in problems) == RMS_NORM_CASES
