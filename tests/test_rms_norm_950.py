"""RMSNorm on Ascend 950PR/950DT: the public CANN operator sources document RmsNorm and RmsNormGrad
for it with A2/A3's dtype table, so target ``950`` fuses a Llama-style norm forward and backward
(outputs and gradients by the float64 criterion); its own shape limits refuse the near misses, each
a recorded miss whose reason names the operand and the limit."""
import pytest
import torch

from npu_fusion.lowering import RMS_NORM, RMS_NORM_GRAD
from npu_fusion.lowering.ops.rms_norm_grad import RMS_NORM_DTYPES, rms_norm_target_problem

from test_forward_fusion import BACKWARD, FORWARD, ON, _compile, _weight, assert_paired, calls, check, hf_llama

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llama_norm_fused_forward_and_backward_on_950(dtype):
    """LlamaRMSNorm through the backend with target 950: one RmsNorm, one RmsNormGrad reading its
    saved rstd, no miss; outputs and gradients as close to float64 as eager's."""
    w = _weight(dtype, 64)
    x = torch.randn(2, 8, 64, dtype=dtype, requires_grad=True)
    result, fw, bw = check(lambda t: hf_llama(t, w), [x], [w], target="950", **ON)
    assert result.fused(FORWARD) == 1 and result.fused(BACKWARD) == 1 and not result.misses, result.misses
    assert_paired(fw, bw, 1)


@pytest.mark.parametrize("target", ["950", "common"])
def test_gamma_in_float32_beside_bf16_x_on_950(target):
    """The 950's table has gamma float32 beside a bfloat16 x, as A2/A3's: a float32 weight fuses
    (``common`` keeps every chip's limits and the dtype table they share)."""
    w = _weight(torch.float32, 32)
    x = torch.randn(3, 32, dtype=torch.bfloat16, requires_grad=True)
    norm = (lambda t: w * (t.float() * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-6)))
    result, fw, bw = check(norm, [x], [w], target=target, **ON)
    assert result.fused(FORWARD) == 1 and result.fused(BACKWARD) == 1 and not result.misses, result.misses


@pytest.mark.parametrize("target", ["950", "common"])
def test_empty_batch_backward_fused_forward_refused_on_950(target):
    """An empty batch: the 950's RmsNormGrad takes empty leading axes (empty dx, zero dgamma), its
    RmsNorm takes no empty x. The forward is one recorded miss naming x and the limit; the
    backward fuses; outputs and gradients are eager's (empty, and a zero weight gradient)."""
    w = _weight(torch.float32, 16)
    x = torch.randn(0, 16, requires_grad=True)
    compiled, seen = _compile(lambda t: hf_llama(t, w), dict(target=target, **ON))
    got = compiled(x)
    grads = torch.autograd.grad(got.sum(), [x, w])
    eager = hf_llama(x, w)
    expected = torch.autograd.grad(eager.sum(), [x, w])
    for g, e in zip((got, *grads), (eager, *expected)):
        assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e)
    result = seen["result"]
    assert result.fused(BACKWARD) == 1 and result.fused(FORWARD) == 0
    [miss] = result.misses
    assert miss.op == FORWARD and miss.reason.startswith("x shape [0, 16] has an empty axis: RmsNorm on Ascend 950")
    assert calls(seen["bw"].graph, BACKWARD) and not calls(seen["fw"].graph, FORWARD)


@pytest.mark.parametrize("target", ["950", "common"])
def test_float64_norm_refused_on_950_with_the_table(target):
    """float64 is in no row of the 950's table: one judgement for the site, so the backward and the
    forward are recorded misses naming the dtypes (each op's own table: the same rows)."""
    w = _weight(torch.float64, 16)
    x = torch.randn(2, 16, dtype=torch.float64, requires_grad=True)
    result, _, _ = check(lambda t: hf_llama(t, w), [x], [w], target=target, **ON)
    assert result.fused(FORWARD) == result.fused(BACKWARD) == 0
    backward, forward = sorted(result.misses, key=lambda m: m.op != BACKWARD)
    assert (backward.op, forward.op) == (BACKWARD, FORWARD)
    assert "dtype combination dy/x=torch.float64, gamma=torch.float64" in backward.reason
    assert "dtype combination dy/x=torch.float64, gamma=torch.float64" in forward.reason


@pytest.mark.parametrize("target", ["950", "common"])
@pytest.mark.parametrize("dtype, gamma_dtype", sorted(RMS_NORM_DTYPES, key=str), ids=str)
def test_the_950_table_both_ways(target, dtype, gamma_dtype):
    """Every row of the 950's table runs forward and backward on a [B, S, H] x."""
    x_shape = (2, 8, 64)
    for ge_op in ("RmsNorm", "RmsNormGrad"):
        assert rms_norm_target_problem(target, dtype, gamma_dtype, x_shape, 1, ge_op=ge_op) is None


@pytest.mark.parametrize("target", ["950", "common"])
def test_the_950_shape_limits_name_the_operand(target):
    """The 950's shape limits, each reason naming the operand and the limit; A2/A3 keep theirs."""
    def problem(op, x_shape, k):
        return rms_norm_target_problem(target, torch.float32, torch.float32, x_shape, k, ge_op=op)

    # an empty normalized axis: neither op
    for op in ("RmsNorm", "RmsNormGrad"):
        assert problem(op, (2, 0), 1).startswith("gamma shape [0] has an empty axis")
        assert f"{op} on Ascend 950" in problem(op, (2, 0), 1)
    # an empty leading axis: the backward takes it (empty dx, zero dgamma), the forward not
    assert problem("RmsNorm", (0, 8), 1).startswith("x shape [0, 8] has an empty axis")
    assert problem("RmsNormGrad", (0, 8), 1) is None
    # no leading axis: the forward takes it, the backward not
    assert problem("RmsNorm", (8,), 1) is None and problem("RmsNorm", (4, 8), 2) is None
    assert "needs at least one leading axis" in problem("RmsNormGrad", (8,), 1)
    assert "needs at least one leading axis" in problem("RmsNormGrad", (4, 8), 2)
    for chip in ("a2", "a3", "generic"):
        assert rms_norm_target_problem(chip, torch.float32, torch.float32, (8,), 1) is None


def test_symbolic_sizes_count_as_positive_on_950():
    """Under dynamic shapes Dynamo's sizes are at least 2: a symbolic batch or hidden size is
    provably not empty, so the 950 fuses it (an unbacked size, which could be 0, would not)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    b, h = (env.create_symintnode(env.create_symbol(hint, source=ConstantSource(name)), hint=hint)
            for name, hint in (("b", 3), ("h", 64)))
    for op in ("RmsNorm", "RmsNormGrad"):
        assert rms_norm_target_problem("950", torch.bfloat16, torch.float32, (b, 5, h), 1, ge_op=op) is None
    unbacked = env.create_unbacked_symint()
    assert "may have an empty axis" in rms_norm_target_problem("950", torch.bfloat16, torch.float32,
                                                               (unbacked, 64), 1, ge_op="RmsNorm")


def test_declared_ops_agree_with_the_limits_on_950():
    """The ops' ``target_problem`` (what the conformance tests read) is the
    limit function on their inputs' shapes."""
    x, gamma = torch.empty(4, 16, device="meta"), torch.empty(4, 16, device="meta")
    rstd = torch.empty(1, 1, device="meta")
    assert RMS_NORM.target_problem("950", x, gamma, 1e-6) is None
    assert "leading axis" in RMS_NORM_GRAD.target_problem("950", x, x, rstd, gamma)
    assert RMS_NORM_GRAD.target_problem("a2", x, x, rstd, gamma) is None
