"""The fused ops' facts (docs/fused-ops.md) are stated once, in each op's module (``lowering/ops/``;
RoPE's in ``rope_grad.py``, RMSNorm's in ``rms_norm_grad.py``, read by the forward ops too), and read
by the op's input checks,
the per-target limits the pass fuses under, and the GE converters' declared supported shapes;
these tests hold the three to each other, for the backward and the forward ops."""
import pytest
import torch
from hypothesis import assume, given, strategies as st

import npu_fusion  # noqa: F401  (registers the fused ops)
from npu_fusion.lowering import FUSED_OPS, RMS_NORM, RMS_NORM_GRAD, ROPE, ROPE_GRAD
from npu_fusion.lowering.checks import TARGETS, FusedOpInputError
from npu_fusion.lowering.ops.rms_norm_grad import RMS_NORM_DTYPES, rms_norm_supported_cases, rms_norm_target_problem
from npu_fusion.lowering.ops.rope_grad import ROPE_MODES, rope_divisor, rope_supported_cases, rope_target_problem
from npu_fusion.plugin.options import FusionOptions


def rope_inputs(dt, dy, cos, with_x):
    dy_t, cos_t = torch.empty(dy, dtype=dt, device="meta"), torch.empty(cos, dtype=dt, device="meta")
    return dy_t, cos_t, cos_t, dy_t if with_x else None


@pytest.mark.parametrize("case", rope_supported_cases(), ids=str)
def test_declared_rope_cases_are_valid_on_some_target(case):
    dt, dy, cos, with_x, mode = case
    ROPE_GRAD.check_inputs(*rope_inputs(dt, dy, cos, with_x), mode)
    assert any(rope_target_problem(t, mode, dy, cos, with_x, dt) is None for t in ("a2", "a3", "950"))


@pytest.mark.parametrize("case", rms_norm_supported_cases(), ids=str)
def test_declared_rms_norm_cases_are_valid_on_some_target(case):
    dy_dtype, gamma_dtype, x, rstd, gamma = case
    x_t = torch.empty(x, dtype=dy_dtype, device="meta")
    RMS_NORM_GRAD.check_inputs(x_t, x_t, torch.empty(rstd, device="meta"),
                               torch.empty(gamma, dtype=gamma_dtype, device="meta"))
    assert all(rms_norm_target_problem(t, dy_dtype, gamma_dtype, x, len(gamma)) is None for t in ("a2", "a3", "950"))


LAYOUT_SIZES = st.sampled_from([1, 2, 3, 16, 999, 1000, 1025])


def _meta(shape, dt):
    return torch.empty(shape, dtype=dt, device="meta")


@pytest.mark.parametrize("forward", [False, True], ids=["backward", "forward"])
@given(mode=st.sampled_from(sorted(ROPE_MODES)), target=st.sampled_from(("a2", "a3", "950")),
       dy=st.tuples(LAYOUT_SIZES, LAYOUT_SIZES, LAYOUT_SIZES, st.sampled_from([2, 4, 6, 64, 894, 896, 1024, 1026])),
       broadcast=st.tuples(st.booleans(), st.booleans(), st.booleans()), with_x=st.booleans(),
       dt=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
def test_no_target_accepts_what_the_op_refuses(forward, mode, target, dy, broadcast, with_x, dt):
    """A site a chip's limits accept passes the op's own input checks (the matcher proves the
    mode, so D divides as the mode splits it), and what A2/A3 accept, Ascend 950 accepts; for
    RoPE's backward and its forward alike."""
    assume(dy[3] % rope_divisor(mode) == 0)
    cos = tuple(1 if b else s for s, b in zip(dy[:3], broadcast)) + dy[3:]
    op = ROPE if forward else ROPE_GRAD
    args = ((_meta(dy, dt), _meta(cos, dt), _meta(cos, dt), mode) if forward
            else (*rope_inputs(dt, dy, cos, with_x), mode))
    if op.target_problem(target, *args) is not None:
        return
    op.check_inputs(*args)
    assert op.target_problem("950", *args) is None


@pytest.mark.parametrize("dtypes", [(a, b) for a in (torch.float16, torch.bfloat16, torch.float32)
                                    for b in (torch.float16, torch.bfloat16, torch.float32)], ids=str)
def test_rms_norm_targets_accept_only_spec_dtypes(dtypes):
    x = torch.empty(2, 8, dtype=dtypes[0], device="meta")
    gamma = torch.empty(8, dtype=dtypes[1], device="meta")
    rstd = torch.empty(2, 1, device="meta")
    for target in TARGETS:
        backward = rms_norm_target_problem(target, *dtypes, (2, 8), 1)
        assert RMS_NORM_GRAD.target_problem(target, x, x, rstd, gamma) == backward
        assert (RMS_NORM.target_problem(target, x, gamma, 1e-6) is None) == (backward is None)
        if backward is None:
            assert dtypes in RMS_NORM_DTYPES
    if dtypes not in RMS_NORM_DTYPES:
        with pytest.raises(FusedOpInputError, match="unsupported dtype combination"):
            RMS_NORM_GRAD.check_inputs(x, x, rstd, gamma)
        with pytest.raises(FusedOpInputError, match="unsupported dtype combination"):
            RMS_NORM.check_inputs(x, gamma, 1e-6)


def test_every_fused_op_has_an_option_and_a_schema():
    names = {f for f in FusionOptions.__dataclass_fields__}
    for op in FUSED_OPS:
        assert op.option in names
        assert len(op.overload._schema.returns) == len(op.outputs)
