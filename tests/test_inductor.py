"""The pass in stock Inductor on the CPU, through ``npu_fusion.install_inductor``: the fused ops
in the generated code (fallback kernels), gradients by the float64 criterion, no float32
``[B, S, H]`` upcast saved, and Hugging Face's Trainer with ``torch_compile_backend="inductor"``.
Inductor compiles are slow on a small machine: few, small models."""
import copy

import pytest
import torch

import npu_fusion
from npu_fusion.compat import inductor_config, no_compile_caches
from npu_fusion.plugin.inductor import uninstall_inductor
from npu_fusion.plugin.pass_manager import COUNTER
from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, grad_failures
from npu_fusion_testing.aliasing import views_checked
from npu_fusion_testing.in_place import UPDATED_PROGRAMS, refused, assert_updated_as_eager
from npu_fusion.lowering import FUSED_OPS
from npu_fusion.plugin.options import forward_options

B, S = 2, 8


@pytest.fixture
def installed():
    """The pass installed, and the compile caches off: a cache hit (from an earlier run of these
    tests) would skip Inductor's joint passes, the pass among them, and count no site. Every graph
    the pass rewrites keeps its views on their inputs' fake storage (checked at the end)."""
    before = inductor_config().joint_custom_pre_pass
    npu_fusion.install_inductor(target="generic", strict=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with no_compile_caches(), views_checked() as unaliased:
        yield
    assert all(views == [] for views in unaliased), unaliased  # the pass's views alias their inputs
    uninstall_inductor()
    assert inductor_config().joint_custom_pre_pass is before
    torch._dynamo.reset()


def _param_grads(model, step):
    model.zero_grad(set_to_none=True)
    step().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compiled_step(model, loss):
    """Run one compiled training step; returns (gradients, generated code, saved (dtype, shape)s)."""
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(loss)  # backend="inductor"
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    def step():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return compiled()
    grads, codes = run_and_get_code(lambda: _param_grads(model, step))
    return grads, "\n".join(codes), saved


def both_ways(norms: int, rotations: int) -> dict:
    """The sites fused by op: each norm and rotation forward and backward (the forward rules are on
    by default)."""
    return {"rms_norm_grad": norms, "rotary_position_embedding_grad": rotations, "rms_norm": norms,
            "rotary_position_embedding": rotations}


def _check(model, loss, hidden, sites):
    eager = _param_grads(model, loss)
    wide = copy.deepcopy(model).double()
    exact = _param_grads(wide, lambda: loss(wide))
    grads, code, saved = _compiled_step(model, loss)
    counters = torch._dynamo.utils.counters[COUNTER]
    assert dict(counters) == sites, dict(counters)
    assert "torch.ops.npu_fusion.rms_norm_grad.default" in code
    assert "torch.ops.npu_fusion.rotary_position_embedding_grad.default" in code
    assert "torch.ops.npu_fusion.rms_norm.default" in code
    assert "torch.ops.npu_fusion.rotary_position_embedding.default" in code
    assert not grad_failures(grads, eager, {n: g.to(eager[n].dtype) for n, g in exact.items()}, MODEL_FACTOR)
    return saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bundled_llama_through_inductor(installed, dtype):
    from npu_fusion.models import bundled

    model = bundled("llama", num_layers=1, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    saved = _check(model, lambda m=None: (m or model).loss(ids), 64,
                   both_ways(norms=3, rotations=2))
    if dtype == torch.bfloat16:
        assert not [k for k in saved if k[0] == torch.float32 and k[1] == (B, S, 64)], saved


FORWARD = dict.fromkeys(forward_options(), True)  # the forward rules' switches
BACKWARD_ALONE = dict.fromkeys(forward_options(), False)


def _fused_step(model, ids, options):
    """One compiled training step of ``model.loss`` with the pass installed with ``options``;
    returns (loss, gradients, generated code, the pass's counters, saved bytes)."""
    from torch._inductor.utils import run_and_get_code

    npu_fusion.install_inductor(target="generic", strict=True, **options)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model.loss)
    saved, out = [], {}

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    def step():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out["loss"] = compiled(ids)
        return out["loss"]
    with no_compile_caches():
        grads, codes = run_and_get_code(lambda: _param_grads(model, step))
    counters = dict(torch._dynamo.utils.counters[COUNTER])
    return out["loss"].detach(), grads, "\n".join(codes), counters, sum(saved)


def test_bundled_llama_forward_fused_through_inductor():
    """The forward options on the Inductor path (``install_inductor``, min-cut partition): every
    norm's and rotation's forward and backward fused in a bf16 Llama, the fused forward ops in the
    generated code, loss and gradients by the float64 criterion, and the saved set no larger than
    with the backward rules alone."""
    from npu_fusion.models import bundled

    model = bundled("llama", num_layers=1, dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    wide = bundled("llama", num_layers=1, dtype=torch.float64)
    wide.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    exact_loss = wide.loss(ids)
    exact = _param_grads(wide, lambda: wide.loss(ids))
    eager = _param_grads(model, lambda: model.loss(ids))
    try:
        loss, grads, code, counters, saved = _fused_step(model, ids, FORWARD)
        alone_loss, _, alone_code, alone_counters, saved_alone = _fused_step(model, ids, BACKWARD_ALONE)
    finally:
        uninstall_inductor()
        torch._dynamo.reset()
    norms, rotations = model.expected_sites["rms_norm_grad"], model.expected_sites["rotary_position_embedding_grad"]
    assert counters == {"rms_norm_grad": norms, "rotary_position_embedding_grad": rotations,
                        "rms_norm": norms, "rotary_position_embedding": rotations}, counters
    assert alone_counters == {"rms_norm_grad": norms, "rotary_position_embedding_grad": rotations}, alone_counters
    for op in (op.name for op in FUSED_OPS if op.name in counters):  # the model has no SwiGLU site
        assert f"torch.ops.npu_fusion.{op}.default" in code, op
    assert "torch.ops.npu_fusion.rms_norm.default" not in alone_code
    # the loss against the same Inductor program without the forward rules: Inductor's own bf16
    # code (upcasts kept in registers) already moves the loss ~30x further from float64 than eager
    assert_close_as_unfused(loss, alone_loss, exact_loss.detach(), factor=MODEL_FACTOR)
    assert not grad_failures(grads, eager, {n: g.to(eager[n].dtype) for n, g in exact.items()}, MODEL_FACTOR)
    assert saved <= saved_alone, (saved, saved_alone)


def _tiny_llama(dtype):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def test_transformers_llama_bf16_through_inductor(installed):
    model = _tiny_llama(torch.bfloat16)
    ids = torch.randint(0, 96, (B, S), generator=torch.Generator().manual_seed(1))
    saved = _check(model, lambda m=None: (m or model)(input_ids=ids, labels=ids).loss, 64,
                   both_ways(norms=5, rotations=4))
    assert not [k for k in saved if k[0] == torch.float32 and k[1] == (B, S, 64)], saved


def test_options_inductor_cannot_honour_are_errors():
    with pytest.raises(ValueError, match="partitioner"):
        npu_fusion.install_inductor(partitioner="default")


def test_reinstall_replaces_and_chains_an_existing_pass():
    calls = []

    def previous(graph):
        calls.append(graph)

    config = inductor_config()
    before = config.joint_custom_pre_pass
    try:
        config.joint_custom_pre_pass = previous
        first = npu_fusion.install_inductor(target="generic")
        second = npu_fusion.install_inductor(target="a2")
        assert second.previous is previous and first.previous is previous
        graph = torch.fx.Graph()
        graph.output(None)
        second(graph)  # not a joint graph: only the chained pass acts on it
        assert calls == [graph]
        assert second.uuid() is None  # the chained pass has no uuid: Inductor must not cache on ours
        config.joint_custom_pre_pass = None
        generic = npu_fusion.install_inductor(target="generic").uuid()
        assert generic is not None and npu_fusion.install_inductor(target="generic").uuid() == generic
        assert npu_fusion.install_inductor(target="a2").uuid() != npu_fusion.install_inductor(target="generic").uuid()
    finally:
        uninstall_inductor()  # the pre-grad pass too
        config.joint_custom_pre_pass = before


def test_pre_grad_pass_chains_an_existing_one_and_uninstalls_to_it():
    """The specializing pass in ``pre_grad_custom_pass``: a pass already there runs first, installing
    again does not stack ours, and uninstalling leaves the user's (and the timing as it was)."""
    from npu_fusion.plugin.inductor import NpuFusionPreGradPass

    calls = []

    def previous(graph):
        calls.append(graph)

    config = inductor_config()
    before = config.pre_grad_custom_pass, config.pre_grad_pass_timing
    try:
        config.pre_grad_custom_pass = previous
        npu_fusion.install_inductor(target="generic")
        npu_fusion.install_inductor(target="a2")
        ours = config.pre_grad_custom_pass
        assert isinstance(ours, NpuFusionPreGradPass) and ours.previous is previous
        assert not hasattr(ours, "uuid")  # run before the caches' lookups, so a hit still guards eps
        assert config.pre_grad_pass_timing == "early"
        gm = torch.fx.symbolic_trace(lambda x: x + 1)  # not Dynamo's graph: left as it is
        ours(gm.graph)
        assert calls == [gm.graph]
        npu_fusion.install_inductor(target="generic", rms_norm_forward=False)  # no fused op reads eps
        assert config.pre_grad_custom_pass is previous
        uninstall_inductor()
        assert (config.pre_grad_custom_pass, config.pre_grad_pass_timing) == (previous, before[1])
    finally:
        uninstall_inductor()
        config.pre_grad_custom_pass, config.pre_grad_pass_timing = before


def test_hugging_face_trainer_with_the_inductor_backend(installed, tmp_path):
    """Trainer accepts only its list of backend names; "inductor" is one: after the install, one
    training step fuses every site, with the gradients the optimizer gets checked."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = _tiny_llama(torch.float32)
    ids = torch.randint(0, 96, (B, S), generator=torch.Generator().manual_seed(1))
    eager = _param_grads(model, lambda: model(input_ids=ids, labels=ids).loss)
    wide = copy.deepcopy(model).double()
    exact = _param_grads(wide, lambda: wide(input_ids=ids, labels=ids).loss)
    seen = {}

    class KeepGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            seen.update({n: p.grad.detach().clone() for n, p in kwargs["model"].named_parameters()
                         if p.grad is not None})

    args = TrainingArguments(output_dir=str(tmp_path), torch_compile=True, torch_compile_backend="inductor",
                             use_cpu=True, max_steps=1, per_device_train_batch_size=B, report_to=[],
                             save_strategy="no", learning_rate=0.0, max_grad_norm=0.0)
    data = [{"input_ids": row, "labels": row} for row in ids]
    model.zero_grad(set_to_none=True)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[KeepGradients()]).train()
    counters = torch._dynamo.utils.counters[COUNTER]
    assert dict(counters) == both_ways(norms=5, rotations=4), dict(counters)
    seen = {n.removeprefix("_orig_mod."): g for n, g in seen.items()}
    assert not grad_failures(seen, eager, {n: g.float() for n, g in exact.items()}, MODEL_FACTOR)


def test_caller_updating_the_input_in_place_before_backward(installed):
    """Legal in eager and unfused through Inductor; still legal with the pass: the fused op reads a
    copy of the caller's tensor (``x * 1``, which Inductor keeps), with the gradients of x as it was."""
    from npu_fusion.measure.grads import assert_close_as_unfused
    from npu_fusion_testing.in_place import grads_after_updating_the_input as updated, hf_rms_norm

    expected, exact = updated(hf_rms_norm), updated(hf_rms_norm, torch.float64)
    got = updated(torch.compile(hf_rms_norm))
    assert dict(torch._dynamo.utils.counters[COUNTER]) == {"rms_norm_grad": 1, "rms_norm": 1}
    for g, e, x in zip(got, expected, exact):
        assert_close_as_unfused(g, e, x, factor=MODEL_FACTOR)


def test_compile_caches_keep_the_fused_code_and_key_on_the_options():
    """A cache hit skips Inductor's joint passes, the pass among them (no result, no counter),
    and loads the code compiled with it: the fused op is still there. Changing an option changes
    the pass's uuid, so the cached fused code is not reused for a program that asks for no fusion."""
    from torch._inductor.utils import run_and_get_code

    from npu_fusion.compat import fresh_compile_caches
    from npu_fusion.plugin.pass_manager import HISTORY
    from npu_fusion_testing.in_place import hf_rms_norm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, 64, generator=gen).requires_grad_()
    w = torch.randn(64, generator=gen).requires_grad_()

    def compile_and_run(**options):
        npu_fusion.install_inductor(target="generic", **options)
        torch._dynamo.reset()
        mark = HISTORY.mark()
        compiled = torch.compile(hf_rms_norm)
        _, codes = run_and_get_code(lambda: compiled(x, w).sum().backward())
        return len(HISTORY.since(mark)), "torch.ops.npu_fusion.rms_norm_grad.default" in "\n".join(codes)

    try:
        with fresh_compile_caches():
            assert compile_and_run() == (1, True)
            assert compile_and_run() == (0, True)  # a hit: no pass ran, the fused code came back
            assert compile_and_run(rms_norm=False) == (1, False)
    finally:
        uninstall_inductor()
        torch._dynamo.reset()


_UPDATED = [pytest.param(p, d, id=f"{p.name}-{str(d)[6:]}") for p in UPDATED_PROGRAMS for d in p.legal]


_REFUSED = [pytest.param(p, torch.float32, id=p.name) for p in UPDATED_PROGRAMS if torch.float32 not in p.legal]


@pytest.mark.parametrize("program, dtype", _REFUSED)
def test_caller_update_eager_refuses_is_refused_as_stock(installed, program, dtype):
    """Every program of ``tests/test_in_place.py`` whose update eager refuses in float32, through
    Inductor: with the pass it is refused wherever stock Inductor refuses it (Inductor's aliases of
    a saved tensor have version counters of their own: only the caller's tensor itself guards)."""
    with inductor_config().patch(joint_custom_pre_pass=None):
        stock = torch.compile(program.fn)
        stock_refused = refused(lambda: program.run(stock, dtype))
    torch._dynamo.reset()
    assert refused(lambda: program.run(torch.compile(program.fn), dtype)) or not stock_refused
    assert any(n for op, n in torch._dynamo.utils.counters[COUNTER].items() if not op.endswith("_missed"))


@pytest.mark.parametrize("program, dtype", _UPDATED)
def test_caller_updates_in_place_what_it_holds(installed, program, dtype):
    """Every program of ``tests/test_in_place.py`` through Inductor with the pass (min-cut, the
    copy Inductor keeps): no raise where eager allows the update, outputs and gradients by the
    float64 criterion, every site fused as on the backend."""
    assert_updated_as_eager(torch.compile(program.fn), program, dtype, factor=MODEL_FACTOR)
    counters = dict(torch._dynamo.utils.counters[COUNTER])
    fused = {op: n for op, n in counters.items() if not op.endswith("_missed")}
    assert fused == {op: n for op, n in program.fused.items() if n}, counters
