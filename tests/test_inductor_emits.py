"""Everything the pass emits lowers in stock Inductor (issue 30).

Every op the pass can insert into a graph (:func:`npu_fusion_testing.emits.emittable_targets`,
read from its sources: the fused ops, casts, ones of a norm without weight or input gradient,
rotation tables rebuilt from complex or half-width ones, layout copies, the copies of
caller-reachable tensors) is emitted by at least one program below compiled with ``backend="inductor"`` after ``install_inductor``, on
the CPU, whose outputs and gradients pass the float64 criterion. A new emit fails
:func:`test_every_emittable_op_is_compiled_by_inductor` until a program here compiles it.

The programs run once per module (an Inductor compile costs seconds on a small machine), each
with its site kinds on inputs of its own."""
import functools

import pytest
import torch

import npu_fusion
from npu_fusion.compat import inductor_config, no_compile_caches
from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused
from npu_fusion.plugin.inductor import uninstall_inductor
from npu_fusion.plugin.pass_manager import HISTORY
from npu_fusion_testing.emits import emittable_targets, scan
from npu_fusion.measure.grads import float64_output
from npu_fusion_testing.aliasing import views_checked
from test_forward_fusion import check_gradients

EPS = 1e-6
B, H, D = 2, 4, 16


def _randn(*shape, dtype=torch.float32, seed=0, grad=True):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return t.requires_grad_(grad)


def hf_norm(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), -1)


def complex_rope(x, freqs_cis):  # Llama's reference: tables as complex numbers
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis).flatten(-2).type_as(x)


def _freqs_cis(s):
    angles = _randn(s, D // 2, seed=7, grad=False)
    return torch.polar(torch.ones_like(angles), angles).view(1, s, 1, D // 2)


# -- the programs: (inputs, fn) -----------------------------------------------------------

def frozen_input_norm():
    """A norm whose input takes no gradient while its weight does (frozen embeddings, norm-only
    tuning): ``rms_norm_grad`` with its dgamma alone, ones for the weight (issue 30)."""
    x, w = _randn(B, 8, 64, dtype=torch.bfloat16, grad=False), _randn(64, dtype=torch.bfloat16, seed=1)
    return [x, w], hf_norm


def complex_rope_s5():
    """A complex ``freqs_cis`` rotation over 5 positions: its tables rebuilt from the complex
    one's real view (issue 30: Inductor refused ``aten.stack``)."""
    return [_randn(B, 5, H, D)], lambda q, f=_freqs_cis(5): complex_rope(q, f)


def complex_rope_s1():
    """The same over one position (issue 30: ``aten.repeat_interleave.self_int``)."""
    return [_randn(B, 1, H, D, dtype=torch.bfloat16)], lambda q, f=_freqs_cis(1): complex_rope(q, f)


def norms_without_weight_or_input_gradient():
    """Three norms, each emitting ops of its own.

    A norm without weight (ones made with ``full``) whose input's gradient also flows past it
    (the fused dx added to the rest), in float16 with float32 statistics; a frozen input under a
    weight of keep-dim shape (dgamma viewed back to it); and a bfloat16 input the fused ops read
    where the unfused backward read its float32 copy (the caller may update it in place: a copy
    made in the forward, ``x * 1``)."""
    x, frozen = _randn(B, 8, 64, dtype=torch.float16, seed=2), _randn(B, 8, 64, seed=12, grad=False)
    w, y, v = _randn(1, 1, 64, seed=13), _randn(B, 8, 64, dtype=torch.bfloat16, seed=15), _randn(64, seed=16)

    def fn(x, w, y, v):
        xf = x.float()
        weightless = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) + x * x
        return weightless, hf_norm(frozen, w), hf_norm(y, v.to(y.dtype))
    return [x, w, y, v], fn


def rotations_of_rebuilt_tables():
    """Rotations whose tables the fused op needs at full width, rebuilt from what the program reads.

    Halves
    (``x1 * c - x2 * s, x2 * c + x1 * s`` concatenated: ``cat``), pairs (GPT-J's interleaved
    rotation of tables repeated element-wise), and a sine read negated
    (``x * cos - rotate_half(x) * -sin``)."""
    angles = _randn(6, D // 2, seed=8, grad=False)
    c, s = angles.cos(), angles.sin()
    cos, sin = torch.cat((c, c), -1), torch.cat((s, s), -1)

    def fn(q, k, v):
        h = D // 2
        halves = torch.cat((q[..., :h] * c - q[..., h:] * s, q[..., h:] * c + q[..., :h] * s), -1)
        x1, x2 = k[..., ::2], k[..., 1::2]
        pairs = k * c.repeat_interleave(2, -1) + torch.stack((-x2, x1), -1).flatten(-2) * s.repeat_interleave(2, -1)
        return halves, pairs, v * cos - rotate_half(v) * -sin
    return [_randn(B, H, 6, D, seed=seed) for seed in (3, 4, 14)], fn


def norm_and_rope_in_another_memory_order():
    """Gemma 3's q norm on a transposed view, then the rotation; and a rotation whose axis is not
    innermost in memory (run in the shape's order, its output copied into the program's layout)."""
    w = _randn(D, seed=5)
    angles = _randn(5, D, seed=10, grad=False)
    cos, sin = angles.cos(), angles.sin()

    def fn(q, p):
        heads = q.view(B, 5, H, D).transpose(1, 2)
        rotated = hf_norm(heads, w) * cos + rotate_half(hf_norm(heads, w)) * sin
        zaya = torch.sin(p.view(B, H, D, 5).transpose(2, 3))
        return rotated, (zaya * cos + rotate_half(zaya) * sin) * 2
    return [_randn(B, 5, H * D, seed=6), _randn(B, H * D * 5, seed=11)], fn


def norm_divided_by_its_root():
    """``x / sqrt(mean(x*x) + eps)`` fused both ways: the backward's rstd, the root's power, is the forward's fused rstd."""
    x, w = _randn(B, 8, 64, seed=17), _randn(64, seed=18)

    def fn(x, w):
        xf = x.float()
        return w * (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    return [x, w], fn


def norms_returning_their_statistics():
    """Two ``x / sqrt(mean(x*x) + eps)`` norms whose outputs add their root and their mean square (detached).

    The first fuses both ways and reads its root as the reciprocal of the fused rstd (``reciprocal``);
    the second's forward stays (the fused op has no mean square to give, a recorded miss) and its
    fused backward reads the saved root's power as its rstd (``pow``). (Where both ways fuse, the backward's
    power of the root is the fused rstd itself, and nothing of either stays.)"""
    x1, x2, w = _randn(B, 8, 64, seed=23), _randn(B, 8, 64, seed=24), _randn(64, seed=25)

    def fn(x1, x2, w):
        ms1, ms2 = x1.pow(2).mean(-1, keepdim=True), x2.pow(2).mean(-1, keepdim=True)
        root1, root2 = torch.sqrt(ms1 + EPS), torch.sqrt(ms2 + EPS)
        return w * (x1 / root1) + root1.detach(), w * (x2 / root2) + ms2.detach()
    return [x1, x2, w], fn


def gate_up_swiglu():
    """Phi-3's MLP in bf16 (``gate_up_proj(x).chunk(2, -1)``): ``swiglu`` and ``swiglu_grad``, on the
    SiLU the pass puts back where Inductor decomposed it."""
    x = _randn(B, 8, 32, dtype=torch.bfloat16, seed=19)
    w = (_randn(32, 64, seed=20, grad=False) / 4).to(torch.bfloat16).requires_grad_()

    def fn(x, w):
        gate, up = (x @ w).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return [x, w], fn


def rope_of_a_3d_q():
    """A rotation of q ``[B*H, S, D]`` (heads folded into the batch) by ``[S, D]`` tables: the fused ops
    run as BNSD with an axis of size 1 inserted (``unsqueeze``) and dropped again (``squeeze``; from the
    tables' gradients their leading axes too)."""
    q, emb = _randn(B * 2, 8, 16, seed=21), _randn(8, 8, seed=22)  # learned angles: the tables take gradients

    def fn(q, emb):
        cos, sin = torch.cat((emb, emb), -1).cos(), torch.cat((emb, emb), -1).sin()
        return q * cos + rotate_half(q) * sin
    return [q, emb], fn


PROGRAMS = {f.__name__: f for f in (frozen_input_norm, complex_rope_s5, complex_rope_s1, norm_divided_by_its_root,
                                      norms_returning_their_statistics,
                                      norms_without_weight_or_input_gradient, rotations_of_rebuilt_tables,
                                      norm_and_rope_in_another_memory_order, gate_up_swiglu, rope_of_a_3d_q)}


@pytest.fixture(scope="module")
def installed():
    """The pass installed in Inductor, the compile caches off (a cache hit would skip the pass)."""
    before = inductor_config().joint_custom_pre_pass
    npu_fusion.install_inductor(target="generic", strict=True, swiglu=True, swiglu_forward=True)
    with no_compile_caches(), views_checked() as unaliased:
        yield
    assert all(views == [] for views in unaliased), unaliased  # the pass's views alias their inputs
    uninstall_inductor()
    assert inductor_config().joint_custom_pre_pass is before
    torch._dynamo.reset()


@functools.lru_cache(maxsize=None)
def compiled_run(name: str):
    """Compile program ``name`` through Inductor, check its outputs and gradients by the float64
    criterion; returns ({op emitted: count}, fused site ops)."""
    inputs, fn = PROGRAMS[name]()
    params = [t for t in inputs if t.requires_grad]
    torch._dynamo.reset()
    mark = HISTORY.mark()
    compiled = torch.compile(fn, backend="inductor")
    with torch.no_grad():
        eager, exact, got = fn(*inputs), float64_output(fn, inputs, ()), compiled(*inputs)
    as_tuple = lambda o: o if isinstance(o, (tuple, list)) else (o,)  # noqa: E731
    for g, e, x in zip(as_tuple(got), as_tuple(eager), as_tuple(exact)):
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, e.dtype, g.shape, e.shape)
        assert_close_as_unfused(g, e, x, factor=MODEL_FACTOR)
    check_gradients(compiled, fn, inputs)
    results = HISTORY.since(mark)
    emitted = {}
    for result in results:
        assert result.error is None, result.error
        for target, count in result.emitted.items():
            emitted[target] = emitted.get(target, 0) + count
    return emitted, sorted(s.op for r in results for s in r.sites)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_program_compiles_through_inductor_with_fused_sites(installed, name):
    """Each program compiles with the pass (the reproducers of issue 30 raised in Inductor's
    lowering), fuses, and keeps outputs and gradients by the float64 criterion."""
    emitted, sites = compiled_run(name)
    assert sites and emitted, (sites, emitted)


def test_every_emittable_op_is_compiled_by_inductor(installed):
    """Every op the pass's sources can emit is emitted by a program compiled here."""
    ops, unknown = scan()
    assert not unknown, f"calls that insert an op the scan cannot name: {unknown}"
    compiled = set().union(*(compiled_run(name)[0] for name in PROGRAMS))
    missing = sorted(emittable_targets() - compiled)
    assert not missing, "emitted by no program compiled through Inductor: " + "; ".join(
        f"{op} (at {', '.join(ops.get(op, ['the fused-op registry']))})" for op in missing)


def test_scan_names_every_spelled_emit_and_reports_any_other(tmp_path):
    """The scan is what makes the list complete: it finds targets spelled in either form of the
    helper's call, in any expression, and reports a target it cannot name."""
    patterns = tmp_path / "patterns"
    patterns.mkdir()
    (tmp_path / "plugin").mkdir()
    (patterns / "rule.py").write_text(
        "def emit(edit, graph, fake_mode, node, which, op):\n"
        "    edit.call(aten.erf.default, (node,))\n"
        "    call(graph, fake_mode, torch.ops.prims.convert_element_type.default, (node, None))\n"
        "    edit.call(*((aten.select.int, (node, 0, 0)) if which else (aten.slice.Tensor, (node, 0, 0, 1))))\n"
        "    edit.call(op.overload, (node,))\n"
        "    edit.call(node.target, (node,))\n")
    ops, unknown = scan(tmp_path)
    assert sorted(ops) == ["aten.erf.default", "aten.select.int", "aten.slice.Tensor",
                           "prims.convert_element_type.default"]
    assert unknown == [f"{tmp_path.name}/patterns/rule.py:6: node.target"], unknown
