"""``dynamic=True`` passes Python floats as graph inputs: the backend specializes a norm's eps
under a guard (:mod:`npu_fusion.plugin.specialize`), and nothing else."""
import pytest
import torch

from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_grads, run_grads
from npu_fusion.plugin.backend import aot_backend
from npu_fusion.plugin.options import FusionOptions
from npu_fusion_testing.aliasing import views_checked


def norm(x, w, eps, scale):
    """An fp32-statistic RMSNorm whose eps and output scale are floats the caller passes."""
    xf = x.float()
    return (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)) * scale


def test_eps_is_specialized_under_a_guard_and_a_scale_stays_symbolic():
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)).requires_grad_()
    w = torch.randn(32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    results = []
    options = FusionOptions.from_mapping({"strict": True, "target": "generic"})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(norm, backend=aot_backend(options, lambda gm, run: results.append(run())),
                             dynamic=True)
    for eps, scale in ((1e-6, 0.5), (1e-6, 3.0), (1e-2, 3.0)):
        fn = lambda x, w: norm(x, w, eps, scale)  # noqa: E731
        got, grad_outputs = run_grads(lambda x, w: compiled(x, w, eps, scale), [x, w])
        eager, _ = run_grads(fn, [x, w], (), grad_outputs)
        for g, e, exact in zip(got, eager, float64_grads(fn, [x, w], (), grad_outputs)):
            assert g.dtype == e.dtype and g.shape == e.shape
            assert_close_as_unfused(g, e, exact, factor=MODEL_FACTOR)
    # another scale ran the first graph (it stays an input); another eps failed the guard and recompiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert len(results) == 2 and all(r.fused("rms_norm") == r.fused("rms_norm_grad") == 1 for r in results)
    assert not any(r.misses for r in results)


def test_without_the_forward_rule_nothing_is_specialized():
    """With ``rms_norm_forward`` off no fused op takes eps as a number: no guard, no recompile."""
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
    w = torch.randn(32, generator=torch.Generator().manual_seed(1)).requires_grad_()
    options = FusionOptions.from_mapping({"strict": True, "target": "generic", "rms_norm_forward": False})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(norm, backend=aot_backend(options), dynamic=True)
    for eps in (1e-6, 1e-2):
        out = compiled(x, w, eps, 2.0)
        torch.testing.assert_close(out, norm(x, w, eps, 2.0))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(q, cos, sin):
    """HF's rotation of q ``[B, N, S, D]`` with tables ``[S, D]`` the caller passes."""
    return q * cos + rotate_half(q) * sin


def _assert_rope_right(compiled, b, s, seed, table_lead=(), mark=None):
    """``compiled`` (of :func:`rope`) on q ``[b, 4, s, 16]`` and tables ``[*table_lead, s, 16]``: its
    output and gradients, in eager's dtypes and shapes, pass the float64 criterion. ``mark(q, cos,
    sin)``, where given, marks their sizes dynamic before the call."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 4, s, 16, generator=g).requires_grad_()
    angles = torch.randn(*table_lead, s, 16, generator=g)
    inputs = [q, angles.cos(), angles.sin()]
    if mark is not None:
        mark(*inputs)
    got, grad_outputs = run_grads(compiled, inputs)
    eager, _ = run_grads(rope, inputs, (), grad_outputs)
    for f, e, exact in zip(got, eager, float64_grads(rope, inputs, (), grad_outputs)):
        assert f.dtype == e.dtype and f.shape == e.shape
        assert_close_as_unfused(f, e, exact, factor=MODEL_FACTOR)


def marking(mark, head_dim=False, **range_of_batch):
    """A ``mark`` of :func:`_assert_rope_right`: Dynamo's ``mark`` (``mark_dynamic``, ``maybe_mark_dynamic``)
    on q's batch and sequence and the tables' (per-batch tables: their batch too), with ``head_dim``
    the head dim of all three; ``range_of_batch`` (``min``, ``max``) goes to q's batch's mark."""
    def mark_sizes(q, cos, sin):
        mark(q, 0, **range_of_batch)
        for tensor in (q, cos, sin):
            mark(tensor, tensor.dim() - 2)
            if head_dim:
                mark(tensor, tensor.dim() - 1)
        for table in (cos, sin):
            if table.dim() == 4:
                mark(table, 0, **range_of_batch)
    return mark_sizes


def test_head_dim_is_specialized_under_a_guard_and_batch_and_sequence_stay_symbolic():
    """``dynamic=True`` makes q's head dim symbolic: the pass guards it to its value (the fused op
    is proved per position of a static head dim), so the rotation fuses both ways, and another
    batch and sequence length run the same graph."""
    results = []
    options = FusionOptions.from_mapping({"strict": True, "target": "generic"})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(rope, backend=aot_backend(options, lambda gm, run: results.append(run())), dynamic=True)
    for seed, (b, s) in enumerate(((2, 6), (3, 9))):
        _assert_rope_right(compiled, b, s, seed)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "another batch and sequence recompiled"
    assert len(results) == 1 and not results[0].misses, results[0].misses
    assert results[0].fused("rotary_position_embedding") == results[0].fused("rotary_position_embedding_grad") == 1


def _compiled_rope(target, results, dynamic=None):
    """:func:`rope` compiled by the pass for ``target``, each graph's result appended to ``results``; Dynamo's counters cleared."""
    options = FusionOptions.from_mapping({"strict": True, "target": target})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch.compile(rope, backend=aot_backend(options, lambda gm, run: results.append(run())), dynamic=dynamic)


def test_head_dim_marked_with_maybe_mark_dynamic_is_guarded():
    """``maybe_mark_dynamic`` lets a compiler specialize the size it marks (``mark_dynamic`` does not):
    the pass guards a head dim marked so, as under ``dynamic=True``; the rotation fuses both ways and
    another batch and sequence length, marked the same way, reuse the graph."""
    results = []
    compiled = _compiled_rope("generic", results)
    for seed, (b, s) in enumerate(((2, 6), (3, 9))):
        _assert_rope_right(compiled, b, s, seed, mark=marking(torch._dynamo.maybe_mark_dynamic, head_dim=True))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "another batch and sequence recompiled"
    assert len(results) == 1 and not results[0].misses, results[0].misses
    assert results[0].fused("rotary_position_embedding") == results[0].fused("rotary_position_embedding_grad") == 1


def test_head_dim_marked_dynamic_is_one_recorded_miss_naming_the_axis():
    """``mark_dynamic`` forbids the guard that would keep the head dim static (Dynamo raises on one
    that pins the size to a value), and the pass proves RoPE per position of a static head dim: the
    rotation stays, its forward and its backward each one recorded miss that names the axis marked
    and what to change. No guard is made (the compile does not fail), the results are right, and
    another batch and sequence length reuse the graph."""
    from npu_fusion.patterns.rope.sites import SYMBOLIC_MOVES as FORWARD_MOVES
    from npu_fusion.patterns.rope_grad.sites import SYMBOLIC_MOVES as BACKWARD_MOVES
    from npu_fusion.patterns.rotation import symbolic_head_dim_reason

    results = []
    compiled = _compiled_rope("generic", results)
    for seed, (b, s) in enumerate(((2, 6), (3, 9))):
        _assert_rope_right(compiled, b, s, seed, mark=marking(torch._dynamo.mark_dynamic, head_dim=True))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "another batch and sequence recompiled"
    (result,) = results
    assert not result.fused("rotary_position_embedding") and not result.fused("rotary_position_embedding_grad")
    marked = "L['q'].size()[3]"
    assert sorted((m.op, m.reason) for m in result.misses) == [
        ("rotary_position_embedding", symbolic_head_dim_reason(FORWARD_MOVES, marked)),
        ("rotary_position_embedding_grad", symbolic_head_dim_reason(BACKWARD_MOVES, marked))]
    assert "drop mark_dynamic on that axis, or mark it with maybe_mark_dynamic" in result.misses[0].reason


#: A2's RoPE limits on a symbolic batch (name: the tables' leading sizes for (b, s), the calls' (batch,
#: sequence), the last beyond the limit, and how the miss for it begins)
A2_LIMITS = {
    "batch_below_1000": (lambda b, s: (), ((2, 6), (3, 9), (1000, 2)), "A2/A3 half mode needs B < 1000"),
    "batch_below_sequence": (lambda b, s: (b, 1), ((2, 6), (3, 9), (7, 5)), "A2/A3 need B < S for B1SD"),
}


#: how a test makes the batch and sequence symbolic: ``torch.compile``'s ``dynamic``, and a mark of the inputs
DYNAMIC_SIZES = {"dynamic_true": (True, None), "mark_dynamic": (None, marking(torch._dynamo.mark_dynamic)),
                 "maybe_mark_dynamic": (None, marking(torch._dynamo.maybe_mark_dynamic))}


@pytest.mark.parametrize("sizes", sorted(DYNAMIC_SIZES))
@pytest.mark.parametrize("limit", sorted(A2_LIMITS))
def test_a2_limit_is_kept_under_a_guard_and_a_call_beyond_it_recompiles(limit, sizes):
    """On A2 fused RoPE needs B < 1000 (half mode) and, with per-batch (B1SD) tables, B < S, which
    symbolic sizes cannot be proved to keep: the pass keeps the limit under a guard the example
    sizes satisfy, so the rotation fuses both ways and another batch and sequence within it reuse
    the graph; a call beyond it recompiles instead of reaching the op, is right, and its rotation's
    forward and backward are each one recorded miss naming the limit its example breaks. Sizes
    marked with ``mark_dynamic`` take the guard too: their constraint forbids a guard that pins
    them to one value, and these leave them many."""
    lead, shapes, reason = A2_LIMITS[limit]
    dynamic, mark = DYNAMIC_SIZES[sizes]
    results = []
    compiled = _compiled_rope("a2", results, dynamic)
    for seed, (b, s) in enumerate(shapes):
        _assert_rope_right(compiled, b, s, seed, lead(b, s), mark)
        if seed == 1:
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "a call within the limit recompiled"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2, "a call beyond the limit reused the graph"
    within, beyond = results
    assert not within.misses, within.misses
    assert within.fused("rotary_position_embedding") == within.fused("rotary_position_embedding_grad") == 1
    assert not beyond.fused("rotary_position_embedding") and not beyond.fused("rotary_position_embedding_grad")
    assert sorted(m.op for m in beyond.misses) == ["rotary_position_embedding", "rotary_position_embedding_grad"]
    assert all(m.reason.startswith(reason) and "the example sizes break it" in m.reason
               for m in beyond.misses), beyond.misses


@pytest.mark.parametrize("most", [999, 5000])
def test_a2_limit_on_a_batch_marked_dynamic_with_a_range(most):
    """``mark_dynamic(q, 0, min=2, max=most)`` forbids every guard its range does not imply: a range
    within A2's B < 1000 proves the limit, and the rotation fuses both ways with no guard; a wider
    one leaves the rotation one recorded miss each way naming the axis marked and what to change.
    Either way the results are right and another batch and sequence length reuse the graph."""
    results = []
    compiled = _compiled_rope("a2", results)
    for seed, (b, s) in enumerate(((2, 6), (3, 9))):
        _assert_rope_right(compiled, b, s, seed, mark=marking(torch._dynamo.mark_dynamic, min=2, max=most))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "another batch and sequence recompiled"
    (result,) = results
    if most < 1000:
        assert not result.misses, result.misses
        assert result.fused("rotary_position_embedding") == result.fused("rotary_position_embedding_grad") == 1
        return
    assert not result.fused("rotary_position_embedding") and not result.fused("rotary_position_embedding_grad")
    assert sorted(m.op for m in result.misses) == ["rotary_position_embedding", "rotary_position_embedding_grad"]
    assert all(m.reason.startswith("A2/A3 half mode needs B < 1000") and "L['q'].size()[0] is marked dynamic "
               "(mark_dynamic) with a range a guard on it would narrow: give mark_dynamic a min and max within "
               "the limit" in m.reason for m in result.misses), result.misses


def test_eps_passed_as_a_tensor_is_a_recorded_forward_miss():
    """An eps the caller passes as a tensor is data, not a constant: no guard can keep it, so the
    norm's forward stays (its backward, which reads no eps, fuses), recorded with the reason."""
    from npu_fusion.patterns.rms_norm.sites import EPS_TENSOR_REASON

    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
    w = torch.randn(32, generator=torch.Generator().manual_seed(1)).requires_grad_()
    eps = torch.tensor(1e-6)
    results = []
    options = FusionOptions.from_mapping({"strict": True, "target": "generic"})
    torch._dynamo.reset()
    compiled = torch.compile(norm, backend=aot_backend(options, lambda gm, run: results.append(run())))
    fn = lambda x, w: norm(x, w, eps, 1.0)  # noqa: E731
    got, grad_outputs = run_grads(lambda x, w: compiled(x, w, eps, 1.0), [x, w])
    eager, _ = run_grads(fn, [x, w], (), grad_outputs)
    for g, e, exact in zip(got, eager, float64_grads(fn, [x, w], (), grad_outputs)):
        assert_close_as_unfused(g, e, exact, factor=MODEL_FACTOR)
    (result,) = results
    assert result.fused("rms_norm_grad") == 1 and not result.fused("rms_norm")
    assert [m.reason for m in result.misses] == [EPS_TENSOR_REASON]


# -- the same through Inductor (install_inductor): a pre-grad hook specializes eps ------------------

def _dynamic_steps_through_inductor(model, loss, shapes, vocab):
    """Compile ``loss(ids)`` with Inductor under ``dynamic=True`` and take a step at each of ``shapes``:
    returns, per step, the pass's counters and whether the gradients met the float64 criterion."""
    import copy

    from npu_fusion.compat import no_compile_caches
    from npu_fusion.measure.grads import grad_failures
    from npu_fusion.plugin.pass_manager import COUNTER

    def grads(m, ids, run):
        m.zero_grad(set_to_none=True)
        run(m, ids).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    compiled = torch.compile(lambda m, ids: loss(m, ids), dynamic=True)
    steps = []
    with no_compile_caches():
        for seed, shape in enumerate(shapes):
            ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
            eager = grads(model, ids, loss)
            wide = copy.deepcopy(model).double()
            exact = grads(wide, ids, loss)
            fused = grads(model, ids, compiled)
            failures = grad_failures(fused, eager, {n: g.to(eager[n].dtype) for n, g in exact.items()}, MODEL_FACTOR)
            steps.append((dict(torch._dynamo.utils.counters[COUNTER]), failures))
    return steps


def _both_ways(norms, rotations, compiles=1):
    return {"rms_norm": compiles * norms, "rms_norm_grad": compiles * norms,
            "rotary_position_embedding": compiles * rotations, "rotary_position_embedding_grad": compiles * rotations}


@pytest.fixture
def inductor_installed():
    import npu_fusion
    from npu_fusion.compat import inductor_config
    from npu_fusion.plugin.inductor import uninstall_inductor

    before = inductor_config().pre_grad_custom_pass, inductor_config().pre_grad_pass_timing
    npu_fusion.install_inductor(target="generic", strict=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with views_checked() as unaliased:
        yield
    assert all(views == [] for views in unaliased), unaliased  # the pass's views alias their inputs
    uninstall_inductor()
    assert (inductor_config().pre_grad_custom_pass, inductor_config().pre_grad_pass_timing) == before
    torch._dynamo.reset()


def test_bundled_llama_through_inductor_dynamic_true(inductor_installed):
    """Inductor under ``dynamic=True``: the pre-grad hook specializes each norm's eps, the joint hook
    the head dim; every site fuses both ways, a second batch and sequence length reuse the graph,
    and a changed eps recompiles with the new value."""
    from npu_fusion.models import bundled

    model = bundled("llama", num_layers=1, dtype=torch.float32)
    norms, rotations = model.expected_sites["rms_norm_grad"], model.expected_sites["rotary_position_embedding_grad"]
    vocab = model.config.vocab_size
    steps = _dynamic_steps_through_inductor(model, lambda m, ids: m.loss(ids), [(2, 12), (3, 7)], vocab)
    assert [counters for counters, _ in steps] == [_both_ways(norms, rotations)] * 2
    assert [failures for _, failures in steps] == [[], []]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "another batch and sequence recompiled"
    for module in model.modules():
        if hasattr(module, "eps"):
            module.eps = 0.5
    ((counters, failures),) = _dynamic_steps_through_inductor(model, lambda m, ids: m.loss(ids), [(2, 12)], vocab)
    assert failures == [] and counters == _both_ways(norms, rotations, compiles=2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2, "a changed eps did not recompile"


def test_transformers_llama_through_inductor_dynamic_true(inductor_installed):
    """A transformers Llama (its eps a module attribute, ``variance_epsilon``) through Inductor under
    ``dynamic=True``: every site fused both ways, no recompile at another batch and sequence length."""
    transformers = pytest.importorskip("transformers")

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    steps = _dynamic_steps_through_inductor(model, lambda m, ids: m(input_ids=ids, labels=ids).loss,
                                            [(2, 12), (3, 7)], 96)
    assert [counters for counters, _ in steps] == [_both_ways(norms=3, rotations=2)] * 2
    assert [failures for _, failures in steps] == [[], []]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "another batch and sequence recompiled"


def test_head_dim_through_inductor_dynamic_true(inductor_installed):
    """q a graph input whose head dim ``dynamic=True`` makes symbolic: Inductor's joint hook guards it
    (the pre-grad hook leaves sizes alone), the rotation fuses both ways and another batch and
    sequence length reuse the graph."""
    from npu_fusion.compat import no_compile_caches
    from npu_fusion.plugin.pass_manager import COUNTER

    compiled = torch.compile(rope, dynamic=True)
    with no_compile_caches():
        for seed, (b, s) in enumerate(((2, 6), (3, 9))):
            _assert_rope_right(compiled, b, s, seed)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "another batch and sequence recompiled"
    assert dict(torch._dynamo.utils.counters[COUNTER]) == {"rotary_position_embedding": 1,
                                                           "rotary_position_embedding_grad": 1}
