"""End to end on real model code from transformers: tiny random-weight causal LMs (Llama, and
Qwen2 and Mistral under autocast) compiled with backend="npu_fusion", forward and backward."""
import contextlib
import copy
import sys

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from npu_fusion.plugin.pass_manager import COUNTER, HISTORY
from npu_fusion_testing.capture import Capture, decomposed_leftovers
from npu_fusion.measure.grads import assert_close_as_unfused, grad_failures

def tiny_llama(dtype, layers=2, seed=0):
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype)


@contextlib.contextmanager
def count_sites(model):
    """Count RMSNorm calls and RoPE applications in an eager run, independently of the pass:
    forward hooks on the model's ``*RMSNorm`` modules, and a counting wrapper around its
    modeling module's apply_rotary_pos_emb (one call rotates q and k: two applications)."""
    modeling = sys.modules[type(model).__module__]
    counts = {"rms_norm": 0, "rope": 0}
    hooks = [m.register_forward_hook(lambda *_: counts.__setitem__("rms_norm", counts["rms_norm"] + 1))
             for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    original = modeling.apply_rotary_pos_emb

    def counting(*args, **kwargs):
        counts["rope"] += 2
        return original(*args, **kwargs)

    modeling.apply_rotary_pos_emb = counting
    try:
        yield counts
    finally:
        modeling.apply_rotary_pos_emb = original
        for h in hooks:
            h.remove()


def param_grads(model, ids, run=None, autocast=None):
    """The parameters' gradients of one step; ``autocast``: the forward under
    ``torch.autocast("cpu", dtype=autocast)`` (mixed-precision training, fp32 master weights)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = (run if run is not None else model)(input_ids=ids, labels=ids).loss
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_tiny_llama_backward_is_fused_and_correct(dtype, dynamic):
    model = tiny_llama(dtype)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with count_sites(model) as expected:
        eager = param_grads(model, ids)
    assert expected == {"rms_norm": 5, "rope": 4}
    exact = param_grads(copy.deepcopy(model).double(), ids)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    capture = Capture()
    compiled = torch.compile(model, backend=capture)
    if dynamic:
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(ids, 1)
    fused = param_grads(model, ids, run=compiled)

    assert capture.fused("rms_norm_grad") == expected["rms_norm"]
    assert capture.fused("rotary_position_embedding_grad") == expected["rope"]
    after = capture.after_counts()
    assert after["rms_norm_grad.default"] == expected["rms_norm"]
    assert after["rotary_position_embedding_grad.default"] == expected["rope"]
    for graph in capture.after:
        assert not decomposed_leftovers(graph)
    for name, grad in fused.items():
        assert grad.dtype == eager[name].dtype and grad.shape == eager[name].shape
        assert_close_as_unfused(grad, eager[name], exact[name], factor=4.0)


def test_backend_by_name_uses_the_pass():
    model = tiny_llama(torch.float32, layers=1)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    seen = HISTORY.mark()
    compiled = torch.compile(model, backend="npu_fusion", options={"target": "generic"})
    compiled(input_ids=ids, labels=ids).loss.backward()
    assert torch._dynamo.utils.counters[COUNTER]["rms_norm_grad"] == 3
    assert torch._dynamo.utils.counters[COUNTER]["rotary_position_embedding_grad"] == 2
    assert HISTORY.since(seen) and all(r.target == "generic" for r in HISTORY.since(seen))


def tiny_causal_lm(architecture, kv_heads, seed=0):
    """A transformers causal LM of ``architecture`` (llama, qwen2, qwen3, mistral), fp32, 2 layers,
    4 attention heads and ``kv_heads`` key-value heads (2: grouped-query attention)."""
    config_class = transformers.AutoConfig.for_model(architecture).__class__
    config = config_class(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
                          num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64)
    config._attn_implementation = "eager"  # transformers' own repeat_kv: GQA's k expanded after RoPE
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("architecture, kv_heads, autocast, partitioner", [
    ("llama", 2, torch.bfloat16, "default"),
    ("llama", 2, torch.bfloat16, "min_cut"),
    ("llama", 2, torch.float16, "default"),
    ("llama", 4, torch.bfloat16, "default"),
    ("qwen2", 2, torch.bfloat16, "min_cut"),
    ("mistral", 2, torch.float16, "min_cut"),
    ("qwen3", 2, torch.bfloat16, "default"),
], ids=str)
def test_autocast_training_fuses_every_site(architecture, kv_heads, autocast, partitioner):
    """Mixed-precision training as Hugging Face's Trainer runs it (``bf16=True``): fp32 master
    weights, the forward under autocast. Under GQA, k's RoPE output stays fp32 (fp32 tables)
    through repeat_kv, so autograd rounds each of ``dy*cos`` and ``dy*sin`` to k's bf16 before
    summing them: roundings at the precision of dk itself, which the fused op's single rounding
    of the exact dk beats. Every site fuses, gradients within the float64 criterion. Qwen3's q/k
    norms read a bf16 input, round the normalized value to bf16 and multiply the fp32 weight: their
    float32 dgamma reads that rounding, so it is left to the program (a note), and dx fuses."""
    model = tiny_causal_lm(architecture, kv_heads)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with count_sites(model) as expected:
        eager = param_grads(model, ids, autocast=autocast)
    qk_norms = 4 if architecture == "qwen3" else 0
    assert expected == {"rms_norm": 5 + qk_norms, "rope": 4}
    exact = param_grads(copy.deepcopy(model).double(), ids)

    torch._dynamo.reset()
    capture = Capture(target="generic", partitioner=partitioner)
    fused = param_grads(model, ids, run=torch.compile(model, backend=capture), autocast=autocast)

    assert capture.misses() == []
    assert capture.fused("rms_norm_grad") == expected["rms_norm"]
    assert capture.fused("rotary_position_embedding_grad") == expected["rope"]
    notes = [s.note for r in capture.results for s in r.sites if s.note]
    assert len(notes) == qk_norms and all(n.startswith("dgamma") for n in notes)
    assert grad_failures(fused, eager, exact) == []


def test_dynamic_true_fuses_every_site_and_does_not_recompile(dtype=torch.bfloat16):
    """``dynamic=True``: every size symbolic and every float a graph input. The norms' eps (a
    float the fused forward takes as a number) is specialized under a guard, batch and sequence
    stay symbolic: every site fuses forward and backward, a second call at another batch and
    sequence length runs the same compiled graph, and a changed eps recompiles with the new one."""
    model = tiny_llama(dtype)
    shapes = [(2, 12), (3, 7)]
    batches = [torch.randint(0, 96, s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    capture = Capture(target="generic")
    compiled = torch.compile(model, backend=capture, dynamic=True)
    for ids in batches:
        with count_sites(model) as expected:
            eager = param_grads(model, ids)
        exact = param_grads(copy.deepcopy(model).double(), ids)
        assert grad_failures(param_grads(model, ids, run=compiled), eager, exact) == []
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "a second batch and sequence recompiled"
    assert capture.misses() == []
    for op, sites in (("rms_norm", "rms_norm"), ("rms_norm_grad", "rms_norm"),
                      ("rotary_position_embedding", "rope"), ("rotary_position_embedding_grad", "rope")):
        assert capture.fused(op) == expected[sites], op

    for module in model.modules():  # a changed eps: recompiled with it, not run with the old one
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = 0.5
    ids = batches[0]
    eager, exact = param_grads(model, ids), param_grads(copy.deepcopy(model).double(), ids)
    assert grad_failures(param_grads(model, ids, run=compiled), eager, exact) == []
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
