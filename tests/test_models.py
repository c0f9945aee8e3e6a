"""End to end on real model code from transformers: a tiny random-weight
LlamaForCausalLM compiled with backend="npu_fusion", forward and backward."""
import contextlib
import copy

import pytest
import torch
import transformers.models.llama.modeling_llama as modeling_llama
from transformers import LlamaConfig, LlamaForCausalLM

from npu_fusion.plugin.pass_manager import COUNTER, HISTORY
from npu_fusion.testing.capture import Capture, decomposed_leftovers
from npu_fusion.testing.grads import assert_close_as_unfused

def tiny_llama(dtype, layers=2, seed=0):
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype)


@contextlib.contextmanager
def count_sites(model):
    """Count RMSNorm calls and RoPE applications in an eager run, independently of the pass:
    forward hooks on the norm modules, and a counting wrapper around apply_rotary_pos_emb
    (one call rotates q and k: two applications)."""
    counts = {"rms_norm": 0, "rope": 0}
    hooks = [m.register_forward_hook(lambda *_: counts.__setitem__("rms_norm", counts["rms_norm"] + 1))
             for m in model.modules() if isinstance(m, modeling_llama.LlamaRMSNorm)]
    original = modeling_llama.apply_rotary_pos_emb

    def counting(*args, **kwargs):
        counts["rope"] += 2
        return original(*args, **kwargs)

    modeling_llama.apply_rotary_pos_emb = counting
    try:
        yield counts
    finally:
        modeling_llama.apply_rotary_pos_emb = original
        for h in hooks:
            h.remove()


def param_grads(model, ids, run=None):
    model.zero_grad(set_to_none=True)
    (run if run is not None else model)(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


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
