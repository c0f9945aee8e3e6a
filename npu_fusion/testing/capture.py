"""A torch.compile backend for tests and benchmarks: AOTAutograd with the real pass on each
backward graph, keeping every backward graph before and after the pass and the pass's results."""
from __future__ import annotations

import collections
import copy
import functools

from ..plugin.backend import aot_backend
from ..plugin.options import FusionOptions


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
    """A torch.compile backend running ``fuse_backward`` on each backward graph.

    ``strict`` defaults to True (an internal error of the pass raises) so that tests see it;
    benchmarks that must go on pass ``strict=False`` and read ``results[i].error``."""

    def __init__(self, partitioner="default", decompositions="none", **options):
        self.options = FusionOptions.from_mapping(dict({"strict": True}, **options, partitioner=partitioner,
                                                       decompositions=decompositions))
        self.before, self.after, self.results = [], [], []
        self.forwards = []  # the forward graphs dynamo handed over, one per compiled graph
        #: how many times each backward graph's forward ran (parallel to ``results``): a graph
        #: dynamo reuses for several layers holds each of its sites once but runs them once per layer
        self.runs = []

    def __call__(self, gm, example_inputs):
        self.forwards.append(gm.graph)
        first = len(self.results)
        compiled = aot_backend(self.options, self._around_pass)(gm, example_inputs)
        return counting_runs(compiled, self.runs, range(first, len(self.results)))

    def _around_pass(self, bw_gm, run):
        self.before.append(copy.deepcopy(bw_gm.graph))
        self.results.append(run())
        self.after.append(bw_gm.graph)
        self.runs.append(0)

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
