"""Real training graphs: activation checkpointing, compiled autograd, symbolic sizes, and
sites whose dy or x is itself computed (post- and sandwich norms, gated norms, RoPE outputs
used elementwise). Every case asserts what fused and checks every gradient against eager
and float64."""
import copy

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import rotate_half

from npu_fusion.models import bundled
from npu_fusion_testing.capture import Capture, compile_and_compare
from npu_fusion.measure.grads import assert_close_as_unfused, run_grads

ROPE, RMS = "rotary_position_embedding_grad", "rms_norm_grad"
PARTITIONERS = ["default", "min_cut"]


def rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def rms(x, w, eps=1e-6):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def rope_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 6, 16, generator=gen).requires_grad_()
    k = torch.randn(2, 4, 6, 16, generator=gen).requires_grad_()
    return q, k, torch.randn(2, 1, 6, 16, generator=gen), torch.randn(2, 1, 6, 16, generator=gen)


def norm_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 5, 32, generator=gen).requires_grad_(),
            torch.randn(2, 5, 32, generator=gen).requires_grad_(),
            torch.randn(32, generator=gen).requires_grad_(), torch.randn(32, generator=gen).requires_grad_())


SCALE = torch.randn(6, 1, generator=torch.Generator().manual_seed(3))

#: name -> (program, inputs, RoPE sites, RMSNorm sites)
COMPUTED_DY = {
    "rope_outputs_dotted": (lambda q, k, c, s: (rope(q, c, s) * rope(k, c, s)).sum(), rope_inputs, 2, 0),
    "rope_output_squared": (lambda q, k, c, s: rope(q, c, s).square() + k, rope_inputs, 1, 0),
    "l2_norm_after_rope": (lambda q, k, c, s: F.normalize(rope(q, c, s), dim=-1) + k, rope_inputs, 1, 0),
    "per_position_scale_after_rope": (lambda q, k, c, s: rope(q, c, s) * SCALE + k, rope_inputs, 1, 0),
    "cat_x2_minus_x1_rotation": (lambda q, k, c, s: q * c + torch.cat((q[..., 8:], -q[..., :8]), -1) * s + k,
                                 rope_inputs, 1, 0),
    "gated_norm": (lambda x, g, w, w2: rms(x, w) * torch.sigmoid(g) + w2, norm_inputs, 0, 1),
    "sandwich_norm": (lambda x, g, w, w2: rms(x + rms(x, w), w2) + g, norm_inputs, 0, 2),
    "post_norm_chain": (lambda x, g, w, w2: rms(rms(x, w), w2) + g, norm_inputs, 0, 2),
    "gated_norm_input": (lambda x, g, w, w2: rms(F.relu(x) ** 2 * g, w) + w2, norm_inputs, 0, 1),
}


@pytest.mark.parametrize("partitioner", PARTITIONERS)
@pytest.mark.parametrize("name", COMPUTED_DY)
def test_site_with_a_computed_dy_or_x_fuses(name, partitioner):
    fn, make_inputs, n_rope, n_rms = COMPUTED_DY[name]
    capture = compile_and_compare(fn, list(make_inputs()), partitioner=partitioner, target="generic")
    assert (capture.fused(ROPE), capture.fused(RMS)) == (n_rope, n_rms), capture.misses()
    assert not capture.misses()


def test_symbolic_hidden_size_fuses_rms_norm():
    fn = lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # noqa: E731
    x, _, w, _ = norm_inputs()
    torch._dynamo.reset()
    capture = Capture(target="generic")
    got, grad_out = run_grads(torch.compile(fn, backend=capture, dynamic=True), [x, w])
    eager, _ = run_grads(fn, [x, w], grad_outputs=grad_out)
    exact, _ = run_grads(fn, [x.detach().double().requires_grad_(), w.detach().double().requires_grad_()],
                         grad_outputs=[g.double() for g in grad_out])
    hidden = [n for n in capture.before[0].nodes if n.op == "placeholder" and isinstance(n.meta.get("val"),
                                                                                         torch.SymInt)]
    assert hidden, "the hidden size should be a symbolic input"
    assert capture.fused(RMS) == 1
    for g, e, x64 in zip(got, eager, exact):
        assert_close_as_unfused(g, e, x64, factor=4.0)


def test_symbolic_head_dim_of_an_input_is_guarded_and_fuses():
    """q an input whose head dim ``dynamic=True`` makes symbolic, rotated by transformers' ``rotate_half``
    (slices ``x[..., : d // 2]``): the rules guard the sliced tensor's head dim d, not only the
    slices' width ``d // 2`` (a guard on which left d symbolic: the rotation was one recorded miss),
    and the rotation fuses both ways; gradients by the float64 criterion."""
    from npu_fusion.measure.grads import float64_grads

    q, k, _, _ = rope_inputs()
    cos, sin = torch.randn(6, 16), torch.randn(6, 16)
    torch._dynamo.reset()
    capture = Capture(target="generic")
    got, grad_outputs = run_grads(torch.compile(lambda q, c, s: rope(q, c, s), backend=capture, dynamic=True),
                                  [q, cos, sin])
    eager, _ = run_grads(rope, [q, cos, sin], (), grad_outputs)
    exact = float64_grads(rope, [q, cos, sin], (), grad_outputs)
    assert capture.fused(ROPE) == 1 and capture.fused("rotary_position_embedding") == 1, capture.misses()
    assert not capture.misses()
    for g, e, x64 in zip(got, eager, exact):
        assert_close_as_unfused(g, e, x64, factor=4.0)


def model_grads(model, ids, step=None):
    model.zero_grad(set_to_none=True)
    if step is None:
        model.loss(ids).backward()
    else:
        step(ids)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def check_model(model, ids, capture, step):
    eager = model_grads(model, ids)
    exact_model = copy.deepcopy(model).double()
    exact = model_grads(exact_model, ids)
    torch._dynamo.reset()
    got = model_grads(model, ids, step)
    expected = model.expected_sites
    assert capture.fused(ROPE) == expected[ROPE] and capture.fused(RMS) == expected[RMS], capture.misses()
    assert not capture.misses()
    for name, grad in eager.items():
        assert got[name].dtype == grad.dtype and got[name].shape == grad.shape
        assert_close_as_unfused(got[name], grad, exact[name], factor=4.0)


@pytest.mark.parametrize("partitioner", PARTITIONERS)
@pytest.mark.parametrize("checkpoint", ["full", "selective"])
def test_activation_checkpointing_fuses_every_site(checkpoint, partitioner):
    model = bundled("llama", num_layers=2, checkpoint=checkpoint)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    capture = Capture(partitioner=partitioner, target="generic")
    compiled = torch.compile(lambda i: model.loss(i), backend=capture)
    check_model(model, ids, capture, lambda i: compiled(i).backward())


def test_compiled_autograd_fuses_every_site():
    model = bundled("llama", num_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    capture = Capture(target="generic")

    def train_step(i):
        model.loss(i).backward()

    with torch._dynamo.config.patch(compiled_autograd=True):  # read when torch.compile wraps
        compiled = torch.compile(train_step, backend=capture)
        check_model(model, ids, capture, compiled)
        # the backward graph was fused at the partition, then inlined into the compiled-autograd
        # graph, which went through the pass as a backward too (finding the fused ops there)
        assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] >= 1
    assert len(capture.results) == 2 and capture.results[1].fused(ROPE) == 0
    assert any(n.target == torch.ops.npu_fusion.rms_norm_grad.default for n in capture.after[1].nodes)


def test_transformers_gradient_checkpointing_fuses_every_site():
    from test_models import param_grads, tiny_llama

    model = tiny_llama(torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # transformers checkpoints only in training mode; the tiny config has no dropout
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    eager = param_grads(model, ids)
    exact = param_grads(copy.deepcopy(model).double(), ids)
    torch._dynamo.reset()
    capture = Capture(target="generic")
    got = param_grads(model, ids, run=torch.compile(model, backend=capture))
    assert capture.fused(RMS) == 5 and capture.fused(ROPE) == 4, capture.misses()
    for name, grad in eager.items():
        assert_close_as_unfused(got[name], grad, exact[name], factor=4.0)
