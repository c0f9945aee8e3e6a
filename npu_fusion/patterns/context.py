"""What one run of the pass carries, instead of process-wide state.

:class:`PassContext` is made by the pass manager for one graph and handed to every rule:
the graph, what its saved tensors were in the forward (:class:`~.evaluator.Provenance`),
the target chip, whether internal errors raise (``strict``), the graph's fake mode and
the stack of open transactions (:class:`~.rewrite.Transaction`: the nodes the candidate
being rewritten has inserted so far). Two graphs rewritten at the same time (two
threads, or a pass started from inside another's compilation) share nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

import torch
import torch.fx as fx


def fake_mode_of(graph: fx.Graph):
    """The fake mode of the graph's recorded values, or None (a graph traced without one)."""
    for node in graph.nodes:
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode"):
            return v.fake_mode
    return None


@dataclasses.dataclass
class PassContext:
    """One run of the pass over one graph."""
    graph: fx.Graph
    #: the graph's saved tensors' forward definitions (None: the backward alone)
    provenance: Optional[Any] = None
    #: the chip the fused ops are checked against (:data:`~npu_fusion.lowering.checks.TARGETS`)
    target: str = "generic"
    #: raise an internal error instead of recording it as the candidate's miss
    strict: bool = False
    fake_mode: Any = None
    #: the transactions in progress, innermost last
    transactions: List[Any] = dataclasses.field(default_factory=list)
    #: the options of the rules that run (a rule leaves to another what that one accounts for)
    enabled: frozenset = frozenset()

    @classmethod
    def of(cls, graph: fx.Graph, provenance=None, target: str = "generic", strict: bool = False) -> "PassContext":
        return cls(graph, provenance, target, strict, fake_mode_of(graph))
