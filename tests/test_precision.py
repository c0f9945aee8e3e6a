"""The pass never rounds more coarsely than the program (``kept_precision`` and
``rounding_problem`` in npu_fusion/patterns/evaluator.py).

Each value a site replaces is judged by its own precision, the program's next rounding of it: a
rounding inside the site at least as fine as that fuses (autocast rounding each term of a bf16
dk), a coarser one stays unfused with its reason (a float32 program rounding its gradient through
bf16 or fp8, whatever dtype other roles are stored in), and the fused op returns through a dtype
at least as fine as that precision. Gradients are checked against float64 (the program run in
float64, its explicit roundings kept) and against eager in ulps of the program's rounding, which
sees a dropped rounding that a float64 reference reading every dtype as float64 would not.
"""
import functools

import pytest
import torch

from npu_fusion_testing.capture import Capture
from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_grads, run_grads, ulps_apart

ROPE, NORM = "rotary_position_embedding_grad", "rms_norm_grad"
BF16, F16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn


def randn(*shape, seed=0, dtype=torch.float32, grad=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return t.requires_grad_(grad)


def rot_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def rope_rounded(q, cos, sin, rounding, tables_rounded):
    """A float32 RoPE whose output is rounded through ``rounding`` and widened back, so the
    backward rounds dy to it inside the site; with ``tables_rounded`` the tables are stored
    in that dtype too (which used to excuse the rounding)."""
    if tables_rounded:
        cos, sin = cos.to(rounding).to(q.dtype), sin.to(rounding).to(q.dtype)
    return (q * cos + rot_half(q) * sin).to(rounding).to(q.dtype)


def rms_norm_rounded(x, w):
    """A float32 RMSNorm with its weight stored in bf16 and its output rounded to bf16."""
    w = w.to(BF16).to(torch.float32)
    y = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    return y.to(BF16).to(torch.float32)


def rms_norm_of_rounded_normalized(x, w):
    """The normalized x rounded to bf16 before the float32 weight multiplies it."""
    normalized = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * normalized.to(BF16).to(torch.float32)


def rope_quantized_product(q, cos, sin):
    """Quantization simulation inside the site: one product rounded to bf16 and widened back."""
    return (q * cos).to(BF16).to(torch.float32) + rot_half(q) * sin


def rope_rounded_rot_half(q, cos, sin):
    return q * cos + rot_half(q).to(BF16).to(torch.float32) * sin


def rms_norm_of_quantized(x, w):
    """Quantization simulation before the site: x rounded to bf16 in a float32 program, fp32
    weight. The rounded x is the norm's input."""
    xq = x.to(BF16).to(torch.float32)
    return w * (xq * torch.rsqrt(xq.pow(2).mean(-1, keepdim=True) + 1e-6))


def rope_of_quantized(q, cos, sin):
    """The same for RoPE, with tables requiring grad: dcos and dsin read the rounded q."""
    qq = q.to(BF16).to(torch.float32)
    return qq * cos + rot_half(qq) * sin


def compile_grads(fn, inputs, **options):
    """The capture, and the compiled, eager and float64 gradients of one backward."""
    capture = Capture(target="generic", **options)
    torch._dynamo.reset()
    got, grad_outputs = run_grads(torch.compile(fn, backend=capture), inputs)
    eager, _ = run_grads(fn, inputs, (), grad_outputs)
    exact = float64_grads(fn, inputs, (), grad_outputs)
    for g, e, x in zip(got, eager, exact):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert_close_as_unfused(g, e, x, factor=MODEL_FACTOR)
    return capture, got, eager


#: program, fused op, and whether dx fuses alone with dgamma left to the program (the rounded dy
#: is then the fused op's dy: dgamma's subgraph reads it too, so the match is found again with it
#: as a leaf, and the rounding stays where the program does it)
ROUNDED_INSIDE = {
    "rope-bf16-tables-float32": (functools.partial(rope_rounded, rounding=BF16, tables_rounded=False), ROPE, False),
    "rope-bf16-tables-bf16": (functools.partial(rope_rounded, rounding=BF16, tables_rounded=True), ROPE, False),
    "rope-fp8-tables-fp8": (functools.partial(rope_rounded, rounding=FP8, tables_rounded=True), ROPE, False),
    "rope-quantized-product": (rope_quantized_product, ROPE, False),
    "rope-rounded-rot-half": (rope_rounded_rot_half, ROPE, False),
    "rms_norm-bf16-weight-bf16": (rms_norm_rounded, NORM, True),
    "rms_norm-rounded-normalized": (rms_norm_of_rounded_normalized, NORM, False),
}


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
@pytest.mark.parametrize("case", list(ROUNDED_INSIDE))
def test_rounding_coarser_than_the_value_stays_unfused(case, partitioner):
    """The float32 program rounds a value inside the site (its gradient, or x) to bf16 or fp8:
    the fused op would not, so the site stays unfused with that reason, also where a table or
    the weight is stored in the narrow dtype; or, for an RMSNorm whose rounded dy its dgamma
    reads too, dx fuses with that rounded dy and dgamma stays the program's. Gradients within
    one float32 ulp of eager either way."""
    fn, op, dx_alone = ROUNDED_INSIDE[case]
    if op == ROPE:
        inputs = [randn(2, 4, 8, 16, grad=True), randn(8, 16, seed=1), randn(8, 16, seed=2)]
    else:
        inputs = [randn(2, 8, 32, grad=True), randn(32, seed=1, grad=True)]
    capture, got, eager = compile_grads(fn, inputs, partitioner=partitioner)
    if dx_alone:
        [site] = [s for r in capture.results for s in r.sites if s.op == op]
        assert set(site.outputs) == {"dx"} and site.note.startswith("dgamma"), site
    else:
        assert capture.fused(op) == 0
        [miss] = [m for m in capture.misses() if m.op == op]
        assert "more coarsely than it keeps" in miss.reason, miss
    for g, e in zip(got, eager):
        assert ulps_apart(g, e, torch.float32) <= 1


@pytest.mark.parametrize("case", ["rope", "rms_norm"])
def test_rounding_before_the_site_fuses_with_it(case):
    """x rounded to bf16 before the site in a float32 program: the backward rounds dx to bf16
    after the site (kept by the rewrite, whose output is cast as the program casts it), and
    what reads x (dcos/dsin, RMSNorm's dx and dgamma) reads the rounded x, which the pass takes
    as its x: fused, every gradient as eager's."""
    if case == "rope":
        fn, op = rope_of_quantized, ROPE
        inputs = [randn(2, 4, 8, 16, grad=True), randn(8, 16, seed=1, grad=True), randn(8, 16, seed=2, grad=True)]
    else:
        fn, op = rms_norm_of_quantized, NORM
        inputs = [randn(2, 8, 32, grad=True), randn(32, seed=1, grad=True)]
    capture, got, eager = compile_grads(fn, inputs)
    assert capture.fused(op) == 1 and capture.misses() == []
    for g, e in zip(got, eager):
        assert ulps_apart(g, e, torch.float32) <= 1


B, HKV, S, D = 2, 2, 16, 16


def autocast_k_rope(k, cos, sin, rep):
    """k's RoPE under autocast: k bf16 (an autocast linear's output), the tables float32, so
    the rotated k is float32; GQA's repeat_kv expands it while still float32 (``rep`` > 1:
    dy is a float32 sum over the copies); autocast casts it to bf16 before attention."""
    e = k * cos + torch.cat((-k[..., D // 2:], k[..., :D // 2]), -1) * sin
    if rep > 1:
        e = e[:, :, None].expand(B, HKV, rep, S, D).reshape(B, HKV * rep, S, D)
    return e.to(BF16)


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
@pytest.mark.parametrize("rep", [1, 2])
def test_autocast_gqa_rope_fuses(rep, partitioner):
    """Autograd rounds ``dy*cos`` and ``dy*sin`` to k's bf16 before summing them: roundings at
    the precision of dk itself. One rounding of the exact dk is at least as accurate, so the
    site fuses (it was refused with repeat_kv's float32 dy)."""
    inputs = [randn(B, HKV, S, D, dtype=BF16, grad=True), randn(1, 1, S, D, seed=1), randn(1, 1, S, D, seed=2)]
    capture, got, eager = compile_grads(functools.partial(autocast_k_rope, rep=rep), inputs,
                                        partitioner=partitioner)
    assert capture.fused(ROPE) == 1 and capture.misses() == []
    # eager rounds two terms and their sum to bf16; the fused op rounds the exact sum once
    assert ulps_apart(got[0], eager[0], BF16) <= 2


def rope_mixed16(q, cos, sin):
    """q rounded through fp16, the tables bf16, the result bf16: dq is computed in float32 and
    rounded once to fp16, by the program as by the rewrite (the fused op must not return it
    through bf16, dy's dtype)."""
    qf = q.half().float()
    return (qf * cos.bfloat16() + rot_half(qf) * sin.bfloat16()).to(BF16)


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_mixed_fp16_bf16_rope_within_one_fp16_ulp(partitioner):
    inputs = [randn(2, 2, 4, 16, grad=True), randn(4, 16, seed=1), randn(4, 16, seed=2)]
    capture, got, eager = compile_grads(rope_mixed16, inputs, partitioner=partitioner)
    assert capture.fused(ROPE) == 1 and capture.misses() == []
    assert ulps_apart(got[0], eager[0], F16, elementwise=True) <= 1
