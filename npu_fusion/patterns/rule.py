"""A fusion rule: how the pass finds one kind of site and rewrites it into fused ops.

A rule is a subclass of :class:`FusionRule`, one module per rule (``patterns/<op>.py``), and
one line in :data:`npu_fusion.patterns.RULES`. Everything else derives from that list: the
pass manager runs the rules in its order, the options (:mod:`npu_fusion.plugin.options`)
take each rule's :attr:`~FusionRule.option`, the table of supported forms (docs/supported-forms.md)
is rendered from each rule's :attr:`~FusionRule.forms`, and the independent site counters
read each rule's :attr:`~FusionRule.site_probe`.

How a rule subclasses it::

    class AddRmsNormGradRule(FusionRule):
        stage = "backward"                 # the graphs it reads (see STAGES)
        domain = "norm_algebra"            # the domain module its matcher evaluates in
        ops = (ADD_RMS_NORM_GRAD,)         # the lowering.FusedOp(s) it emits; ops[0] names it
        forms = (Form("`x + residual` then RMSNorm", "Qwen3"), ...)
        site_probe = SiteProbe(kind="add_rms_norm", module_classes=r"AddRMSNorm")

        def find(self, graph, ctx) -> RoundReport:     # this round's matches, misses, pending
        def emit(self, ctx, match):                    # a Site (committed) or a Miss
        # optional:
        def unexplained(self, graph, ctx, misses):     # after the last round: no silent misses
        def outputs(self, match), region(self, match, outputs), find_again(self, ctx, match, leaves)

The pass manager runs a round of a rule as ``report = rule.find(graph, ctx)``, then, for each
match, ``rule.emit(ctx, match)`` inside the match's transaction (``ctx.transaction(match.dx)``).
``find`` must not rewrite the graph and reports everything it decided in its
:class:`RoundReport`: matches (each with a ``dx`` attribute, the node the site's transaction
is keyed on), near misses, and ``pending``, the candidates it left undecided because they
build on a site this round matched (a post-norm whose dy is the next norm's dx): the pass
manager runs another round while a round fused something and left something undecided.
Internal errors while examining a candidate go through ``ctx.examine`` (a miss naming the
candidate; ``strict`` raises). ``emit`` runs inside the candidate's transaction; it builds
nodes with ``ctx.edit`` and ends in :func:`~.rewrite.emit_fused_op` and :func:`~.rewrite.commit`.

The one step every rule shares, :meth:`FusionRule.resolve_shared`: a match whose replaced
region has an intermediate another consumer also reads is looked at again with those
intermediates as leaves (:meth:`find_again`: pure, and scoped to the site), so a cast shared
with another consumer still fuses while a shared partial product stays a miss.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Union

import torch.fx as fx

from ..lowering.fused_op import FusedOp
from .nodes import outside_users
from .rewrite import Miss, RuleContext, Site

#: the graphs a rule reads: a backward graph (or the backward part of a joint graph, where
#: the forward values are what the partition saves), the whole joint graph, or a forward graph.
#: (Today the pass manager runs every enabled rule on each backward or joint graph it is handed,
#: a rule's stage saying what it reads there; on an inference graph, which has no backward, only
#: the rules of stage "joint" and "forward".)
STAGES = ("backward", "joint", "forward")


@dataclasses.dataclass(frozen=True)
class Form:
    """One spelling a rule is tested on: docs/supported-forms.md has a row each."""
    form: str
    seen_in: str


@dataclasses.dataclass(frozen=True)
class SiteProbe:
    """What one site of a rule's forward is, for the independent site counters.

    What one site of a rule's forward is, for the counters that count sites independently of
    the pass (the zoo, the framework models): an eager call whose output receives a gradient, of
    a module whose class name matches ``module_classes`` (or whose source matches ``source``), or
    of a module-level function whose name matches ``functions`` and not ``excluded``."""
    #: the counters' key of the site: the rule's option
    kind: str
    module_classes: Optional[str] = None
    functions: Optional[str] = None
    source: Optional[str] = None
    excluded: Optional[str] = None
    #: one site is one call (a norm) or one returned tensor that requires grad (a rotation of q and k)
    per_output: bool = False
    #: the kind whose sites these are too: a forward rule's sites are its backward's (each norm
    #: call, each rotation the model runs), counted once by the backward's probe and accounted
    #: for under both kinds; None for a probe that counts its own sites
    same_sites_as: Optional[str] = None

    @property
    def counted_kind(self) -> str:
        """The kind the counters record this probe's sites under."""
        return self.same_sites_as or self.kind


@dataclasses.dataclass
class RoundReport:
    """What one rule's ``find`` decided in one round."""
    matches: List[Any] = dataclasses.field(default_factory=list)
    misses: List[Miss] = dataclasses.field(default_factory=list)
    #: candidates left undecided because they build on a site this round matched
    pending: int = 0

    def __add__(self, other: "RoundReport") -> "RoundReport":
        return RoundReport(self.matches + other.matches, self.misses + other.misses, self.pending + other.pending)


class FusionRule:
    """One kind of site and the fused op(s) it becomes (see the module docstring)."""

    stage: ClassVar[str] = "backward"
    #: the domain module (``patterns/<domain>.py``) its matcher evaluates in
    domain: ClassVar[str] = ""
    ops: ClassVar[Tuple[FusedOp, ...]] = ()
    forms: ClassVar[Tuple[Form, ...]] = ()
    site_probe: ClassVar[Optional[SiteProbe]] = None
    #: the option that turns the rule on (default: its first op's), and older names of it
    option_name: ClassVar[Optional[str]] = None
    option_aliases: ClassVar[Tuple[str, ...]] = ()
    #: whether the rule's option is on by default
    enabled_by_default: ClassVar[bool] = True
    #: whether its fused op takes a float of the program as a number (a norm's eps), so that under
    #: ``dynamic=True`` the backend specializes such floats under a guard
    #: (:mod:`npu_fusion.plugin.specialize`)
    reads_constant_floats: ClassVar[bool] = False
    #: the aten ops (by name) it reads as leaves that Inductor's table decomposes before its joint
    #: passes; ``install_inductor`` puts their exact decompositions back for it (SwiGLU's silu)
    reads_whole: ClassVar[Tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.stage not in STAGES:
            raise TypeError(f"{cls.__name__}.stage must be one of {STAGES}, got {cls.stage!r}")

    def static_sizes(self, graph: fx.Graph) -> list:
        """The symbolic sizes the rule's fused op needs static in ``graph``.

        RoPE's: the head dim of a rotation-shaped sum. On a joint graph compiled by Dynamo the
        pass manager guards them to their example values before the rounds
        (:func:`~npu_fusion.compat.specialize_size`)."""
        return []

    @property
    def op(self) -> FusedOp:
        """The rule's fused op (its first): names its sites, misses and counters."""
        return self.ops[0]

    @property
    def option(self) -> str:
        return self.option_name or self.op.option

    @property
    def name(self) -> str:
        return type(self).__name__

    # -- what a rule defines ------------------------------------------------------
    def find(self, graph: fx.Graph, ctx: RuleContext) -> RoundReport:
        """This round's matches, near misses and pending candidates; never rewrites."""
        raise NotImplementedError

    def emit(self, ctx: RuleContext, match) -> Union[Site, Miss]:
        """One match rewritten into fused ops (a committed :class:`Site`) or a :class:`Miss`."""
        raise NotImplementedError

    def unexplained(self, graph: fx.Graph, ctx: RuleContext, misses: Sequence[Miss]) -> List[Miss]:
        """After the last round: what still looks like the rule's forward and no form matched
        nor a recorded miss accounts for, each a miss (no silent misses)."""
        return []

    def outputs(self, match) -> Dict[str, fx.Node]:
        """The match's replaced outputs, by the fused op's output names."""
        raise NotImplementedError

    def region(self, match, outputs: Dict[str, fx.Node]) -> List[fx.Node]:
        """The nodes the rewrite replaces."""
        raise NotImplementedError

    def find_again(self, ctx: RuleContext, match, leaves: List[fx.Node]):
        """The same site matched again with ``leaves`` as leaves, or None when it no longer
        matches the same way. Pure (records nothing) and scoped to the site."""
        return None

    # -- what the base class does ---------------------------------------------------
    def resolve_shared(self, ctx: RuleContext, match, outputs: Dict[str, fx.Node],
                       refreshed_outputs: bool = False):
        """The match ready to rewrite, found again around the intermediates it shares, or a Miss.

        ``(match, outputs, region)`` ready to rewrite, or a :class:`Miss`: where an intermediate
        of the region has a user outside it, the match found again with the shared
        intermediates as leaves (a cast shared with another consumer is harmless, a shared
        partial product is a near miss). With ``refreshed_outputs`` the outputs are read again
        off the new match (it may see outputs the first could not)."""
        region = self.region(match, outputs)
        shared = outside_users(region, outputs.values())
        if not shared:
            return match, outputs, region
        again = self.find_again(ctx, match, shared)
        if again is None:
            return Miss(self.op.name, match.dx.name, f"intermediate {shared[0].name} has a user outside "
                                                     f"the pattern ({next(iter(shared[0].users)).name})")
        outputs = self.outputs(again) if refreshed_outputs else outputs
        region = self.region(again, outputs)
        if refreshed_outputs and outside_users(region, outputs.values()):
            return Miss(self.op.name, again.dx.name, "intermediates have users outside the pattern")
        return again, outputs, region
