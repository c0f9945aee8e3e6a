"""How many times each graph through the pass ran: a graph Dynamo reuses for several layers holds
each of its sites once but runs them once per layer, so every site count of the report, the tests
and the benchmarks is a count per run.

The count is a statement the counter puts at the top of a graph's generated code
(:func:`count_runs`), so it counts whoever calls the graph: on torch 2.10 Dynamo never called a
wrapper around the compiled forward (one made with ``functools.wraps``, which copies Dynamo's own
attributes), which made an earlier report print 0 of 9 fused there. Where the graph's own code is
not what runs (Inductor's), a plain wrapper counts the calls instead (:func:`count_calls`).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

#: runs of each counted graph, by the key :func:`count_runs` or :func:`count_calls` gave it
GRAPH_RUNS: Dict[int, int] = {}


def count_runs(gm: torch.fx.GraphModule) -> int:
    """Make ``gm``'s own generated code count its runs into ``GRAPH_RUNS[key]``; returns the key.

    The statement is a body transformer of the graph's codegen, kept through recompiles and
    copies of the graph; the graph's nodes are unchanged."""
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
    """Append to ``keys`` the key that counts the runs of the graph the pass just ran on.

    Append to ``keys`` the :data:`GRAPH_RUNS` key that counts the runs of the graph the pass
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
    """A wrapper around a compiled callable that counts its calls, with its key.

    ``(key, wrapper)``: a plain wrapper around a compiled callable counting its calls into
    ``GRAPH_RUNS[key]``. Plain, not ``functools.wraps`` (module docstring)."""
    key = len(GRAPH_RUNS)
    GRAPH_RUNS[key] = 0

    def counted(*args, **kwargs):
        GRAPH_RUNS[key] += 1
        return compiled(*args, **kwargs)

    return key, counted


def runs_of(keys: List[Optional[int]]) -> List[int]:
    """The runs counted under each key so far (0 for a graph not partitioned yet)."""
    return [GRAPH_RUNS[key] if key is not None else 0 for key in keys]
