"""Forward RMSNorm fused on the joint graph (issue 24): ``npu_fusion.rms_norm`` replaces the
decomposed forward, its rstd feeds the fused backward, outputs and gradients are checked against
eager by the float64 criterion, near misses stay as they are, and the saved set is no larger
than with the backward alone."""
import copy

import pytest
import torch
import torch.nn.functional as F

from npu_fusion.models import bundled
from npu_fusion.plugin.backend import aot_backend
from npu_fusion.plugin.options import FusionOptions, forward_options
from npu_fusion.measure.grads import (MODEL_FACTOR, assert_close_as_unfused, float64_grads, float64_output, grad_failures,
                                      run_grads)

FORWARD, BACKWARD = "rms_norm", "rms_norm_grad"
ON = {"rms_norm_forward": True}
EPS = 1e-6


def _compile(fn, options):
    """``fn`` compiled by the ``npu_fusion`` backend with ``options``; ``seen`` gets the pass's
    result and the partition (forward and backward graph modules) once it has run."""
    seen = {}

    def around(gm, run):
        seen["result"] = run()
        run.after_partition.append(lambda fw, bw: seen.update(fw=fw, bw=bw))

    torch._dynamo.reset()
    options = FusionOptions.from_mapping(dict({"strict": True, "target": "generic"}, **options))
    return torch.compile(fn, backend=aot_backend(options, around)), seen


def check(fn, inputs, params=(), **options):
    """Compile ``fn`` with the pass; its output and every gradient pass the float64 criterion
    against eager. Returns (the pass's result, forward graph, backward graph)."""
    compiled, seen = _compile(fn, options)
    with torch.no_grad():
        eager, exact = fn(*inputs), float64_output(fn, inputs, params)
    got = compiled(*inputs)
    assert got.dtype == eager.dtype and got.shape == eager.shape
    assert_close_as_unfused(got.detach(), eager, exact, factor=MODEL_FACTOR)
    check_gradients(compiled, fn, inputs, params)
    return seen["result"], seen["fw"].graph, seen["bw"].graph


def check_gradients(compiled, fn, inputs, params=()):
    """Every gradient of ``compiled`` has eager's dtype and shape and passes the float64 criterion."""
    fused_grads, grad_outputs = run_grads(compiled, inputs, params)
    eager_grads, _ = run_grads(fn, inputs, params, grad_outputs)
    for f, e, x in zip(fused_grads, eager_grads, float64_grads(fn, inputs, params, grad_outputs)):
        assert f.dtype == e.dtype and f.shape == e.shape
        assert_close_as_unfused(f, e, x, factor=MODEL_FACTOR)


def calls(graph, name):
    return [n for n in graph.nodes
            if n.op == "call_function" and getattr(n.target, "__name__", "").split(".")[0] == name]


def _through_casts(node):
    while node.op == "call_function" and node.target in (torch.ops.aten._to_copy.default, torch.ops.aten.view.default,
                                                          torch.ops.prims.convert_element_type.default):
        node = node.args[0]
    return node


def assert_paired(fw, bw, sites, through=_through_casts):
    """``sites`` fused forward ops, no decomposed statistic left in the forward, and each fused
    backward reads a fused forward op's rstd (saved by the partition, not recomputed), read
    ``through`` the nodes that keep its value (casts and views; a statistic taken with
    ``keepdim=False`` is read through the program's unsqueeze too)."""
    forward_ops = calls(fw, FORWARD)
    assert len(forward_ops) == sites and not calls(fw, "rsqrt") and not calls(fw, "mean")
    by_name = {n.name: n for n in fw.nodes}
    backward_ops = calls(bw, BACKWARD)
    assert len(backward_ops) == sites and not calls(bw, "rsqrt")
    for op in backward_ops:
        rstd = through(op.args[2])
        assert rstd.op == "placeholder", rstd  # saved, not recomputed
        source = through(by_name[rstd.name])
        assert source.target.__name__ == "getitem" and source.args[0] in forward_ops and source.args[1] == 1


# -- the spellings -------------------------------------------------------------------

def _weight(dtype, d=16):
    return torch.nn.Parameter(torch.randn(d, generator=torch.Generator().manual_seed(3)).to(dtype))


def hf_llama(x, w):  # LlamaRMSNorm: statistics in float32, the weight after the cast back
    x32 = x.to(torch.float32)
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def gemma(x, w):
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (out * (1.0 + w.float())).type_as(x)


def t5(x, w):
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + EPS)
    if w.dtype in (torch.float16, torch.bfloat16):
        x = x.to(w.dtype)
    return w * x


def per_head(x, w):  # Qwen3's q/k norm: [B, S, H, D] normalized over D
    return F.rms_norm(x.view(2, 3, 2, 8), (8,), w[:8], EPS).view(2, 3, 16)


def gated(x, w):  # Qwen3-Next: norm(x) * silu(gate)
    return F.rms_norm(x, (16,), w, EPS) * F.silu(x.flip(-1))


def sandwich(x, w):  # Gemma 2's post-norm: the second norm's x is the first norm's output
    return F.rms_norm(torch.tanh(F.rms_norm(x, (16,), w, EPS)), (16,), w.flip(0), EPS)


def cast_for_each_consumer(x, w):  # autocast's copy of y per projection: casts of y, not y
    y = F.rms_norm(x, (16,), w, EPS)
    return y.to(torch.float16).float() + y.to(torch.bfloat16).float() * 2


NORMALIZER = torch.tensor(4.0)  # Gemma's embedding scale: a 0-d tensor, constant along the normalized axis


def scaled_residual(x, w):  # Gemma's second norm: x = embedding * normalizer + attention_output
    return F.rms_norm(x * NORMALIZER.to(x.dtype) + torch.tanh(x), (16,), w, EPS)


def post_norm_residual(x, w):  # OLMo 2's final norm: x = residual + post_norm(mlp(residual))
    return F.rms_norm(x + F.rms_norm(torch.tanh(x), (16,), w.flip(0), EPS), (16,), w, EPS)


def hyper_connection(x, w):  # DeepSeek-V4, HY-V4: the streams collapsed by a weighted sum over an axis
    streams = torch.stack((x, torch.tanh(x)), -2)
    mix = torch.softmax(streams[..., 0], -1)
    return F.rms_norm((streams * mix[..., None]).sum(-2), (16,), w, EPS)


def multiplier_of_one_per_reader(x, w):  # Falcon-H1: y * attention_in_multiplier, y * ssm_in_multiplier
    y = F.rms_norm(x, (16,), w, EPS)
    return torch.tanh(y * 1.0) + (y / 1.0) * 2  # both equal y by value: they read y, they are not y


def weightless(x, _w):
    return F.rms_norm(x, (16,), eps=EPS)


SPELLINGS = {  # name: (function, fused sites)
    "hf_llama": (hf_llama, 1),
    "nn_rms_norm": (lambda x, w: F.rms_norm(x, (16,), w, EPS), 1),
    "gemma": (gemma, 1), "t5": (t5, 1), "per_head": (per_head, 1), "gated": (gated, 1),
    "sandwich": (sandwich, 2), "weightless": (weightless, 1), "cast_for_each_consumer": (cast_for_each_consumer, 1),
    "scaled_residual": (scaled_residual, 1), "post_norm_residual": (post_norm_residual, 2),
    "multiplier_of_one_per_reader": (multiplier_of_one_per_reader, 1), "hyper_connection": (hyper_connection, 1),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_spelling_fuses_forward_paired_with_backward(spelling, dtype):
    fn, sites = SPELLINGS[spelling]
    w = _weight(dtype)
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    result, fw, bw = check(lambda x: fn(x, w), [x], [w] if fn is not weightless else [], **ON)
    assert not result.misses, result.misses
    assert result.fused(FORWARD) == sites and result.fused(BACKWARD) == sites
    assert_paired(fw, bw, sites)


@pytest.mark.smoke  # in the version matrix's smoke set: the forward kept with its decomposed backward
def test_forward_stays_unfused_while_its_backward_is_decomposed():
    """With the backward rule off, the forward's statistic is read by the decomposed backward:
    the forward is left as it is, a recorded miss saying why."""
    w = _weight(torch.bfloat16)
    x = torch.randn(2, 3, 16).to(torch.bfloat16).requires_grad_()
    result, fw, _ = check(lambda x: F.rms_norm(x, (16,), w, EPS), [x], [w], rms_norm=False, **ON)
    assert not result.sites and not calls(fw, FORWARD) and calls(fw, "rsqrt")
    assert [m.op for m in result.misses] == [FORWARD] and "backward" in result.misses[0].reason


def test_autocast_norm_fuses_its_normalized_value():
    """A bf16 input's normalized value rounded to bf16 before a float32 weight (autocast; Qwen3's
    q/k norms): the fused op cannot take the weight (y would skip the program's bf16 rounding),
    so it computes the normalized value with a weight of ones, rounded once to bf16 as the program
    rounds it; the weight multiply and the dgamma the backward leaves to the program read it."""
    w = _weight(torch.float32)
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_()
    result, fw, bw = check(lambda x: hf_llama(x, w), [x], [w], **ON)
    assert not result.misses, result.misses
    assert result.fused(FORWARD) == result.fused(BACKWARD) == 1
    assert "dgamma" in next(s.note for s in result.sites if s.op == BACKWARD)
    assert_paired(fw, bw, 1)
    (op,) = calls(fw, FORWARD)
    assert op.args[1].target is torch.ops.aten.full.default  # the weight of ones
    assert any(n.target is torch.ops.aten.mul.Tensor for n in fw.nodes if n.op == "call_function")


def test_norm_whose_dgamma_is_left_to_the_program_fuses_its_forward():
    """torchtitan's Qwen3 q/k norms in bf16: y cast to float32 (for RoPE), so the float32 gradient's
    dgamma is left to the program, which reads the float32 normalized value ``x32 * rstd``. Paired
    with its fused backward, the forward fuses; ``x32 * rstd`` stays, computed from the fused op's
    rstd, for that dgamma (it was a miss: "a decomposed backward node reads the forward's
    statistic"). The saved set is no larger than with the backward alone."""
    w = _weight(torch.bfloat16)
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_()

    def to_float(x):
        return torch.tanh(F.rms_norm(x, (16,), w, EPS).float())
    result, fw, bw = check(to_float, [x], [w], **ON)
    assert not result.misses, result.misses
    assert result.fused(FORWARD) == result.fused(BACKWARD) == 1
    assert "dgamma" in next(s.note for s in result.sites if s.op == BACKWARD)
    assert_paired(fw, bw, 1)
    (op,) = calls(fw, FORWARD)
    rstd = next(u for u in op.users if u.args[1] == 1)
    assert [u.target for u in rstd.users if u.op == "call_function"] == [torch.ops.aten.mul.Tensor]
    backward_only, _, _ = check(to_float, [x], [w], rms_norm_forward=False, rope_forward=False)
    assert backward_only.fused(BACKWARD) == 1 and not backward_only.fused(FORWARD)
    assert result.saved.bytes <= backward_only.saved.bytes, (result.saved, backward_only.saved)


def test_norm_of_an_input_without_gradient_keeps_its_forward():
    """A norm whose input takes no gradient: its fused dgamma-only backward reads the saved
    normalized value, an intermediate of the forward, which therefore stays (a recorded miss)."""
    w = _weight(torch.float32)
    h = torch.randn(2, 3, 16)
    result, fw, _ = check(lambda h: F.rms_norm(h, (16,), w, EPS) * 2, [h], [w], **ON)
    assert result.fused(BACKWARD) == 1 and not result.fused(FORWARD) and calls(fw, "rsqrt")
    (miss,) = result.misses
    assert miss.op == FORWARD and "has a user outside the norm" in miss.reason


def test_norm_feeding_a_router_fuses():
    """A MoE router's ``topk`` near the norm's output has a tuple for its value (GraniteMoE, GPT-OSS):
    no output of the norm, and no internal error (it was, and left the forward unfused)."""
    w = _weight(torch.float32)
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(5), requires_grad=True)

    def routed(x):
        y = F.rms_norm(x, (16,), w, EPS)
        _, experts = torch.topk(y, 2, dim=-1)  # the tuple-valued node, two uses from rstd
        return y * (experts.sum(-1, keepdim=True) % 2 + 1).to(y.dtype)
    result, fw, bw = check(routed, [x], [w], **ON)
    assert not result.misses, result.misses
    assert result.fused(FORWARD) == 1 and result.fused(BACKWARD) == 1
    assert_paired(fw, bw, 1)


def test_options_off_leave_the_forward_decomposed():
    w = _weight(torch.float32)
    x = torch.randn(2, 3, 16, requires_grad=True)
    result, fw, _ = check(lambda x: F.rms_norm(x, (16,), w, EPS), [x], [w], rms_norm_forward=False)
    assert result.fused(BACKWARD) == 1 and not result.fused(FORWARD) and calls(fw, "rsqrt")


# -- near misses: a norm of a tensor that takes no gradient (its forward alone is the site) ----

def _frozen(dtype):
    return _weight(dtype).requires_grad_(False)


NEAR_MISSES = {  # name: (the norm of h, the miss's reason or None when the site is no RMSNorm at all)
    "eps_outside_the_root": (lambda h, w: h * (torch.rsqrt(h.pow(2).mean(-1, keepdim=True)) + EPS) * w,
                             "but eps is added outside the root (rsqrt(mean(x*x)) + eps)"),
    "another_tensor_normalized": (lambda h, w: h.flip(-1) * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w,
                                  "no node near it is rstd * x * gamma"),
    # a statistic over another axis: the backward rule reads it as an RMS statistic, the forward records it too
    "mean_over_the_wrong_axis": (lambda h, w: h * torch.rsqrt(h.pow(2).mean(1, keepdim=True) + EPS) * w,
                                 "not its last axes"),
    "normalized_value_rounded_to_bf16": (
        lambda h, w: w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).bfloat16().float(),
        "rounds a value inside the site to torch.bfloat16"),
    "statistic_of_a_bf16_copy": (
        lambda h, w: h * torch.rsqrt(h.bfloat16().float().pow(2).mean(-1, keepdim=True) + EPS) * w,
        "rounds a value inside the site to torch.bfloat16"),
}


def test_forward_of_a_norm_without_backward_fuses():
    """The harness of the near misses: the same program with a true RMSNorm fuses its forward."""
    w, h = _frozen(torch.float32), torch.randn(2, 3, 16)
    x = torch.randn(2, 3, 16, requires_grad=True)
    result, fw, _ = check(lambda x: x * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w), [x], **ON)
    assert result.fused(FORWARD) == 1 and not result.misses and not calls(fw, "rsqrt")


@pytest.mark.parametrize("near_miss", NEAR_MISSES)
def test_near_miss_is_not_rewritten(near_miss):
    norm, reason = NEAR_MISSES[near_miss]
    w, h = _frozen(torch.float32), torch.randn(2, 3, 16)
    x = torch.randn(2, 3, 16, requires_grad=True)
    result, fw, _ = check(lambda x: x * norm(h, w), [x], **ON)
    assert not result.sites and not calls(fw, FORWARD)
    if reason is None:
        assert not result.misses
    else:
        assert [m.op for m in result.misses] == [FORWARD] and reason in result.misses[0].reason, result.misses


# -- models ----------------------------------------------------------------------------

def _model_step(model, ids, **options):
    """One compiled training step; returns (gradients by name, the pass's result, forward graph,
    backward graph)."""
    compiled, seen = _compile(model.loss, options)
    model.zero_grad(set_to_none=True)
    compiled(ids).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, seen["result"], seen["fw"].graph, seen["bw"].graph


def _eager_and_exact(model, ids, name="llama"):
    model.zero_grad(set_to_none=True)
    model.loss(ids).backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    wide = bundled(name, num_layers=1, dtype=torch.float64, checkpoint=model.config.checkpoint)
    wide.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    wide.loss(ids).backward()
    return eager, {n: p.grad for n, p in wide.named_parameters()}


@pytest.mark.parametrize("dtype,partitioner,checkpoint", [
    (torch.bfloat16, "default", "none"), (torch.float32, "min_cut", "selective")])
def test_bundled_llama_forward_and_backward_fused_together(dtype, partitioner, checkpoint):
    """Every norm's forward and backward fused (activation checkpointing recomputes the fused
    forward op); the saved set no larger than with the backward alone."""
    model = bundled("llama", num_layers=1, dtype=dtype, checkpoint=checkpoint)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    sites = model.expected_sites[BACKWARD]
    grads, result, fw, bw = _model_step(model, ids, partitioner=partitioner, **ON)
    eager, exact = _eager_and_exact(model, ids)
    assert not grad_failures(grads, eager, exact)
    assert result.fused(FORWARD) == sites and result.fused(BACKWARD) == sites and not result.misses
    assert len(calls(fw, FORWARD)) == sites and not calls(fw, "rsqrt")
    if checkpoint == "none":  # checkpointing recomputes the forward op in the backward instead of saving rstd
        assert_paired(fw, bw, sites)
    _, backward_only, _, _ = _model_step(model, ids, partitioner=partitioner)
    assert result.saved.bytes <= backward_only.saved.bytes, (result.saved, backward_only.saved)


def test_transformers_qwen3_forward_and_backward_fused_together():
    """transformers' Qwen3 in bf16 (HF norms with their casts, per-head q/k norms, RoPE on q and k
    transposed to BNSD): every norm's and rotation's forward and backward fused, gradients within
    the criterion."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "qwen3", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))

    def step(run):
        model.zero_grad(set_to_none=True)
        run(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager = step(model)
    wide = copy.deepcopy(model).double()
    wide(input_ids=ids, labels=ids).loss.backward()
    exact = {n: p.grad for n, p in wide.named_parameters() if p.grad is not None}
    compiled, seen = _compile(model, dict.fromkeys(forward_options(), True))
    fused = step(compiled)  # the rotation's x is a transposed view: the fused output is contiguous
    assert not grad_failures(fused, eager, exact)
    result = seen["result"]
    assert result.fused(FORWARD) == result.fused(BACKWARD) == 5 and not result.misses, result.misses
    assert result.fused("rotary_position_embedding") == result.fused("rotary_position_embedding_grad") == 2
    assert_paired(seen["fw"].graph, seen["bw"].graph, 5)


# -- forward RoPE ------------------------------------------------------------------------

ROPE, ROPE_GRAD = "rotary_position_embedding", "rotary_position_embedding_grad"
BOTH = dict.fromkeys(forward_options(), True)  # the forward rules' switches


@pytest.mark.smoke  # in the version matrix's smoke set: the forward fused in each RoPE mode
@pytest.mark.parametrize("name,dtype", [
    ("llama", torch.bfloat16), ("gptj", torch.float32), ("deepseek", torch.bfloat16)])
def test_bundled_models_fuse_every_forward_and_backward(name, dtype):
    """Half, interleave and interleave-half RoPE (modes 0, 1, 3) and every RMSNorm fused forward and
    backward; no decomposed rotation or statistic left in the forward."""
    model = bundled(name, num_layers=1, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    grads, result, fw, _ = _model_step(model, ids, **BOTH)
    eager, exact = _eager_and_exact(model, ids, name)
    assert not grad_failures(grads, eager, exact)
    assert not result.misses, result.misses
    for op in (FORWARD, BACKWARD):
        assert result.fused(op) == model.expected_sites[BACKWARD]
    for op in (ROPE, ROPE_GRAD):
        assert result.fused(op) == model.expected_sites[ROPE_GRAD]
    assert len(calls(fw, ROPE)) == model.expected_sites[ROPE_GRAD]
    assert not calls(fw, "neg") and not calls(fw, "rsqrt")  # rotate's negation, the statistic


def partial_rotary(q, cos, sin):  # GPT-NeoX rotary_pct: the first 8 of 16 lanes rotate
    rot, rest = q[..., :8], q[..., 8:]
    x1, x2 = rot[..., :4], rot[..., 4:]
    return torch.cat((rot * cos + torch.cat((-x2, x1), -1) * sin, rest), -1)


def nanochat(q, cos, sin):  # cat(x2, -x1): mode 0 with sin negated
    x1, x2 = q[..., :8], q[..., 8:]
    return q * cos + torch.cat((x2, -x1), -1) * sin


def wrong_split(q, cos, sin):  # rotates by a quarter of the lanes: no mode
    return q * cos + torch.cat((-q[..., 12:], q[..., :12]), -1) * sin


@pytest.mark.parametrize("fn,fused", [(partial_rotary, 1), (nanochat, 1), (wrong_split, 0)])
def test_rope_forward_spellings_and_a_near_miss(fn, fused):
    q = torch.randn(2, 4, 6, 16, requires_grad=True)
    width = 8 if fn is partial_rotary else 16
    angles = torch.randn(6, width, generator=torch.Generator().manual_seed(2))
    cos, sin = angles.cos(), angles.sin()
    result, fw, _ = check(lambda q: fn(q, cos, sin) * 2, [q], **BOTH)
    assert result.fused(ROPE) == fused == result.fused(ROPE_GRAD) and len(calls(fw, ROPE)) == fused
    if not fused:
        assert [m.op for m in result.misses if m.op == ROPE] == [ROPE], result.misses
        assert "no mode's formula" in next(m.reason for m in result.misses if m.op == ROPE)


def _rotate_half(t):
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return torch.cat((-x2, x1), -1)


def phi3(p, cos, sin):  # partial_rotary_factor 1: the pass-through q[..., D:] is empty
    q = p.transpose(1, 2)
    rot, rest = q[..., :16], q[..., 16:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], -1)


QKV = torch.nn.Parameter(torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) / 8)


def megatron_gpt(p, cos, sin, rotated_half_of=None):
    """Megatron's GQA attention: one projection viewed per group and split into q, k and v,
    q reshaped to its heads; the rotation ``cat((t * cos + rotate_half(t) * sin, t[..., D:]))``."""
    mixed = (p @ QKV).view(6, 2, 2, 64)
    q, k, v = torch.split(mixed, [32, 16, 16], dim=3)
    q = q.reshape(6, 2, 4, 16)
    other = {"q": q[:, :, 2:]}  # as many heads as k

    def rotate(t, name):
        half = _rotate_half(t) if rotated_half_of in (None, name) else _rotate_half(other[rotated_half_of])
        return torch.cat((t * cos + half * sin, t[..., 16:]), -1)

    return torch.cat([rotate(q, "q").view(6, 2, 2, 32), rotate(k, "k") * v], -1)


@pytest.mark.parametrize("name", ["phi3", "megatron_gpt", "megatron_rotated_half_of_another_tensor"])
def test_rope_forward_whole_head_pass_through_and_split_projection(name):
    """An empty pass-through (Phi-3, Megatron at a whole-head rotation) is no foreign read; x a
    view of one split of a projection viewed per group (Megatron's q/k/v) is read as a leaf
    there, so both rotations fuse. The same program with k's rotate_half reading two of q's heads
    (no rotation) keeps that product as it is."""
    angles = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    if name == "phi3":
        fn, p, params, cos, sin = phi3, torch.randn(2, 6, 4, 16, requires_grad=True), [], angles.cos(), angles.sin()
        fused = 1
    else:
        p, params = torch.randn(6, 2, 64, requires_grad=True), [QKV]
        cos, sin = angles.cos()[:, None, None], angles.sin()[:, None, None]
        fn = megatron_gpt if name == "megatron_gpt" else (lambda p, c, s: megatron_gpt(p, c, s, "q"))
        fused = 2 if name == "megatron_gpt" else 1
    result, fw, _ = check(lambda p: fn(p, cos, sin) * 2, [p], params, **BOTH)
    assert result.fused(ROPE) == len(calls(fw, ROPE)) == fused, (result.sites, result.misses)
    # k times q's rotated heads is no rotation (two tensors), so no forward miss either
    assert not [m for m in result.misses if m.op == ROPE], result.misses


def test_rope_forward_read_by_two_attentions_fuses_the_rotation_not_its_copies():
    """DiffLlama: a transposed q rotated, then read by two matmuls, each copying it contiguous
    (expand and clone). Each copy is a rotation too, but only the rotation fuses; the copies read
    the fused op's output, and no miss is recorded for them."""
    angles = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    cos, sin = angles.cos(), angles.sin()
    keys = torch.randn(2, 2, 4, 16, 6, generator=torch.Generator().manual_seed(4))

    def two_attentions(p):
        q = p.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        return torch.matmul(q, keys[0].to(q.dtype)) + torch.matmul(q, keys[1].to(q.dtype)).exp()

    p = torch.randn(2, 6, 4, 16, requires_grad=True)
    result, fw, _ = check(two_attentions, [p], **BOTH)
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == len(calls(fw, ROPE)) == 1, (result.sites, result.misses)
    assert not result.misses, result.misses


ROPE_CACHE = torch.stack([torch.randn(12, 8, generator=torch.Generator().manual_seed(2)).cos(),
                          torch.randn(12, 8, generator=torch.Generator().manual_seed(2)).sin()], -1)


def torchtune(x, cache=ROPE_CACHE, second_cos=None):
    """torchtune's RotaryPositionalEmbeddings: x as pairs, ``rope_cache[..., 0]`` (cos) and
    ``[..., 1]`` (sin) each selected once per term, stacked and flattened."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    rc = cache[:6].view(-1, pairs.size(1), 1, pairs.size(3), 2).to(pairs.dtype)
    other = rc if second_cos is None else second_cos[:6].view(rc.shape).to(pairs.dtype)
    out = torch.stack([pairs[..., 0] * rc[..., 0] - pairs[..., 1] * rc[..., 1],
                       pairs[..., 1] * other[..., 0] + pairs[..., 0] * rc[..., 1]], -1)
    return out.flatten(3).type_as(x)


@pytest.mark.parametrize("second_cos", [None, "another_table"])
def test_rope_forward_torchtune_pairs_are_one_rotation(second_cos):
    """torchtune's rotation is interleave RoPE once ``rope_cache[..., 0]``, selected twice, is one
    leaf: it matches, and its cos, which exists only as the cache's even lanes, is rebuilt from the
    cache, so it fuses. The
    same program with the second term's cos from another table is no rotation and stays."""
    other = None if second_cos is None else ROPE_CACHE.flip(0)
    x = torch.randn(2, 6, 4, 16, requires_grad=True)
    result, fw, _ = check(lambda x: torchtune(x, second_cos=other) * 2, [x], **BOTH)
    missed = [m.reason for m in result.misses if m.op == ROPE]
    if second_cos is None:  # its cos, the cache's even lanes, is rebuilt from the cache (operands in pieces)
        assert result.fused(ROPE) == 1 == result.fused(ROPE_GRAD) and not missed, (result.sites, result.misses)
    else:
        assert not result.fused(ROPE) and not calls(fw, ROPE), result.sites
        assert all("no mode's formula" in reason for reason in missed), missed


NORM_WEIGHTS = torch.nn.Parameter(torch.randn(2, 16, generator=torch.Generator().manual_seed(5)))


def torchtitan_qk_norm_bf16(q, other_weight=False):
    """torchtitan's Qwen3 in bf16: a decomposed q-norm ``(normed * w).to(bf16)`` (its forward
    left unfused), then ``q.float()`` rotated by bf16 cos/sin sliced from one cache."""
    cache = torch.cat([torch.cat([ROPE_CACHE[..., 0]] * 2, -1), torch.cat([ROPE_CACHE[..., 1]] * 2, -1)], -1)
    q32 = q.float()
    normed = q32 * torch.rsqrt(q32.pow(2).mean(-1, keepdim=True) + EPS)
    qn, qn_other = ((normed * w.to(q32.dtype)).to(q.dtype).float() for w in NORM_WEIGHTS)
    rc = cache.to(q.dtype)[:6].view(1, 6, 1, 32)
    cos, sin = rc[..., :16], rc[..., 16:]
    half = qn_other if other_weight else qn
    return ((qn * cos) + torch.cat((-half[..., 8:], half[..., :8]), -1) * sin).to(q.dtype)


@pytest.mark.parametrize("other_weight", [False, True])
def test_rope_forward_of_a_decomposed_norm_times_weight(other_weight):
    """x a product (``normed * weight``) read through casts in both terms is read as one leaf and
    the rotation fuses (it was "no mode's formula": each term cut the product at a different
    node); the rotated half read from a product with another weight is no rotation and stays."""
    q = torch.randn(2, 6, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    result, fw, _ = check(lambda q: torchtitan_qk_norm_bf16(q, other_weight) * 2, [q], [NORM_WEIGHTS], **BOTH)
    rope_misses = [m for m in result.misses if m.op == ROPE]
    if other_weight:
        assert not result.fused(ROPE) and not calls(fw, ROPE), result.sites
    else:
        assert result.fused(ROPE) == result.fused(ROPE_GRAD) == len(calls(fw, ROPE)) == 1 and not rope_misses, (
            result.sites, result.misses)


@pytest.mark.smoke  # in the version matrix's smoke set: a target's forward refusal
def test_rope_forward_refused_by_the_target_is_a_recorded_miss():
    """Mode 3 (DeepSeek-V3's interleave-half) runs on Ascend 950 only: on A2 the forward stays as it
    is, a recorded miss with the target's reason; on 950 it fuses."""
    q = torch.randn(2, 4, 6, 16, requires_grad=True)
    angles = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    cos, sin = angles.cos(), angles.sin()

    def deepseek(q):
        b, h, s, d = q.shape
        q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
        return q * cos + torch.cat((-q[..., 8:], q[..., :8]), -1) * sin

    result, fw, _ = check(deepseek, [q], target="a2", **BOTH)
    missed = [m for m in result.misses if m.op == ROPE]
    assert not result.fused(ROPE) and len(missed) == 1 and not calls(fw, ROPE)
    assert "mode" in missed[0].reason, missed
    result, fw, _ = check(deepseek, [q], target="950", **BOTH)
    assert result.fused(ROPE) == 1 and calls(fw, ROPE)[0].args[3] == 3


# -- operands only in pieces: rebuilt in the graph from the node that holds them, checked by value --

def gpt_oss(q, cos, sin):  # half-width tables: cos of the op is cat(cos, cos), rebuilt
    first, second = torch.chunk(q, 2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), -1)


def deepseek_even_odd(q, cos, sin):  # HF DeepSeek-V3: full tables sliced to a half, x's even/odd lanes
    c, s = cos[..., :8], sin[..., :8]
    even, odd = q[..., 0::2], q[..., 1::2]
    return torch.cat([even * c - odd * s, odd * c + even * s], -1)


def halves_of_other_offsets(q, cos, sin):  # second half's table from lanes 1..8: still each lane's own table
    first, second = q[..., :8], q[..., 8:]
    return torch.cat((first * cos[..., :8] - second * sin[..., :8], second * cos[..., 1:9] + first * sin[..., 1:9]), -1)


def complex_cis(q, cos, sin):  # torchtitan / Llama 4: x's pairs times a complex table
    freqs_cis = torch.polar(torch.ones_like(cos[..., :8]), cos[..., :8])
    pairs = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis).flatten(3).type_as(q)


def torchtune_cache(q, cos, sin):  # torchtune: a [S, D/2, 2] cache, x's pairs, stack and flatten
    cache = torch.stack([cos[..., :8], sin[..., :8]], -1)
    pairs = q.float().reshape(*q.shape[:-1], -1, 2)
    out = torch.stack([pairs[..., 0] * cache[..., 0] - pairs[..., 1] * cache[..., 1],
                       pairs[..., 1] * cache[..., 0] + pairs[..., 0] * cache[..., 1]], -1)
    return out.flatten(3).type_as(q)


def second_half_other_table(q, cos, sin):  # near miss: the second half reads another table
    first, second = torch.chunk(q, 2, dim=-1)
    return torch.cat((first * cos[..., :8] - second * sin[..., :8], second * sin[..., :8] + first * sin[..., :8]), -1)


def even_odd_sign_swapped(q, cos, sin):  # near miss: both terms of the odd lanes negated
    even, odd = q[..., 0::2], q[..., 1::2]
    return torch.cat([even * cos[..., :8] - odd * sin[..., :8], odd * cos[..., :8] - even * sin[..., :8]], -1)


def torchtune_sin_for_cos(q, cos, sin):  # near miss: the even lanes' rotated term reads cos
    cache = torch.stack([cos[..., :8], sin[..., :8]], -1)
    pairs = q.reshape(*q.shape[:-1], -1, 2)
    out = torch.stack([pairs[..., 0] * cache[..., 0] - pairs[..., 1] * cache[..., 0],
                       pairs[..., 1] * cache[..., 0] + pairs[..., 0] * cache[..., 1]], -1)
    return out.flatten(3)


PIECES = {  # name: (rotation, fused mode or None where it must stay unfused)
    "gpt_oss": (gpt_oss, 0), "deepseek_even_odd": (deepseek_even_odd, 3),
    "halves_of_other_offsets": (halves_of_other_offsets, 0), "complex_cis": (complex_cis, 1),
    "torchtune": (torchtune_cache, 1), "second_half_other_table": (second_half_other_table, None),
    "even_odd_sign_swapped": (even_odd_sign_swapped, None), "torchtune_sin_for_cos": (torchtune_sin_for_cos, None),
}


@pytest.mark.parametrize("name", PIECES)
def test_rope_forward_operands_in_pieces(name):
    """Tables and x that the program holds only in pieces (half-width tables, even/odd lanes,
    complex parts, a cache's selects) fuse with the operand rebuilt from the node holding them;
    output and gradients within the criterion. Near misses (a half reading another table, a
    sign, a swapped select) stay as they are, each a recorded miss."""
    fn, mode = PIECES[name]
    q = torch.randn(2, 4, 6, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    angles = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    cos, sin = (angles[:, :8].cos(), angles[:, :8].sin()) if fn is gpt_oss else (angles.cos(), angles.sin())
    if fn is complex_cis:
        cos = angles
    result, fw, _ = check(lambda q: fn(q, cos, sin) * 2, [q], **BOTH)
    fused = calls(fw, ROPE)
    if mode is None:
        assert not result.fused(ROPE) and not fused, result.sites
        assert any(m.op == ROPE for m in result.misses), result.misses
    else:
        assert result.fused(ROPE) == len(fused) == 1, (result.sites, result.misses)
        # the backward rule reads no mode in a rotation whose two halves' tables differ (its miss)
        assert result.fused(ROPE_GRAD) == int(name != "halves_of_other_offsets"), result.misses
        assert fused[0].args[3] == mode and not [m for m in result.misses if m.op == ROPE]


def test_rope_forward_complex_over_heads_of_a_projection_fuses():
    """Llama 4: q and k (fewer heads) are projections viewed as [B, S, N, D], their pairs complex,
    times freqs_cis [1, S, 1, D/2]; the views into heads are read as x (leaves), the table as its
    real parts, for both."""
    projection = torch.nn.Parameter(torch.randn(64, 96, generator=torch.Generator().manual_seed(8)) / 8)
    angles = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    freqs_cis = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]

    def rotate(x):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], 8, 2))
        return torch.view_as_real(freqs_cis * pairs).flatten(3)

    def llama4(p):
        qk = p @ projection
        q, k = qk[..., :64].view(2, 6, 4, 16), qk[..., 64:].view(2, 6, 2, 16)
        return torch.cat([rotate(q), rotate(k)], 2) * 2

    p = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    result, fw, _ = check(llama4, [p], [projection], **BOTH)
    fused = calls(fw, ROPE)
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == len(fused) == 2, (result.sites, result.misses)
    assert all(f.args[3] == 1 for f in fused) and not result.misses


def test_rope_forward_torchtune_cache_over_heads_of_a_projection_fuses():
    """torchtune as written: a [S, D/2, 2] cache viewed [1, S, 1, D/2, 2], ``rope_cache[..., 0]``
    taken once per term (two nodes, one value), x a projection viewed into heads."""
    projection = torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(8)) / 8)
    angles = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    cache = torch.stack([angles.cos(), angles.sin()], -1)

    def torchtune_rope(p):
        pairs = (p @ projection).view(2, 6, 4, 16).float().reshape(2, 6, 4, 8, 2)
        table = cache.view(-1, 6, 1, 8, 2)
        out = torch.stack([pairs[..., 0] * table[..., 0] - pairs[..., 1] * table[..., 1],
                           pairs[..., 1] * table[..., 0] + pairs[..., 0] * table[..., 1]], -1)
        return out.flatten(3) * 2

    p = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    result, fw, _ = check(torchtune_rope, [p], [projection], **BOTH)
    fused = calls(fw, ROPE)
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == len(fused) == 1, (result.sites, result.misses)
    assert fused[0].args[3] == 1 and not result.misses


def test_rope_forward_of_a_key_broadcast_over_heads_fuses_before_the_broadcast():
    """MLA's shared k_rot [B, 1, S, D] is rotated, then expanded over the heads: the site is the
    rotation, whose x has its shape, not the expand."""
    k = torch.randn(2, 1, 6, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    angles = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    cos, sin = angles.cos(), angles.sin()
    result, fw, _ = check(lambda k: gpt_oss(k, cos, sin).expand(-1, 4, -1, -1) * 2, [k], **BOTH)
    assert result.fused(ROPE) == len(calls(fw, ROPE)) == 1 and not result.misses, (result.sites, result.misses)
    assert list(calls(fw, ROPE)[0].meta["val"].shape) == [2, 1, 6, 16]


@pytest.mark.parametrize("dynamic", ["batch_and_sequence", "all"])
def test_dynamic_shapes(dynamic):
    """Symbolic batch and sequence: every forward fused (the rotation's layout read off symbolic
    strides, no guard). ``dynamic=True`` passes eps as a tensor: the backend specializes it under
    a guard, so the norms' forward fuses too. A second step at another batch and sequence length
    runs the same compiled graph (Dynamo's counters), its gradients by the float64 criterion too."""
    model = bundled("llama", num_layers=1, dtype=torch.bfloat16)
    options = FusionOptions.from_mapping(dict(target="generic", strict=True, **BOTH))
    seen = []
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model.loss, backend=aot_backend(options, lambda gm, run: seen.append(run())),
                             dynamic=dynamic == "all")
    for seed, shape in enumerate(((2, 16), (3, 11)), start=1):
        ids = torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))
        if dynamic != "all":
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(ids, 1)
        model.zero_grad(set_to_none=True)
        compiled(ids).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert not grad_failures(grads, *_eager_and_exact(model, ids))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "another batch and sequence recompiled"
    (result,), sites = seen, model.expected_sites
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == sites[ROPE_GRAD]
    assert result.fused(BACKWARD) == sites[BACKWARD]
    assert result.fused(FORWARD) == sites[BACKWARD] and not result.misses


def _centred_norm(x, w):
    xf = x.float()
    c = xf - xf.mean(-1, keepdim=True)
    return w * (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_of_a_centred_value_fuses_forward_on_the_centred_value(dtype, partitioner):
    """``c = x - mean(x)``, then an RMSNorm of c: its backward fused, its forward was neither fused
    nor recorded where the backward stayed unfused (the statistic of a centred square is no
    statistic the forward scan looks for). The forward rule reads c as the norm's input: the fused
    ``rms_norm`` normalizes c, whose centring stays the program's, and the fused backward reads
    its rstd."""
    w = _weight(dtype)
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    result, fw, bw = check(lambda x: _centred_norm(x, w), [x], [w], partitioner=partitioner, **ON)
    assert result.fused(FORWARD) == result.fused(BACKWARD) == 1 and not result.misses, result.misses
    (fused,) = calls(fw, FORWARD)
    assert _through_casts(fused.args[0]).target is torch.ops.aten.sub.Tensor  # the centred value
    assert not calls(fw, "rsqrt") and len(calls(fw, "mean")) == 1  # the centring's mean alone
    (grad,) = calls(bw, BACKWARD)
    assert _through_casts(grad.args[2]).op == "placeholder"  # the fused forward's rstd, saved
