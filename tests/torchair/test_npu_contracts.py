"""The NPU-side contracts against the default torch_npu line (the wheel matching the installed torch):
torch_npu's eager op schemas and torchair's generated GE op definitions, and that a
deliberately wrong copy of each call fails the check. ``scripts/check_npu_contracts.py``
runs the same checks for every torch_npu line."""
from __future__ import annotations

import pytest
import torch

from npu_fusion.lowering import npu, rms_norm
from npu_fusion_testing.torchair import harness, npu_contracts

ROPE_CASES_WITH_X_IN_EAGER_MODES = sum(
    1 for *_, x, mode in npu_contracts.rope_cases() if x is not None and mode in npu.TORCH_NPU_ROTARY_MODES)
RMS_NORM_CASES = sum(1 for _ in npu_contracts.rms_norm_cases())


@pytest.fixture(scope="module")
def sources():
    try:
        return harness.contract_sources()
    except harness.TorchairUnavailable as error:
        if error.offline:
            pytest.skip(f"the contract check needs the torch_npu wheel and the package index is unreachable: {error}")
        raise


# -- eager kernels ------------------------------------------------------------

def test_wheel_states_both_schemas_and_the_eager_modes(sources):
    for schemas in (sources["registered_schemas"], sources["yaml_schemas"]):
        assert set(schemas) == {"npu_rotary_mul_backward", "npu_rms_norm_backward"}
    assert npu_contracts.eager_rotary_modes(sources) == ["half", "interleave"]


def test_eager_kernels_bind_to_the_wheels_schemas(sources):
    problems, seen = npu_contracts.check_eager_kernels(sources)
    assert problems == []
    # both schema sources (registered and yaml), every case whose mode torch_npu runs eagerly
    assert seen["calls"] == {"npu_rotary_mul_backward": 2 * ROPE_CASES_WITH_X_IN_EAGER_MODES,
                             "npu_rms_norm_backward": 2 * RMS_NORM_CASES}
    assert seen["rotary_modes_on_npu"] == ["half", "interleave"]


def test_every_mode_torch_npu_runs_eagerly_is_used(sources):
    """A mode torch_npu's eager kernel accepts, and torchair maps to the same GE mode, does not
    fall back to the reference kernel."""
    torchair_modes = {name: int(number) for name, number in sources["torchair_rotary_modes"]}
    usable = {torchair_modes[name]: name for name in npu_contracts.eager_rotary_modes(sources)}
    assert npu.TORCH_NPU_ROTARY_MODES == usable


def _rms_norm_rstd_and_gamma_swapped(dy, x, rstd, gamma):
    return torch.ops.npu.npu_rms_norm_backward(dy, x, rstd, gamma)


def _rope_mode_as_int(dy, cos, sin, x=None, mode=0):
    if x is None:
        return npu.rope_grad_on_npu(dy, cos, sin, x, mode)
    return torch.ops.npu.npu_rotary_mul_backward(dy, x, cos, sin, rotary_mode=mode)


def _rope_cos_and_sin_swapped(dy, cos, sin, x=None, mode=0):
    if x is None or mode not in npu.TORCH_NPU_ROTARY_MODES:
        return npu.rope_grad_on_npu(dy, cos, sin, x, mode)
    return torch.ops.npu.npu_rotary_mul_backward(dy, x, sin, cos, rotary_mode=npu.TORCH_NPU_ROTARY_MODES[mode])


def test_wrong_eager_calls_fail_the_check(sources):
    problems, _ = npu_contracts.check_eager_kernels(sources, rms_kernel=_rms_norm_rstd_and_gamma_swapped)
    assert len(problems) == 2 * RMS_NORM_CASES and all("rms_norm_grad" in p for p in problems)

    problems, _ = npu_contracts.check_eager_kernels(sources, rope_kernel=_rope_mode_as_int)
    *unbound, unused = problems  # every call with x refused (modes 2, 3 as well), so nothing reached torch_npu
    assert len(unbound) == 2 * ROPE_CASES_WITH_X_IN_EAGER_MODES + 2 * 6
    assert all("rotary_mode" in p for p in unbound)
    assert unused == "never reached torch_npu: ['half', 'interleave', 'npu_rotary_mul_backward']"

    problems, _ = npu_contracts.check_eager_kernels(sources, rope_kernel=_rope_cos_and_sin_swapped)
    assert len(problems) == 2 * ROPE_CASES_WITH_X_IN_EAGER_MODES
    assert all("differs from the reference kernel" in p for p in problems)


def _rope_every_mode_eagerly(dy, cos, sin, x=None, mode=0):
    if x is None:
        return npu.rope_grad_on_npu(dy, cos, sin, x, mode)
    names = {0: "half", 1: "interleave", 2: "quarter", 3: "interleave-half"}
    return torch.ops.npu.npu_rotary_mul_backward(dy, x, cos, sin, rotary_mode=names[mode])


def test_a_kernel_that_never_calls_torch_npu_fails_the_check(sources):
    problems, _ = npu_contracts.check_eager_kernels(sources, rms_kernel=rms_norm.reference_kernel)
    assert problems == ["never reached torch_npu: ['npu_rms_norm_backward']"]


def test_a_mode_the_eager_kernel_refuses_fails_the_check(sources):
    problems, _ = npu_contracts.check_eager_kernels(sources, rope_kernel=_rope_every_mode_eagerly)
    assert len(problems) == 2 * 6  # modes 2 and 3 with x, three dtypes, both schema sources
    assert all("should be half or interleave, but got" in p for p in problems)

    claimed = {**npu.TORCH_NPU_ROTARY_MODES, 2: "quarter"}
    assert npu_contracts.check_rotary_mode_table(sources, claimed) == [
        "rotary_mode 'quarter' (mode 2): torch_npu's eager kernel accepts only half or interleave"]
    swapped = {0: "interleave", 1: "half"}
    assert len(npu_contracts.check_rotary_mode_table(sources, swapped)) == 2


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


def test_ge_converters_match_the_wheels_ir(torchair, sources):
    problems, seen = npu_contracts.check_ge_converters(sources)
    assert problems == []
    assert seen["nodes_checked"] == {"RotaryPositionEmbeddingGrad": 24, "RmsNormGrad": RMS_NORM_CASES}
    assert npu_contracts.builders_in_use() == {
        "RotaryPositionEmbeddingGrad": "torchair", "RotaryPositionEmbeddingGrad without x": "own",
        "RmsNormGrad": "torchair"}


def _ge_rms_norm_rstd_and_gamma_swapped(dy, x, rstd, gamma, meta_outputs=None):
    from torchair._ge_concrete_graph import ge_apis as ge

    return ge.RmsNormGrad(dy, x, gamma, rstd)


def _ge_rope_mode_as_float(dy, cos, sin, x=None, mode=0, meta_outputs=None):
    from torchair._ge_concrete_graph.compat_ir import IrDef, ge_op
    from torchair.ge import attr

    kinds = "DT_FLOAT16, DT_FLOAT, DT_BFLOAT16"
    ir = IrDef("RotaryPositionEmbeddingGrad").input("dy", kinds).input("cos", kinds).input("sin", kinds)
    ir = ir.optional_input("x", kinds).attr("mode", attr.Float(0.0))
    ir = ir.output("dx", kinds).output("dcos", kinds).output("dsin", kinds)
    return ge_op(op_type="RotaryPositionEmbeddingGrad", inputs={"dy": dy, "cos": cos, "sin": sin, "x": x},
                 attrs={"mode": attr.Float(float(mode))}, outputs=["dx", "dcos", "dsin"], ir=ir)


def test_wrong_ge_converters_fail_the_check(torchair, sources):
    rms = torch.ops.npu_fusion.rms_norm_grad.default
    problems, _ = npu_contracts.check_ge_converters(sources, {rms: _ge_rms_norm_rstd_and_gamma_swapped})
    assert sum("IR input 'rstd' is fed from our argument 'gamma'" in p for p in problems) == RMS_NORM_CASES

    rope = torch.ops.npu_fusion.rotary_position_embedding_grad.default
    problems, _ = npu_contracts.check_ge_converters(sources, {rope: _ge_rope_mode_as_float})
    # modes 1-3 as a float attribute; mode 0 is the IR default, left out either way
    assert sum("attribute 'mode' is 'f'" in p for p in problems) == 18
    assert all("RotaryPositionEmbeddingGrad" in p for p in problems)


def test_an_ir_that_differs_from_our_nodes_fails_the_check(torchair, sources):
    """Our (correct) converters against a wheel whose IR were different."""
    changed = dict(sources, ge_ir=dict(sources["ge_ir"]))
    changed["ge_ir"]["RotaryPositionEmbeddingGrad"] = sources["ge_ir"]["RotaryPositionEmbeddingGrad"].replace(
        ".OPTIONAL_INPUT(x,", ".INPUT(x,").replace("ATTR(mode, Int, 0)", "ATTR(mode, Float, 0.0)")
    changed["ge_ir"]["RmsNormGrad"] = sources["ge_ir"]["RmsNormGrad"].replace("OUTPUT(dgamma, TensorType({DT_FLOAT, DT_FLOAT, DT_FLOAT}))", "OUTPUT(dgamma, TensorType({DT_FLOAT16}))")
    problems, _ = npu_contracts.check_ge_converters(changed)
    assert sum("the IR with these arguments wants ['dy', 'cos', 'sin', 'x']" in p for p in problems) == 12
    assert sum("attribute 'mode' is 'i', the IR's type Float" in p for p in problems) == 18
    assert sum("output dgamma declared DT_FLOAT, not in the IR's ['DT_FLOAT16']" in p for p in problems) == 10
