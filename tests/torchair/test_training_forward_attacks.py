"""Near-miss and tricky programs trained one step through torchair's backend after ``npu_fusion.install``, CANN stubbed.

Each program runs one forward and backward compiled by torchair with the pass in its hook (the
partitioned training forward fused by the forward rules, the backward against the forward's copy
from before the pass), and against eager and a float64 run: outputs and gradients by the float64
criterion, no pass error, and each forward site fused or one recorded miss. The spellings of a
norm (``** -0.5``, ``x / sqrt``, ``keepdim=False``, no weight, a float32 weight), what the backward
reads of a forward site (the normalized value in float32, rstd read by another op, a table's
gradient), rotations (interleaved, partial, twice, q without gradient), in-place updates, several
forward and backward pairs (two functions interleaved, recompiles, graph breaks, activation
checkpointing, more forwards than the session keeps before their backwards run), and a norm of a
norm, whose first site's output extends through the second's input cast: the second site once
emitted its fused op on the node the first had erased, the lint failed and the whole graph went
back unfused with no miss recorded (training forward and inference graph alike); and Gemma's
``1 + weight``, computed after the statistic whose detached copy the forward saves: that copy
read the norm's rstd before the weight, a miss, until it moved after the fused op."""
from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as checkpoint

import npu_fusion
from npu_fusion.measure.grads import grad_failures
from npu_fusion.plugin import pass_manager

EPS = 1e-6
BF16 = torch.bfloat16


def norm(x, g, up):
    """Llama's RMSNorm: statistic in ``up`` (float32; float64 in the reference run), weight after the cast back."""
    h = x.to(up)
    return g * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def rotate(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 64, generator=gen).to(BF16)
    g = (1 + 0.1 * torch.randn(64, generator=gen)).to(BF16)
    q = torch.randn(2, 4, 8, 16, generator=gen).to(BF16)
    angles = torch.randn(8, 16, generator=gen)
    return x, g, q, angles.cos().to(BF16), angles.sin().to(BF16)


X, G, Q, COS, SIN = _inputs()


def _spelled(statistic):
    """A norm whose normalized value is ``statistic(h)`` of the float32 copy ``h`` of x."""
    return lambda up: lambda x, g: g * statistic(x.to(up)).to(x.dtype)


def _saved_normalized(up):
    def program(x, g):  # the backward of h * h reads the float32 normalized value
        h = x.to(up)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        return g * h.to(x.dtype), (h * h).sum(-1)
    return program


def _rstd_read(up):
    def program(x, g):  # rstd returned through exp, whose backward reads it
        h = x.to(up)
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        return g * (h * r).to(x.dtype), r.exp()
    return program


def _gamma_in_float32(up):
    return lambda x, g: (g.to(up) * x.to(up) * torch.rsqrt(x.to(up).pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _gemma(up):
    def program(x, g):  # the weight 1 + g computed after the statistic, which the forward saves (detached)
        h = x.to(up)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + g.to(up))).to(x.dtype)
    return program


def _in_place_on_output(up):
    def program(q, cos, sin):
        y = rotate(q, cos, sin)
        y.add_(1)
        return y
    return program


def _partial(up):
    def program(q, cos, sin):
        rotated, passed = q[..., :8], q[..., 8:]
        return torch.cat((rotate(rotated, cos[..., :8], sin[..., :8]), passed), -1)
    return program


def _norm_of_norm_checkpointed(up):
    def program(x, g):
        return norm(checkpoint.checkpoint(lambda t: norm(t, g, up), x, use_reentrant=False), g, up)
    return program


def _checkpointed_block(up):
    def block(x, g, q, cos, sin):
        return norm(x, g, up) * 2, rotate(q, cos, sin)

    def program(x, g, q, cos, sin):
        a, b = checkpoint.checkpoint(block, x, g, q, cos, sin, use_reentrant=False)
        return norm(a, g, up), b * b
    return program


def _graph_breaks(up):
    def program(x, g, q, cos, sin):
        a = norm(x, g, up)
        torch._dynamo.graph_break()
        b = rotate(q, cos, sin)
        torch._dynamo.graph_break()
        return norm(a * 2, g, up), b.sin()
    return program


#: name: (program of the upcast dtype, inputs, which take a gradient, forward rms_norm and rope
#: fused, forward misses); the forward counts summed over the program's forward graphs
PROGRAMS = {
    "norm_of_norm": (lambda up: lambda x, g: norm(norm(x, g, up), g, up), (X, G), (1, 1), (2, 0), 0),
    "norm_of_norm_checkpointed": (_norm_of_norm_checkpointed, (X, G), (1, 1), (2, 0), 0),
    "pow_minus_half": (_spelled(lambda h: h * (h.pow(2).mean(-1, keepdim=True) + EPS) ** -0.5), (X, G), (1, 1),
                       (1, 0), 0),
    "div_sqrt": (_spelled(lambda h: h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + EPS)), (X, G), (1, 1), (1, 0), 0),
    "keepdim_false": (_spelled(lambda h: h * torch.rsqrt(h.pow(2).mean(-1) + EPS).unsqueeze(-1)), (X, G), (1, 1),
                      (1, 0), 0),
    "no_weight": (lambda up: lambda x: norm(x, 1, up), (X,), (1,), (1, 0), 0),
    "weight_in_float32": (_gamma_in_float32, (X, G.float()), (1, 1), (1, 0), 0),
    "gemma_weight_computed_after_the_statistic": (_gemma, (X, G), (1, 1), (1, 0), 0),
    "normalized_read_in_float32_by_the_backward": (_saved_normalized, (X, G), (1, 1), (0, 0), 1),
    "rstd_read_by_another_op": (_rstd_read, (X, G), (1, 1), (1, 0), 0),
    "interleaved": (lambda up: lambda q, c, s: q * c + torch.stack((-q[..., 1::2], q[..., ::2]), -1).flatten(-2) * s,
                    (Q, COS, SIN), (1, 0, 0), (0, 1), 0),
    "rotated_twice": (lambda up: lambda q, c, s: rotate(rotate(q, c, s), c, s), (Q, COS, SIN), (1, 0, 0), (0, 2), 0),
    "partial_rotary": (_partial, (Q, COS, SIN), (1, 0, 0), (0, 1), 0),
    "q_without_gradient": (lambda up: lambda q, k, c, s: (rotate(q, c, s), rotate(k, c, s)), (Q, Q * 2, COS, SIN),
                           (0, 1, 0, 0), (0, 2), 0),
    "learned_sin": (lambda up: rotate, (Q, COS, SIN), (1, 0, 1), (0, 0), 1),
    "in_place_on_the_rotated": (_in_place_on_output, (Q, COS, SIN), (1, 0, 0), (0, 1), 0),
    "norm_then_rotation": (lambda up: lambda q, g, c, s: rotate(norm(q, g, up), c, s), (Q, G[:16], COS, SIN),
                           (1, 1, 0, 0), (1, 1), 0),
    "checkpointed_block": (_checkpointed_block, (X, G, Q, COS, SIN), (1, 1, 1, 0, 0), (2, 1), 0),
    "graph_breaks": (_graph_breaks, (X, G, Q, COS, SIN), (1, 1, 1, 0, 0), (2, 1), 0),
}


def _step(program, tensors, grads):
    """One forward and backward for fixed random output gradients: the outputs and the inputs' gradients."""
    leaves = [t.detach().clone().requires_grad_(bool(need)) for t, need in zip(tensors, grads)]
    outs = program(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(1)
    read = [o for o in outs if o.requires_grad]  # q without gradient: its rotation's output takes none
    torch.autograd.backward(read, [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in read])
    values = {f"out{i}": o.detach() for i, o in enumerate(outs)}
    values.update({f"grad{i}": t.grad for i, (t, need) in enumerate(zip(leaves, grads)) if need})
    return values


def _checked(got, make, tensors, grads):
    eager = _step(make(torch.float32), tensors, grads)
    wide = [t.double() for t in tensors]
    exact = {n: v.to(eager[n].dtype) for n, v in _step(make(torch.float64), wide, grads).items()}
    assert not grad_failures(got, eager, exact), grad_failures(got, eager, exact)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_program_trained_one_step_through_install(ge, name):
    make, tensors, grads, (norms, rotations), misses = PROGRAMS[name]
    mark = pass_manager.HISTORY.mark()
    compiled = ge.compile(make(torch.float32), config=npu_fusion.install(ge.config(), target="a2"), fullgraph=False)
    got = _step(compiled, tensors, grads)
    results = pass_manager.HISTORY.since(mark)
    _checked(got, make, tensors, grads)
    assert not [r.error for r in results if r.error], [r.error for r in results]
    forwards = [r for r in results if r.graph == "forward"]
    found = (sum(r.fused("rms_norm") for r in forwards), sum(r.fused("rotary_position_embedding") for r in forwards))
    recorded = [m for r in forwards for m in r.misses]
    assert found == (norms, rotations) and len(recorded) == misses, (found, recorded)
    assert len({(m.op, m.node) for m in recorded}) == len(recorded), recorded  # none recorded twice


def test_norm_of_norm_in_an_inference_graph_fuses_both(ge):
    """The same norm of a norm under ``no_grad`` (the inference graph): both norms fused, none lost to the lint."""
    program = lambda x, g, up=torch.float32: norm(norm(x, g, up), g, up)  # noqa: E731
    mark = pass_manager.HISTORY.mark()
    compiled = ge.compile(program, config=npu_fusion.install(ge.config(), target="a2"))
    with torch.no_grad():
        got = {"out0": compiled(X, G)}
        eager = {"out0": program(X, G)}
        exact = {"out0": program(X.double(), G.double(), torch.float64).to(BF16)}
    assert not grad_failures(got, eager, exact), grad_failures(got, eager, exact)
    (result,) = pass_manager.HISTORY.since(mark)
    assert result.graph == "inference" and not result.error and result.fused("rms_norm") == 2, result


def test_two_compiled_functions_and_two_shapes_pair_each_backward_with_its_forward(ge):
    """Two functions' forwards, one of them recompiled for a second shape, run before any backward:
    each backward fuses against its own forward's copy; outputs and gradients by the float64 criterion."""
    x2 = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2)).to(BF16)

    def build(compile_, up):
        normed = compile_(lambda x, g: norm(x, g, up))
        rotated = compile_(lambda q, c, s: rotate(q, c, s) * 2)
        return lambda x, g, x2, q, c, s: (normed(x, g), rotated(q, c, s), normed(x2, g))

    mark = pass_manager.HISTORY.mark()
    config = npu_fusion.install(ge.config(), target="a2")
    tensors, grads = (X, G, x2, Q, COS, SIN), (1, 1, 1, 1, 0, 0)
    got = _step(build(lambda f: ge.compile(f, config=config), torch.float32), tensors, grads)
    results = pass_manager.HISTORY.since(mark)
    _checked(got, lambda up: build(lambda f: f, up), tensors, grads)
    assert [r.graph for r in results] == ["forward"] * 3 + ["backward"] * 3, results
    assert not [m for r in results for m in r.misses] and not [r.error for r in results if r.error], results
    assert sum(r.fused("rms_norm_grad") for r in results) == 2
    assert sum(r.fused("rotary_position_embedding_grad") for r in results) == 1


def test_more_forwards_than_once_kept_before_their_backwards(ge):
    """Twenty compiled functions' forwards run before any backward (one loss over all of them): every
    backward still fuses against its own forward's copy (the session once kept the newest 16, and
    the 4 oldest backwards ran alone, each one miss); outputs and gradients by the float64 criterion."""
    namespace = {"torch": torch, "EPS": EPS}
    for i in range(20):  # a code object each: one compilation each, no recompile limit
        exec(f"def norm{i}(x, g, up):\n    h = x.to(up)\n"
             f"    return g * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * {i + 1}",
             namespace)

    def build(compile_, up):
        norms = [compile_(namespace[f"norm{i}"]) for i in range(20)]
        return lambda x, g: sum(f(x, g, up).float() for f in norms)

    mark = pass_manager.HISTORY.mark()
    config = npu_fusion.install(ge.config(), target="a2")
    got = _step(build(lambda f: ge.compile(f, config=config), torch.float32), (X, G), (1, 1))
    results = pass_manager.HISTORY.since(mark)
    _checked(got, lambda up: build(lambda f: f, up), (X, G), (1, 1))
    backwards = [r for r in results if r.graph == "backward"]
    assert len(backwards) == 20 and all(r.fused("rms_norm_grad") == 1 and not r.misses for r in backwards), \
        [(r.sites, r.misses) for r in backwards]
