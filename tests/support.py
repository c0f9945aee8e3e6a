"""Compile helpers for the pass tests: a backend that runs the real pass and keeps
the backward graph before and after it, and gradient comparisons."""
import torch
from npu_fusion.testing.capture import Capture  # the tests import it from here too
from npu_fusion.testing.grads import assert_close_as_unfused

VARIANTS = [  # (partitioner, decompositions)
    ("default", "none"), ("min_cut", "none"), ("default", "core"), ("min_cut", "core"),
]


def run_grads(fn, inputs, params=(), grad_outputs=None):
    """Forward + backward; returns the grads of the leaves that require grad, in order."""
    leaves = [t for t in list(inputs) + list(params) if t.requires_grad]
    for t in leaves:
        t.grad = None
    out = fn(*inputs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if grad_outputs is None:
        gen = torch.Generator().manual_seed(123)
        grad_outputs = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
    torch.autograd.backward(outs, grad_outputs)
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return grads, grad_outputs


def compile_and_compare(fn, inputs, params=(), dynamic_dims=None, **capture_options):
    """Compile ``fn`` with the pass, and check every gradient against eager in the same
    dtype and against float64: the fused result must be as close as the unfused one."""
    capture = Capture(**capture_options)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=capture)
    for index, dims in (dynamic_dims or {}).items():
        for d in dims:
            torch._dynamo.mark_dynamic(inputs[index], d)
    got, grad_outputs = run_grads(compiled, inputs, params)
    eager, _ = run_grads(fn, inputs, params, grad_outputs)
    exact = _float64_grads(fn, inputs, params, grad_outputs)
    for g, e, x in zip(got, eager, exact):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert_close_as_unfused(g, e, x, factor=4.0)
    return capture


def _float64_grads(fn, inputs, params, grad_outputs):
    params = list(params)
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.data.double()
        wide = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
        grads, _ = run_grads(fn, wide, params, [g.double() for g in grad_outputs])
    finally:
        for p, s in zip(params, saved):
            p.data = s
    return grads


def decomposed_leftovers(graph):
    """Nodes of the kinds the RoPE and RMSNorm backwards decompose into: negations, powers,
    rsqrt/mean, and slice_backward/slice_scatter along the last axis (rotate_half's transpose).
    Slices of other axes (GQA's repeat_kv with dynamic shapes) are not RoPE's."""
    fused_ops = {torch.ops.npu_fusion.rotary_position_embedding_grad.default,
                 torch.ops.npu_fusion.rms_norm_grad.default}
    left = []
    for n in graph.nodes:
        if n.op != "call_function" or (n.users and all(u.target in fused_ops for u in n.users)):
            continue  # an input the pass prepared for a fused op (a negated table) is none of them
        name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        if name in ("neg", "pow", "rsqrt", "mean"):
            left.append(n.name)
        elif name in ("slice_backward", "slice_scatter"):
            rank = len(n.meta["val"].shape)
            dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
            if dim % rank == rank - 1:
                left.append(n.name)
    return left
