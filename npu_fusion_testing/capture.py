"""What the pass tests check with the recording backend: :class:`Capture` (the backend with the
tests' defaults), :func:`compile_and_compare` (every gradient against eager and float64) and
:func:`decomposed_leftovers` (what is left of a decomposed RoPE or RMSNorm backward)."""
from __future__ import annotations

import torch

from npu_fusion.lowering import FUSED_OPS
from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_grads, run_grads
from npu_fusion.measure.recording import Recorder
from npu_fusion.plugin.options import FusionOptions

VARIANTS = [  # (partitioner, decompositions)
    ("default", "none"), ("min_cut", "none"), ("default", "core"), ("min_cut", "core"),
]


class Capture(Recorder):
    """The recording backend (:class:`~npu_fusion.measure.recording.Recorder`) with the tests'
    defaults: the options as keywords, ``strict`` True (an internal error of the pass raises, so
    that tests see it; benchmarks that must go on pass ``strict=False`` and read
    ``results[i].error``), and ``decompositions`` either the backend option (``"none"``,
    ``"core"``) or a decomposition table of its own for AOTAutograd (Inductor's
    ``select_decomp_table()``)."""

    def __init__(self, partitioner="default", decompositions="none", fuse=True, stage=None, **options):
        table = None if isinstance(decompositions, str) else decompositions
        super().__init__(FusionOptions.from_mapping(dict({"strict": True}, **options, partitioner=partitioner,
                                                         decompositions="none" if table is not None else decompositions)),
                         fuse=fuse, stage=stage, decompositions=table)


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
    exact = float64_grads(fn, inputs, params, grad_outputs)
    for g, e, x in zip(got, eager, exact):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert_close_as_unfused(g, e, x, factor=MODEL_FACTOR)
    return capture


def decomposed_leftovers(graph):
    """Nodes of the kinds the RoPE and RMSNorm backwards decompose into: negations, powers,
    rsqrt/mean, and slice_backward/slice_scatter along the last axis (rotate_half's transpose).
    Slices of other axes (GQA's repeat_kv with dynamic shapes) are not RoPE's."""
    fused_ops = {op.overload for op in FUSED_OPS}
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
