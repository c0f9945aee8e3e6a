"""The fusion rules: find decomposed subgraphs, check the target's constraints, rewrite
them into fused op calls. One package per rule, named as its fused op's module under
:mod:`npu_fusion.lowering.ops` (:mod:`.rms_norm_grad`, :mod:`.rope_grad`, :mod:`.rms_norm`, :mod:`.rope`), one
module per concern in it (of ``match``, ``sites`` with the near misses, ``misses`` after the last round,
``emit``, ``whole`` for the whole aten ops, those the rule needs) and the rule, a :class:`~.rule.FusionRule`
subclass, in its ``__init__``; what a forward and a backward rule share is a public module beside them
(:mod:`.rms_statistic`, :mod:`.rotation`). :data:`RULES` is what the pass manager runs, in order, and what the
options, the table of supported forms (docs/supported-forms.md) and the independent site counters derive from.

The method they share: :mod:`.nodes` reads a graph, :mod:`.evaluator` evaluates it
(memoized, seeing through saved tensors), :mod:`.lanes` and :mod:`.norm_algebra` (with
:mod:`.algebra`) are the two abstract domains, :mod:`.rewrite` makes each candidate a
transaction with one shared emit, :mod:`.rule` is the rules' base class, :mod:`.context`
the state of one run, and :mod:`.traffic` is the report's memory-traffic model.

:data:`FORMS` lists the spellings each rule is tested on (its :attr:`~.rule.FusionRule.forms`);
the table of supported forms (docs/supported-forms.md) is rendered from it (``render_forms``) and a test keeps
the two equal.
"""
from .rms_norm_grad import RmsNormGradRule
from .rms_norm import RmsNormForwardRule
from .rope_grad import RopeGradRule
from .rope import RopeForwardRule
from .rule import Form, FusionRule, RoundReport, SiteProbe

__all__ = ["RULES", "FORMS", "render_forms", "FusionRule", "RoundReport", "Form", "SiteProbe",
           "RmsNormGradRule", "RopeGradRule", "RmsNormForwardRule", "RopeForwardRule"]

#: The rules in the order each round runs them. A site whose dy is another site's dx (a
#: post- or sandwich norm's dy, RoPE's dy under Llama 4's L2 qk-norm, a qk-norm's dy under
#: RoPE) stays pending until that site is a fused op and fuses in the next round, so the
#: order decides only the round in which such a site fuses, never whether it does (the
#: pass manager runs up to ``MAX_ROUNDS``). RMSNorm runs first, as it always has: every
#: figure the project reports was measured in this order.
#: The forward rules run after the backward ones: a forward fuses only once no decomposed
#: backward reads its intermediates (the backward rules match the decomposed forward they were
#: written for, statistic and normalized value included), and the RMSNorm forward then hands
#: the fused backward its rstd.
RULES = (RmsNormGradRule(), RopeGradRule(), RmsNormForwardRule(), RopeForwardRule())

#: (fused op, form, where it comes from), rule by rule in the order of :data:`RULES`
FORMS = [(rule.op.name, form.form, form.seen_in) for rule in RULES for form in rule.forms]


def render_forms() -> str:
    lines = ["| fused op | form | seen in |", "|---|---|---|"]
    lines += [f"| `{op}` | {form} | {where} |" for op, form, where in FORMS]
    return "\n".join(lines)
