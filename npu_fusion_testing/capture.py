"""A torch.compile backend for tests and benchmarks: AOTAutograd with the real pass on each
joint graph (or backward graph), keeping every backward graph before and after the pass and the pass's results;
and what the pass tests check with it (:func:`compile_and_compare`, :func:`decomposed_leftovers`)."""
from __future__ import annotations

import collections
import copy
from typing import Callable, Dict, List, Optional

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


def count_graph_runs(gm, run, keys: List[Optional[int]]) -> None:
    """Append to ``keys`` the :data:`GRAPH_RUNS` key that counts the runs of the graph the pass
    just ran on (``gm``, through an ``around_pass``'s ``run``): its partition's forward (in
    training each backward runs once per run of its forward; Dynamo reuses one compiled graph for
    every layer whose code and guards match, whose sites then run once per layer), known once the
    backend has partitioned a joint graph (the key is None until then); or, for a graph with no
    partition forward (a compiled-autograd graph), that graph itself."""
    index = len(keys)
    keys.append(None)

    def count(forward_gm, _backward_gm=None):
        keys[index] = count_runs(forward_gm)

    if run.stage == "joint" and run.split is not None:
        run.after_partition.append(count)
    else:
        forward = getattr(run, "forward", None)
        count(forward.owning_module if forward is not None and forward.owning_module is not None else gm)


def count_calls(compiled: Callable):
    """``(key, wrapper)``: a plain wrapper around a compiled callable counting its calls into
    ``GRAPH_RUNS[key]``, where the graph's own code is not what runs (Inductor's). Plain, not
    ``functools.wraps``: torch 2.10's Dynamo never called a wrapper that copies the compiled
    function's attributes (:func:`count_runs`)."""
    key = len(GRAPH_RUNS)
    GRAPH_RUNS[key] = 0

    def counted(*args, **kwargs):
        GRAPH_RUNS[key] += 1
        return compiled(*args, **kwargs)

    return key, counted


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
        #: per graph through the pass (parallel to ``results``), the key of the graph whose runs
        #: count its runs (:func:`count_graph_runs`; None until a joint graph is partitioned)
        self.run_keys: List[Optional[int]] = []

    def backend(self):
        """The AOTAutograd backend (``.kwargs`` are its compilers, partitioner and decompositions)."""
        backend = aot_backend(self.options, self._around_pass, stage=self.stage)
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
        count_graph_runs(gm, run, self.run_keys)

    @property
    def runs(self) -> List[int]:
        """How many times each graph through the pass ran so far (parallel to ``results``): a graph
        dynamo reuses for several layers holds each of its sites once but runs them once per layer."""
        return [GRAPH_RUNS[key] if key is not None else 0 for key in self.run_keys]

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
