"""Near misses and real sites in unusual dress through ``backend="npu_fusion"`` (and Inductor):
programs an attacking session found wrong, crashing or silent. Each is compiled with every rule on
(target ``generic`` unless it says otherwise, ``strict`` so that an internal error of the pass
raises instead of being rolled back), trained one step, and its outputs and every gradient pass
the float64 criterion against eager; each site ends fused or as one recorded miss."""
import pytest
import torch
import torch.nn.functional as F

from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_output
from npu_fusion.patterns.rms_statistic import EVERY_AXIS_REASON
from npu_fusion.plugin.pass_manager import HISTORY
from npu_fusion_testing.in_place import UpdatedProgram, assert_updated_as_eager, hf_rms_norm
from test_forward_fusion import check_gradients

EPS = 1e-6
NORM, NORM_GRAD = "rms_norm", "rms_norm_grad"
ROPE, ROPE_GRAD = "rotary_position_embedding", "rotary_position_embedding_grad"


def _seeded(seed, *size):
    return torch.randn(*size, generator=torch.Generator().manual_seed(seed))


def compiled_step(fn, inputs, params=(), dynamic=False, **options):
    """Compile ``fn`` with the ``npu_fusion`` backend (``strict``, target ``generic`` unless
    ``options`` say otherwise), run it without gradient and train it one step, each checked against
    eager by the float64 criterion; returns the pass's results on the graphs it compiled."""
    torch._dynamo.reset()
    mark = HISTORY.mark()
    compiled = torch.compile(fn, backend="npu_fusion", dynamic=dynamic,
                             options=dict({"strict": True, "target": "generic"}, **options))
    with torch.no_grad():
        got, eager, exact = compiled(*inputs), fn(*inputs), float64_output(fn, inputs, params)
    assert got.dtype == eager.dtype and got.shape == eager.shape
    assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)
    check_gradients(compiled, fn, inputs, params)
    results = HISTORY.since(mark)
    assert results and all(r.error is None for r in results), [r.error for r in results]
    assert not [m for r in results for m in r.misses if "internal error" in m.reason], [r.misses for r in results]
    return results


def _fused(results, op, graph="joint"):
    return sum(r.fused(op) for r in results if r.graph == graph)


def _misses(results, op=None, graph="joint"):
    return [m for r in results if r.graph == graph for m in r.misses if op is None or m.op == op]


# -- a symbolic scalar argument reached the pass's cached constant reader ---------------------------

def test_norm_of_a_strided_view_under_dynamic_shapes_is_no_internal_error():
    """An HF-style norm of ``x[..., ::2]`` under ``dynamic=True``: its backward divides by a symbolic size, which the
    RoPE backward's lane evaluator read through a cached constant reader that hashed the
    ``SymInt`` (TypeError: unhashable; the fail-safe rolled the candidate back as an internal
    error, and ``strict`` raised)."""
    w = torch.nn.Parameter(_seeded(3, 16))
    x = _seeded(1, 2, 6, 32).requires_grad_()
    results = compiled_step(lambda x: hf_rms_norm(x[..., ::2], w), [x], [w], dynamic=True)
    assert _fused(results, NORM_GRAD) + len(_misses(results, NORM_GRAD)) == 1, _misses(results)


# -- HF's rotate_half slices at d // 2: under dynamic=True its head dim stayed symbolic -------------

COS, SIN = _seeded(2, 6, 16).cos(), _seeded(2, 6, 16).sin()


def hf_rotate_half(x):  # transformers' spelling: slices at x.shape[-1] // 2
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def test_hf_rotate_half_of_an_input_fuses_under_dynamic_shapes():
    """q a graph input, ``dynamic=True``: the head dim is guarded to its value so that the rotation
    fuses. The guard was put on the slice's size ``d // 2`` only, which keeps its value for two head
    dims (16 and 17): the head dim stayed symbolic and both rotations were misses saying it was
    marked dynamic (it was not)."""
    q, k = _seeded(1, 2, 2, 6, 16).requires_grad_(), _seeded(5, 2, 2, 6, 16).requires_grad_()
    results = compiled_step(lambda q, k: (q * COS + hf_rotate_half(q) * SIN) + (k * COS + hf_rotate_half(k) * SIN),
                            [q, k], dynamic=True)
    assert _fused(results, ROPE_GRAD) == _fused(results, ROPE) == 2 and not _misses(results), _misses(results)
    assert _fused(results, ROPE, graph="inference") == 2, _misses(results, graph="inference")


# -- a norm over every axis of x: no form reads it, and the inference graph left it silent ----------

def _norm_over(x, w, dims):
    return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + EPS) * w


EVERY_AXIS = {  # name: (x's shape, the weight's, the axes of the mean)
    "one_dimensional_x": ((16,), (16,), -1),
    "mean_over_both_axes_of_a_matrix": ((6, 16), (6, 16), (-2, -1)),
}


@pytest.mark.parametrize("name", EVERY_AXIS)
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_norm_over_every_axis_is_one_recorded_miss_each_way(name, training):
    """A norm over every axis of x (a 1-D x; a mean over all of x's axes): the decomposed forms need
    a leading axis, so it stays unfused, one miss per op saying to add one. The forward scan did not
    look at it (silent in an inference graph) and the backward's miss said only that no form matched."""
    x_shape, w_shape, dims = EVERY_AXIS[name]
    w = torch.nn.Parameter(_seeded(3, *w_shape))
    x = _seeded(1, *x_shape).requires_grad_(training)
    results = compiled_step(lambda x: _norm_over(x, w, dims), [x], [w])
    graph = "joint" if training else "inference"
    for op in (NORM, NORM_GRAD) if training else (NORM,):
        assert _fused(results, op, graph) == 0 and [m.reason for m in _misses(results, op, graph)] == [EVERY_AXIS_REASON]
    assert len(_misses(results, graph=graph)) == (2 if training else 1), _misses(results, graph=graph)


@pytest.mark.parametrize("name", EVERY_AXIS)
def test_norm_over_every_axis_with_the_leading_axis_the_miss_suggests_fuses(name):
    x_shape, w_shape, dims = EVERY_AXIS[name]
    w = torch.nn.Parameter(_seeded(3, *w_shape))
    x = _seeded(1, *x_shape).requires_grad_()
    results = compiled_step(lambda x: _norm_over(x.unsqueeze(0), w, dims).squeeze(0), [x], [w])
    assert _fused(results, NORM) == _fused(results, NORM_GRAD) == 1 and not _misses(results), _misses(results)


# -- tables read from module globals by a second compiled function under dynamic=True ------------

def _rotate_by_chunks(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotation(q):
    return q * COS + _rotate_by_chunks(q) * SIN


def test_rotation_of_global_tables_fuses_in_a_second_compiled_function_under_dynamic_shapes():
    """Two functions rotating q with the same module-level tables, compiled one after the other with
    ``dynamic=True`` (a training step and an evaluation step): the first fuses; the second must too."""
    q = _seeded(1, 2, 2, 6, 16).requires_grad_()
    first = compiled_step(_rotation, [q], dynamic=True)
    assert _fused(first, ROPE_GRAD) == 1, _misses(first)
    second = compiled_step(lambda q: _rotation(q) * 2, [q], dynamic=True)
    assert _fused(second, ROPE_GRAD) == _fused(second, ROPE) == 1 and not _misses(second), _misses(second)


# -- a pointwise op between SwiGLU's split and its product: a site the counter sees, left silent -----

GATE_UP = torch.nn.Parameter(_seeded(7, 16, 16) / 4)


def _halves(x):
    return (x @ GATE_UP).chunk(2, dim=-1)


CHANGED_HALVES = {  # name: SwiGLU of x with a pointwise op on a half before the product
    "clamped_gate": lambda x: (lambda gate, up: F.silu(gate.clamp(max=0.3)) * up)(*_halves(x)),
    "clamped_up": lambda x: (lambda gate, up: F.silu(gate) * up.clamp(-0.2, 0.2))(*_halves(x)),
    "shifted_up": lambda x: (lambda gate, up: F.silu(gate) * (up + 1))(*_halves(x)),
}


@pytest.mark.parametrize("name", CHANGED_HALVES)
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_swiglu_with_a_pointwise_op_on_a_half_is_one_recorded_miss_each_way(name, training):
    """GPT-OSS clamps the gate and the up and shifts the up before the product: not the fused op's
    ``silu(x[:H]) * x[H:]``, and the near-miss readers followed only products, signs and casts from
    the split, so the site was silent both ways (in training and in an inference graph)."""
    x = _seeded(1, 2, 3, 16).requires_grad_(training)
    results = compiled_step(CHANGED_HALVES[name], [x], [GATE_UP])
    graph = "joint" if training else "inference"
    for op in ("swiglu", "swiglu_grad") if training else ("swiglu",):
        misses = _misses(results, op, graph)
        assert _fused(results, op, graph) == 0 and len(misses) == 1 and "between the split and the product" in \
            misses[0].reason, _misses(results, graph=graph)


# -- a norm whose statistic is detached: its dgamma fused alone beside its dx's miss ---------------

def test_norm_with_a_detached_statistic_is_judged_once():
    """``x * rsqrt(mean(x.detach()**2) + eps) * w``: x takes a gradient, scaled by the statistic,
    that is no RMSNorm dx. Its dgamma was fused as a dgamma-only site (a norm whose input takes no
    gradient) while the product scaling x's gradient was recorded as a miss: one norm fused and
    missed. Now it is one miss per op, nothing fused."""
    w = torch.nn.Parameter(_seeded(3, 16))
    x = _seeded(1, 2, 3, 16).requires_grad_()
    results = compiled_step(lambda x: x * torch.rsqrt(x.detach().pow(2).mean(-1, keepdim=True) + EPS) * w, [x], [w])
    for op in (NORM, NORM_GRAD):
        assert _fused(results, op) == 0 and len(_misses(results, op)) == 1, _misses(results)


@pytest.mark.parametrize("weight_first", [False, True], ids=["weight_last", "weight_first"])
def test_frozen_input_norm_still_fuses_its_dgamma(weight_first):
    """The dgamma-only site the change above keeps: x takes no gradient, and with the weight applied
    first (``(x * w) * rstd``) autograd scales dy by the statistic inside dgamma's own sum."""
    w = torch.nn.Parameter(_seeded(3, 16))
    h = _seeded(1, 2, 3, 16)
    z = _seeded(2, 2, 3, 16).requires_grad_()
    stat = lambda h: torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)  # noqa: E731
    norm = (lambda h: (h * w) * stat(h)) if weight_first else (lambda h: h * stat(h) * w)
    results = compiled_step(lambda z: z * norm(h), [z], [w])
    assert _fused(results, NORM_GRAD) == 1 and not _misses(results, NORM_GRAD), _misses(results)


# -- a returned norm output rotated after: the caller's copy landed among the backward nodes --------

def _rotated_norm(q, g, cos, sin):
    """Qwen3's q norm then the rotation, the normalized q returned too (the caller may update it)."""
    n = hf_rms_norm(q, g)
    return n * cos + hf_rotate_half(n) * sin, n


ROTATED_NORM = UpdatedProgram("rotated_norm_returned", _rotated_norm, ((2, 2, 6, 16), (16,), (6, 16), (6, 16)),
                              (True, True, False, False), lambda inputs, outputs: outputs[1].mul_(2.0),
                              (torch.bfloat16, torch.float16, torch.float32),
                              {NORM: 1, NORM_GRAD: 1, ROPE: 1, ROPE_GRAD: 1})


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_returned_norm_output_rotated_after_partitions(dtype, partitioner):
    """The fused norm's backward reads a forward copy of the caller's input (the unfused one read its
    float32 upcast); the copy went after the last placeholder, a tangent the rotation's inserted
    backward sits before, and the default partitioner (every node before the last forward-tagged one
    is forward) saved the rotation's dx: ``AssertionError: Node getitem_2 was invalid, but is output``,
    strict or not (the partition runs after the pass's fail-safe)."""
    mark = HISTORY.mark()
    torch._dynamo.reset()
    compiled = torch.compile(_rotated_norm, backend="npu_fusion",
                             options={"target": "generic", "strict": True, "partitioner": partitioner})
    assert_updated_as_eager(compiled, ROTATED_NORM, dtype)
    (joint,) = [r for r in HISTORY.since(mark) if r.graph == "joint"]
    assert {op: joint.fused(op) for op in ROTATED_NORM.fused} == ROTATED_NORM.fused and not joint.misses, joint.misses
