"""A torch.compile backend for tests and benchmarks: AOTAutograd with the real pass on each
joint graph (or backward graph), keeping every backward graph before and after the pass and the pass's results;
and what the pass tests check with it (:func:`compile_and_compare`, :func:`decomposed_leftovers`)."""
from __future__ import annotations

import collections
import functools

import torch

from ..lowering import FUSED_OPS
from ..plugin.backend import aot_backend, fused_backward, run_keeping_unfused
from ..plugin.options import FusionOptions
from .grads import MODEL_FACTOR, assert_close_as_unfused, float64_grads, run_grads

VARIANTS = [  # (partitioner, decompositions)
    ("default", "none"), ("min_cut", "none"), ("default", "core"), ("min_cut", "core"),
]


def op_counts(graph):
    return collections.Counter(
        getattr(n.target, "__name__", str(n.target)) for n in graph.nodes if n.op == "call_function")


def counting_runs(compiled, runs, owned):
    """``compiled`` (AOTAutograd's forward), counting its calls into ``runs[i]`` for each backward
    graph ``i`` in ``owned``. The partitioner (and so the pass) runs while AOTAutograd compiles a
    forward graph, so the backward graphs recorded meanwhile are its own; in training each runs once
    per run of its forward. Dynamo reuses one compiled graph for every layer whose code and guards
    match (Megatron's per-layer graphs after graph breaks): its sites then run once per layer."""
    @functools.wraps(compiled)
    def counting(*args, **kwargs):
        for index in owned:
            runs[index] += 1
        return compiled(*args, **kwargs)
    return counting


class Capture:
    """A torch.compile backend running the pass as the ``npu_fusion`` backend does (``fuse_joint``
    on each joint graph; ``stage="backward"``: ``fuse_backward`` after the partition).

    ``strict`` defaults to True (an internal error of the pass raises) so that tests see it;
    benchmarks that must go on pass ``strict=False`` and read ``results[i].error``.

    ``decompositions`` is the backend option (``"none"``, ``"core"``) or a decomposition table
    of its own for AOTAutograd (Inductor's ``select_decomp_table()``). ``fuse=False`` keeps the
    backward graph modules (``backwards``) and their forward graphs (``partition_forwards``)
    without running the pass: for tests and profiles that run ``fuse_backward`` themselves.

    ``before`` and ``after`` hold backward graphs either way: on the joint stage ``before`` is the
    partition of the joint graph as it was, ``after`` the backward the backend partitioned."""

    def __init__(self, partitioner="default", decompositions="none", fuse=True, stage=None, **options):
        table = None if isinstance(decompositions, str) else decompositions
        self.options = FusionOptions.from_mapping(dict({"strict": True}, **options, partitioner=partitioner,
                                                       decompositions="none" if table is not None else decompositions))
        self.table, self.fuse = table, fuse
        #: where the pass runs: on the joint graph (the backend's way), or on the backward
        #: graph after the partition (torchair's hook; what ``fuse=False`` keeps by default)
        self.stage = stage or ("joint" if fuse else "backward")
        self.before, self.results = [], []
        self._after = []  # per result: the backward graph after the pass, once partitioned
        self.forwards = []  # the forward graphs dynamo handed over, one per compiled graph
        #: the backward graph modules and the forward graph of each one's partition
        self.backwards, self.partition_forwards = [], []
        #: how many times each backward graph's forward ran (parallel to ``results``): a graph
        #: dynamo reuses for several layers holds each of its sites once but runs them once per layer
        self.runs = []

    def backend(self):
        """The AOTAutograd backend (``.kwargs`` are its compilers, partitioner and decompositions)."""
        backend = aot_backend(self.options, self._around_pass, stage=self.stage)
        if self.table is not None:
            backend.kwargs["decompositions"] = self.table
        return backend

    def __call__(self, gm, example_inputs):
        self.forwards.append(gm.graph)
        first = len(self.results)
        compiled = self.backend()(gm, example_inputs)
        return counting_runs(compiled, self.runs, range(first, len(self.results)))

    def aot_function(self, fn):
        """``fn`` through AOTAutograd alone (no dynamo), with the pass as in :meth:`__call__`."""
        from torch._functorch.aot_autograd import aot_function

        return aot_function(fn, **self.backend().kwargs)

    def _around_pass(self, gm, run):
        if run.stage == "backward" or run.split is None:
            self.backwards.append(gm)
            self.partition_forwards.append(run.forward)
        if not self.fuse:
            return
        result, before, _ = run_keeping_unfused(gm, run)
        self.results.append(result)
        self.before.append(before)
        self._after.append(fused_backward(gm, run))
        self.runs.append(0)

    @property
    def after(self):
        """The backward graphs after the pass (partitioned ones once the compile has run)."""
        return [after() for after in self._after]

    def fused(self, op):
        """Fused sites in the graphs (each once, however often its graph ran)."""
        return sum(r.fused(op) for r in self.results)

    def fused_runs(self, op):
        """Fused sites as they ran: each graph's sites times the runs of that graph."""
        return sum(r.fused(op) * n for r, n in zip(self.results, self.runs))

    def after_counts(self):
        total = collections.Counter()
        for g in self.after:
            total += op_counts(g)
        return total

    def misses(self):
        return [m for r in self.results for m in r.misses]


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
