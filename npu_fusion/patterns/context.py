"""What one run of the pass carries, instead of process-wide state.

:class:`PassContext` is made by the pass manager for one graph and handed to every rule:
the graph, what its saved tensors were in the forward (:class:`~.evaluator.Provenance`),
the target chip, whether internal errors raise (``strict``), the graph's fake mode and
the stack of open transactions (:class:`~.rewrite.Transaction`: the nodes the candidate
being rewritten has inserted so far), and the verdicts each site's rules share
(:class:`SiteJudgements`). Two graphs rewritten at the same time (two
threads, or a pass started from inside another's compilation) share nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Hashable, List, Optional

import torch
import torch.fx as fx

from .evaluator import JointProvenance


def fake_mode_of(graph: fx.Graph):
    """The fake mode of the graph's recorded values, or None (a graph traced without one)."""
    for node in graph.nodes:
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode"):
            return v.fake_mode
    return None


class SiteJudgements:
    """The verdicts on a site that bind both of its rules.

    A norm or a rotation is one site with a
    forward and a backward, and where one rule refused it for a reason that is the site's (the
    program rounds inside it more coarsely than it keeps a value, :func:`~.evaluator.rounding_problem`;
    the target runs no such op), the other rule gives the same verdict with the same reason rather
    than judge it again in another domain. Keyed by the forward values both rules name (a norm's
    statistic, a rotation's tables, each :func:`~.pairing.source`).

    The backward rules run first in each round: their verdicts bind the forward rule
    (:meth:`binding`). A backward that no form read (a rotation whose table halves its evaluator
    sees as two leaves) has no verdict of its own; its miss defers (:meth:`defer`) to the forward's
    verdict on the same tables, which replaces its reason once the last round is done
    (:meth:`settle`). Every verdict recorded under a key counts, a site with no such problem as
    None, so a key whose sites were judged differently (q's rotation refused, k's fused: one pair of
    tables) binds nothing, and each site is judged by its own checks (the same code in both rules)."""

    def __init__(self):
        self._verdicts: Dict[Hashable, List[Optional[str]]] = {}
        self._deferred: List[tuple] = []

    def record(self, key: Hashable, refusal: Optional[str], by: str = "backward") -> None:
        """One site under ``key`` judged by the ``by`` rule: refused for ``refusal``, or not (None)."""
        self._verdicts.setdefault((by, key), []).append(refusal)

    def binding(self, key: Hashable, by: str = "backward") -> Optional[str]:
        """The refusal every site the ``by`` rule judged under ``key`` was given, or None (none
        judged, one without a problem, or sites refused for different reasons)."""
        verdicts = set(self._verdicts.get((by, key), ()))
        return next(iter(verdicts)) if len(verdicts) == 1 else None

    def accepted(self, key: Hashable, by: str = "backward") -> bool:
        """Whether the ``by`` rule judged sites under ``key``, and found no problem with any of them."""
        verdicts = self._verdicts.get((by, key), ())
        return bool(verdicts) and all(v is None for v in verdicts)

    def defer(self, miss, keys) -> None:
        """``miss`` (a backward no form read) takes the forward rule's refusal under one of ``keys``."""
        self._deferred.append((miss, tuple(keys)))

    def settle(self) -> None:
        """Each deferred miss with the reason the forward rule refused its site for, if it did."""
        for miss, keys in self._deferred:
            bound = next((b for b in (self.binding(k, by="forward") for k in keys) if b is not None), None)
            if bound is not None:
                miss.reason = bound


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
    #: the site verdicts that bind a forward rule and a backward rule alike
    judgements: SiteJudgements = dataclasses.field(default_factory=SiteJudgements)
    #: the forward rules' recorded misses (:class:`~.rewrite.Miss`) of the sites whose backward this graph
    #: holds: a joint graph's own, set after the rounds; a backward graph's forward's, from its own run
    forward_misses: List[Any] = dataclasses.field(default_factory=list)

    @property
    def forward_graph(self) -> Optional[fx.Graph]:
        """The graph the forward misses' nodes are in: the joint graph itself, or a backward's forward."""
        return self.graph if isinstance(self.provenance, JointProvenance) else getattr(self.provenance, "forward", None)

    @classmethod
    def of(cls, graph: fx.Graph, provenance=None, target: str = "generic", strict: bool = False) -> "PassContext":
        return cls(graph, provenance, target, strict, fake_mode_of(graph))
