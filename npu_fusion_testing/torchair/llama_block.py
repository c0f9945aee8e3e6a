"""A Llama-style block (input RMSNorm, q/k projections, transformers' rotary embedding) trained one
step through torchair: the end-to-end torchair tests and ``scripts/torchair_probe.py`` use it.
``LlamaBlock(rope=...)`` rotates as transformers' Llama (``"half"``), GPT-J (``"interleave"``) or
DeepSeek-V3 (``"interleave_half"``) does.

Needs transformers (the test extra).
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

import npu_fusion
from npu_fusion.models import apply_rope

FUSED = {"RmsNormGrad", "RotaryPositionEmbeddingGrad"}
#: the forward fused ops' GE nodes
FORWARD_FUSED = {"RmsNorm", "RotaryPositionEmbedding"}
#: GE op types that, in these steps, only the decomposed forward norm and rotation make: RMSNorm's
#: statistic (square, mean, root) and the rotation's slices, negation and joining (rotate_half's
#: concatenation, rotate_every_two's stack) (``decomposed_forward_ops``)
FORWARD_DECOMPOSED = {"Rsqrt", "ReduceMean", "Pow", "StridedSliceV2", "Neg", "ConcatV2", "Pack"}
#: op types that, in these steps, only the decomposed backward makes and the fused ops
#: replace: rotate_half's transpose (slices and concatenation) and RMSNorm's rsqrt/mean
#: backward (a power).
DECOMPOSED = {"StridedSliceV2", "ConcatV2", "Pow"}


def decomposed_ops(backward) -> set:
    """The decomposed RoPE/RMSNorm backward ops left in a GE graph: every op of a
    DECOMPOSED type, and each Neg of rotate_half's transpose (a sliced gradient, negated,
    joined back by a ConcatV2). A Neg wired otherwise is another op's backward (softmax's
    in the loss, since torch 2.10) and is not counted."""
    left = {op.type for op in backward.ops if op.type in DECOMPOSED}
    for neg in backward.of_type("Neg"):
        sliced = backward.producer(neg, 0)[0].type == "StridedSliceV2"
        if sliced and any(op.type == "ConcatV2" for op, _ in backward.consumers(neg)):
            left.add("Neg")
    return left


def decomposed_forward_ops(forward) -> set:
    """The op types of :data:`FORWARD_DECOMPOSED` left in a forward GE graph. A Pack counts only
    where it stacks sliced or negated halves (rotate_every_two's stack): under symbolic shapes
    torchair packs sizes into shapes too."""
    left = {op.type for op in forward.ops if op.type in FORWARD_DECOMPOSED - {"Pack"}}
    for pack in forward.of_type("Pack"):
        fed = {forward.producer(pack, i)[0].type for i in range(len(forward.data_inputs(pack)))}
        if fed & {"Neg", "StridedSliceV2"}:
            left.add("Pack")
    return left


class LlamaBlock(nn.Module):
    """The head of Llama's attention: input RMSNorm, q/k projections, HF rotary embedding."""

    def __init__(self, hidden=64, heads=4, kv_heads=2, dtype=torch.float32, rope="half"):
        super().__init__()
        self.rope = rope
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.input_layernorm = LlamaRMSNorm(hidden, eps=1e-6)
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        with torch.no_grad():
            self.input_layernorm.weight.normal_()
        self.to(dtype)

    def forward(self, hidden_states, cos, sin):
        b, s, _ = hidden_states.shape
        h = self.input_layernorm(hidden_states)
        q = self.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope == "half":
            return apply_rotary_pos_emb(q, k, cos, sin)
        return apply_rope(q, k, cos, sin, self.rope)


def tiny_transformers_llama(layers: int = 2):
    """A tiny bf16 transformers Llama (eager attention) and its config, as torchair's GE converters take it.

    The wheel's torchair has no GE converter for ``aten.silu_backward``, which the CPU's autograd
    makes (torch_npu's silu has its own backward op), so the MLP runs GELU, whose backward converts."""
    from transformers import AutoModelForCausalLM

    from npu_fusion.report.subjects import tiny_hf_config

    torch.manual_seed(0)
    config = tiny_hf_config("llama", layers)
    config.hidden_act = "gelu"
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(torch.bfloat16), config


def inputs(dtype, b=2, s=8, hidden=64, heads=4, cos_batch=None):
    """hidden states [b, s, hidden]; cos/sin [b, s, d] as HF's rotary embedding
    gives them (or [1, s, d]: positions shared by the batch)."""
    torch.manual_seed(0)
    x = torch.randn(b, s, hidden, dtype=dtype)
    angles = torch.randn(cos_batch or b, s, hidden // heads)
    return x, angles.cos().to(dtype), angles.sin().to(dtype)


def _step(module, args, compiled, dynamic_dims):
    """One forward and backward for fixed random output gradients: (x, outputs)."""
    fn = compiled if compiled is not None else module
    x = args[0].detach().requires_grad_()
    for t in (x, *args[1:]):
        for dim in dynamic_dims:
            if t.shape[dim] > 1:
                torch._dynamo.mark_dynamic(t, dim)
    module.zero_grad(set_to_none=True)
    outs = fn(x, *args[1:])
    gen = torch.Generator().manual_seed(1)
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs])
    return x, outs


def grads(module, args, compiled=None, dynamic_dims=()):
    """Gradients of the input and the parameters for fixed random output gradients."""
    x, _ = _step(module, args, compiled, dynamic_dims)
    return [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]


def outputs_and_grads(module, args, compiled=None, dynamic_dims=()) -> dict:
    """The outputs (q, k) and the gradients of the input and the parameters, by name, for fixed
    random output gradients (as :func:`grads`): what the float64 criterion compares."""
    x, outs = _step(module, args, compiled, dynamic_dims)
    values = {"q": outs[0].detach().clone(), "k": outs[1].detach().clone(), "x.grad": x.grad.clone()}
    values.update({f"{n}.grad": p.grad.clone() for n, p in module.named_parameters()})
    return values


def train_step(ge, dtype=torch.float32, install=None, config=None, dynamic_dims=(), **shape):
    """Compiled and eager gradients, and float64 ones as the exact reference."""
    block = LlamaBlock(dtype=dtype)
    config = config if config is not None else ge.config()
    if install is not None:
        npu_fusion.install(config, **install)
    args = inputs(dtype, **shape)
    got = grads(block, args, ge.compile(block, config=config, dynamic=None), dynamic_dims)
    eager = grads(block, args)
    exact = grads(copy.deepcopy(block).double(), [a.double() for a in args])
    return got, eager, exact


def assert_grads_close(got, eager, exact):
    """As close to float64 as eager is (fused ops compute in fp32, eager in the input dtype)."""
    for g, e, x in zip(got, eager, exact):
        assert g.dtype == e.dtype and g.shape == e.shape
        error, eager_error = (g.double() - x).abs().max(), (e.double() - x).abs().max()
        assert error <= 2 * eager_error + 1e-5, (error, eager_error)
