"""``dynamic=True`` through torchair's backend after ``npu_fusion.install`` (CANN stubbed).

Dynamo passes each norm's float eps as a 0-d tensor input; ``npu_fusion.get_npu_backend`` (torchair's
backend behind :mod:`npu_fusion.plugin.specialize`) specializes it under a guard before AOTAutograd,
and the pass guards the head dim on the graphs compiled while Dynamo still makes guards. The bundled
Llama and a transformers Llama: every site fused, outputs and gradients by the float64 criterion, no
recompile at another batch and sequence length, a changed eps recompiled."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import npu_fusion
from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, grad_failures
from npu_fusion.plugin import pass_manager

#: (batch, sequence) of the two calls: sequence lengths other than the head dim (16), which
#: ``dynamic=True`` would give the head dim's symbol (duck sizing)
SHAPES = [(2, 12), (3, 7)]


def _bundled():
    from npu_fusion.models import bundled

    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = bundled("llama", num_layers=1, dtype=torch.float32)
    sites = model.expected_sites["rms_norm_grad"], model.expected_sites["rotary_position_embedding_grad"]

    def loss(m, ids):  # the CPU's attention kernels have no GE converter: its composite form, ops GE has
        with sdpa_kernel(SDPBackend.MATH):
            return m.loss(ids)
    return model, lambda m, ids: m(ids), loss, model.config.vocab_size, sites, "eps"


def _transformers():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    return (model, lambda m, ids: m(input_ids=ids).logits, lambda m, ids: m(input_ids=ids, labels=ids).loss, 96,
            (3, 2), "variance_epsilon")


MODELS = {"bundled": _bundled, "transformers": _transformers}


def _compile(ge, fn, target="950"):
    config = npu_fusion.install(ge.config(), target=target, strict=True)
    # the CPU's attention kernel and silu's backward have no GE converter in the wheel's torchair
    # (torch_npu lowers its own): decomposed (the attention's backward: its math form, in the loss)
    cpu_ops = torch._decomp.get_decompositions([torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                                                torch.ops.aten.silu_backward])
    backend = npu_fusion.get_npu_backend(compiler_config=config, custom_decompositions=cpu_ops)
    warnings.filterwarnings("ignore", message="Your compiler for AOTAutograd", category=UserWarning)
    torch._dynamo.utils.counters.clear()
    return torch.compile(fn, backend=backend, dynamic=True)


def _ids(vocab, shape, seed):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


#: the targets: the 950 has no RoPE size limits; A2/A3's (B < 1000, B < S for per-batch tables) are
#: kept under guards the example sizes satisfy (docs/dynamic-shapes.md)
TARGETS = ["950", "a2"]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_inference_fuses_every_site_and_does_not_recompile(ge, name, target):
    model, forward, _, vocab, (norms, rotations), eps_name = MODELS[name]()
    model.eval()
    compiled = _compile(ge, forward, target)
    mark = pass_manager.HISTORY.mark()

    def check(seed, shape):
        ids = _ids(vocab, shape, seed)
        with torch.no_grad():
            eager, exact = forward(model, ids), forward(copy.deepcopy(model).double(), ids)
            got = compiled(model, ids)
        assert got.dtype == eager.dtype and got.shape == eager.shape
        assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)

    for seed, shape in enumerate(SHAPES):
        check(seed, shape)
    results = pass_manager.HISTORY.since(mark)
    assert [r.graph for r in results] == ["inference"], results
    assert [m for r in results for m in r.misses] == []
    assert (results[0].fused("rms_norm"), results[0].fused("rotary_position_embedding")) == (norms, rotations)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "another batch and sequence recompiled"

    for module in model.modules():  # a changed eps: recompiled with it, not run with the old one
        if hasattr(module, eps_name):
            setattr(module, eps_name, 0.5)
    check(0, SHAPES[0])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2, "a changed eps did not recompile"
    assert [m for r in pass_manager.HISTORY.since(mark) for m in r.misses] == []


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_does_not_recompile_and_fuses_both_ways(ge, name, target):
    model, _, loss, vocab, (norms, rotations), _ = MODELS[name]()
    compiled = _compile(ge, loss, target)
    mark = pass_manager.HISTORY.mark()

    def grads(m, ids, run):
        m.zero_grad(set_to_none=True)
        run(m, ids).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    for seed, shape in enumerate(SHAPES):
        ids = _ids(vocab, shape, seed)
        eager = grads(model, ids, loss)
        exact = grads(copy.deepcopy(model).double(), ids, loss)
        assert grad_failures(grads(model, ids, compiled), eager, exact, MODEL_FACTOR) == []
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "another batch and sequence recompiled"
    results = pass_manager.HISTORY.since(mark)
    fused = {op: sum(r.fused(op) for r in results) for op in ("rms_norm", "rms_norm_grad", "rotary_position_embedding",
                                                              "rotary_position_embedding_grad")}
    assert fused == {"rms_norm": norms, "rms_norm_grad": norms, "rotary_position_embedding": rotations,
                     "rotary_position_embedding_grad": rotations}, fused
    assert [m for r in results for m in r.misses] == []


def rope(q, cos, sin):
    """HF's rotation of q ``[B, N, S, D]`` with tables ``[S, D]`` the caller passes: ``dynamic=True``
    makes q's head dim symbolic."""
    x1, x2 = q.chunk(2, dim=-1)
    return q * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_head_dim_of_an_input(ge, grad):
    """q a graph input, its head dim symbolic: the inference graph (compiled while Dynamo makes
    guards) guards it and fuses, with no recompile at another batch and sequence length. In training
    the forward, fused by torchair's post-partition hook while Dynamo still makes guards, guards the
    head dim, so the backward compiled later reads it static and fuses too; another head dim
    recompiles (Dynamo's automatic dynamic: the head dim symbolic again, with no constraint a guard
    could break), is guarded to its new value and fuses the same way, and stays right."""
    from npu_fusion.measure.grads import float64_grads, run_grads

    compiled = _compile(ge, rope)
    mark = pass_manager.HISTORY.mark()
    for seed, (b, s, d) in enumerate(((2, 6, 16), (3, 9, 16), (2, 5, 8))):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(b, 4, s, d, generator=g).requires_grad_(grad)
        angles = torch.randn(s, d, generator=g)
        inputs = [q, angles.cos(), angles.sin()]
        if grad:
            got, grad_outputs = run_grads(compiled, inputs)
            eager, _ = run_grads(rope, inputs, (), grad_outputs)
            exact = float64_grads(rope, inputs, (), grad_outputs)
        else:
            got, eager = [compiled(*inputs)], [rope(*inputs)]
            exact = [rope(*[t.double() for t in inputs])]
        for f, e, x in zip(got, eager, exact):
            assert f.dtype == e.dtype and f.shape == e.shape
            assert_close_as_unfused(f, e, x, factor=MODEL_FACTOR)
        if seed == 1:
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "another batch and sequence recompiled"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2, "another head dim reused the guarded graph"
    results = pass_manager.HISTORY.since(mark)
    fused = [(r.graph, r.fused("rotary_position_embedding"), r.fused("rotary_position_embedding_grad")) for r in results]
    first, second = results[:len(results) // 2], results[len(results) // 2:]
    for compiled_graphs in (first, second):  # the recompile for the new head dim guards it again
        fused = [(r.graph, r.fused("rotary_position_embedding"), r.fused("rotary_position_embedding_grad"))
                 for r in compiled_graphs]
        assert fused == ([("inference", 1, 0)] if not grad else [("forward", 1, 0), ("backward", 0, 1)]), fused
        assert [m for r in compiled_graphs for m in r.misses] == []


def test_get_npu_backend_needs_the_pass_installed(torchair):
    with pytest.raises(ValueError, match="install"):
        npu_fusion.get_npu_backend(compiler_config=torchair.CompilerConfig())
