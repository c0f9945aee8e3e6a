"""A torch.compile backend for tests and benchmarks: AOTAutograd with the real pass on each
backward graph, keeping every backward graph before and after the pass and the pass's results;
and what the pass tests check with it (:func:`compile_and_compare`, :func:`decomposed_leftovers`)."""
from __future__ import annotations

import collections
import copy
from typing import Dict, List

import torch

from ..lowering import FUSED_OPS
from ..plugin.backend import aot_backend
from ..plugin.options import FusionOptions
from .grads import MODEL_FACTOR, assert_close_as_unfused, float64_grads, run_grads

VARIANTS = [  # (partitioner, decompositions)
    ("default", "none"), ("min_cut", "none"), ("default", "core"), ("min_cut", "core"),
]


def op_counts(graph):
    return collections.Counter(
        getattr(n.target, "__name__", str(n.target)) for n in graph.nodes if n.op == "call_function")


#: runs of each counted graph, by the key :func:`count_runs` gave it
GRAPH_RUNS: Dict[int, int] = {}


def count_runs(gm: torch.fx.GraphModule) -> int:
    """Make ``gm``'s own generated code count its runs into ``GRAPH_RUNS[key]``; returns the key.

    The count is a statement at the top of the graph's code (a body transformer of its
    codegen, kept through recompiles and copies of the graph), so every run of the graph
    counts, whoever calls it. Wrapping the callable a backend returns does not count on
    every torch: torch 2.10's Dynamo never called such a wrapper made with ``functools.wraps``
    (which copies the compiled function's attributes, Dynamo's own among them). The graph's
    nodes are unchanged."""
    key = getattr(gm, "_npu_fusion_run_key", None)
    if key is not None:
        return key
    key = len(GRAPH_RUNS)
    GRAPH_RUNS[key] = 0
    statement = f"__import__({__name__!r}, fromlist=['GRAPH_RUNS']).GRAPH_RUNS[{key}] += 1\n"

    def make_transformer(previous):
        return lambda body: [statement] + list(previous(body) if previous else body)

    gm.graph.on_generate_code(make_transformer)
    gm.recompile()
    gm._npu_fusion_run_key = key
    return key


def run_counted_graph(bw_gm, run) -> torch.fx.GraphModule:
    """The graph whose runs count a backward graph's runs: its partition's forward (in training
    each backward runs once per run of its forward; Dynamo reuses one compiled graph for every
    layer whose code and guards match, whose sites then run once per layer), or, for a
    compiled-autograd graph (no partition forward), that graph itself."""
    forward = getattr(run, "forward", None)
    return forward.owning_module if forward is not None and forward.owning_module is not None else bw_gm


class Capture:
    """A torch.compile backend running ``fuse_backward`` on each backward graph.

    ``strict`` defaults to True (an internal error of the pass raises) so that tests see it;
    benchmarks that must go on pass ``strict=False`` and read ``results[i].error``.

    ``decompositions`` is the backend option (``"none"``, ``"core"``) or a decomposition table
    of its own for AOTAutograd (Inductor's ``select_decomp_table()``). ``fuse=False`` keeps the
    backward graph modules (``backwards``) and their forward graphs (``partition_forwards``)
    without running the pass: for tests and profiles that run ``fuse_backward`` themselves."""

    def __init__(self, partitioner="default", decompositions="none", fuse=True, **options):
        table = None if isinstance(decompositions, str) else decompositions
        self.options = FusionOptions.from_mapping(dict({"strict": True}, **options, partitioner=partitioner,
                                                       decompositions="none" if table is not None else decompositions))
        self.table, self.fuse = table, fuse
        self.before, self.after, self.results = [], [], []
        self.forwards = []  # the forward graphs dynamo handed over, one per compiled graph
        #: the backward graph modules and the forward graph of each one's partition
        self.backwards, self.partition_forwards = [], []
        #: per backward graph (parallel to ``results``), the key of the graph whose runs count its
        #: runs (:func:`count_runs`)
        self.run_keys: List[int] = []

    def backend(self):
        """The AOTAutograd backend (``.kwargs`` are its compilers, partitioner and decompositions)."""
        backend = aot_backend(self.options, self._around_pass)
        if self.table is not None:
            backend.kwargs["decompositions"] = self.table
        return backend

    def __call__(self, gm, example_inputs):
        self.forwards.append(gm.graph)
        return self.backend()(gm, example_inputs)

    def aot_function(self, fn):
        """``fn`` through AOTAutograd alone (no dynamo), with the pass as in :meth:`__call__`."""
        from torch._functorch.aot_autograd import aot_function

        return aot_function(fn, **self.backend().kwargs)

    def _around_pass(self, bw_gm, run):
        self.backwards.append(bw_gm)
        self.partition_forwards.append(run.forward)
        if not self.fuse:
            return
        self.before.append(copy.deepcopy(bw_gm.graph))
        self.results.append(run())
        self.after.append(bw_gm.graph)
        self.run_keys.append(count_runs(run_counted_graph(bw_gm, run)))

    @property
    def runs(self) -> List[int]:
        """How many times each backward graph ran so far (parallel to ``results``): a graph dynamo
        reuses for several layers holds each of its sites once but runs them once per layer."""
        return [GRAPH_RUNS[key] for key in self.run_keys]

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
