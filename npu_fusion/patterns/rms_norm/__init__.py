"""Fuse forward RMSNorm on the joint graph into ``npu_fusion.rms_norm``, paired with its backward.

Unfused, as AOTAutograd writes the forward of HF ``LlamaRMSNorm`` in bf16::

    x32  = _to_copy(x, float32)
    rstd = rsqrt(add(mean(pow(x32, 2), [-1], keepdim), eps))
    y    = mul(weight, _to_copy(mul(x32, rstd), bfloat16))

Fused::

    y, rstd = npu_fusion.rms_norm(x, weight, eps)

and every reader of the program's ``rstd`` (the fused ``rms_norm_grad`` of the backward rule)
reads the fused op's rstd instead, so nothing recomputes it and the partitioner saves the one
float32 keep-dim statistic.

How a match is found, by value in the backward rule's exact algebra (:class:`NormEvaluator`,
:mod:`..algebra`) run on the forward nodes: a candidate rstd is an ``rsqrt`` (or ``** -0.5``)
node, a leaf of the algebra; its argument must equal ``S[x*x]/N + eps`` for some node x of the
graph and a number eps >= 0 (eps inside the root, the mean over exactly the normalized axes of
the square of the very value the output multiplies); y is a node whose value is
``rstd * x * gamma`` for a leaf gamma over the normalized axes (Gemma's ``1 + weight`` is one
leaf), or ``rstd * x`` when no such node exists (a norm without weight). Casts are identities
of the algebra: the rounding rules of :func:`~..evaluator.rounding_problem` judge each output
(an HF bf16 norm rounds the normalized value and then the product to bf16; the fused op rounds
once to bf16, which is allowed; a float32 program that rounds inside to bf16 is refused).

Pairing. The rule runs after the backward rules in each round (:data:`~npu_fusion.patterns.RULES`)
and fuses a forward only where nothing but the site itself and fused ops reads its values: its
backward is a fused ``rms_norm_grad`` reading rstd (or the norm has no backward). A forward
whose statistic or intermediates a decomposed backward still reads stays as it is this round (a
miss with that reason, decided again in the next round), so the backward rules always see the
forward they were written for, and the backward's ``unexplained`` sees every statistic it looks
for. Only on a joint graph and on an inference graph (:class:`~..evaluator.InferenceProvenance`:
no backward, so each norm fuses unpaired where the target takes it): a backward graph has no
forward to fuse.
"""
from __future__ import annotations

from typing import List, Optional

import torch.fx as fx

from ...lowering import RMS_NORM as OP, RMS_NORM_GRAD
from ..evaluator import JointProvenance, Provenance
from ..nodes import aten, calls_to, downstream, gradient_dependent
from ..rewrite import Miss, RuleContext
from ..pairing import calls, source
from ..rms_statistic import (EVERY_AXIS_REASON, clamped_statistic, over_every_axis,
                             resembling_reason, resembling_statistic, rms_root, rms_statistic_operand, spelled_root,
                             unmatched_spelling, whole_forward_misses)
from ..rule import Form, FusionRule, RoundReport, SiteProbe
from .sites import ROOT_TARGETS, ForwardNormMatch, Y_DEPTH, is_root, find_sites
from .emit import emit as emit_site


def unexplained(graph: fx.Graph, provenance: Optional[Provenance], misses: List[Miss]) -> List[Miss]:
    """No silent misses: a forward RMS statistic ``rsqrt(mean(x*x) + eps)`` left in a joint graph
    after the pass, that no recorded miss accounts for (one at it or at a node it reaches), is a
    forward RMSNorm no form matched; each becomes a miss."""
    if not isinstance(provenance, JointProvenance):
        return []
    gradient = gradient_dependent(graph) or set()
    missed = {m.node for m in misses}
    # each scan reads only the calls its tests can accept (a root, a division, a reciprocal), in graph order
    found = [n for n in calls_to(graph, *ROOT_TARGETS) if n not in gradient and is_root(n)
             and rms_statistic_operand(n, None) is not None
             and not any(r.name in missed for r in downstream(graph, [n], Y_DEPTH))]
    spelled = {}  # one miss per root, at its first reader: recomputed copies read it too
    for n in calls_to(graph, *ROOT_TARGETS, aten.div.Tensor, aten.reciprocal.default):
        root = spelled_root(n, None) if n not in gradient and n.op == "call_function" and n.target in (
            aten.div.Tensor, aten.rsqrt.default, aten.pow.Tensor_Scalar) else None
        if root is not None and root not in spelled and not any(
                r.name in missed for r in downstream(graph, [n], Y_DEPTH)):
            spelled[root] = (n, unmatched_spelling(n, None))
        elif _reciprocal_root(n) and n not in gradient and not any(
                r.name in missed for r in downstream(graph, [n], Y_DEPTH)):
            spelled[n] = (n, RECIPROCAL_REASON)
        elif n not in gradient and n.op == "call_function" and is_root(n) and over_every_axis(n, None) and not any(
                r.name in missed for r in downstream(graph, [n], Y_DEPTH)):
            spelled[n] = (n, EVERY_AXIS_REASON)
        elif n not in gradient and clamped_statistic(n, None) and not any(
                r.name in missed for r in downstream(graph, [n], Y_DEPTH)):
            spelled[n] = (n, clamped_statistic(n, None)[2])
    statistics = [Miss(OP.name, n.name, "a forward RMS statistic rsqrt(mean(x*x) + eps) that no forward RMSNorm "
                                        "form matched (run with TORCH_LOGS=npu_fusion and dump_graphs to see it)")
                  for n in found]
    spellings = [Miss(OP.name, n.name, reason) for n, reason in spelled.values()]
    # one miss a root: a root the spellings above name (a norm over every axis) is not named again
    spellings += _resembling_statistics(graph, gradient, missed | {m.node for m in spellings})
    whole = whole_forward_misses(graph, provenance, OP.name)
    return statistics + spellings + whole + _unpaired_backwards(graph, gradient, misses + statistics + spellings + whole)


def _resembling_statistics(graph: fx.Graph, gradient: set, missed: set) -> List[Miss]:
    """A miss at each forward root of a mean of squares plus eps that is no RMS statistic (:func:`resembling_statistic`).

    A miss at each forward root of a mean of squares plus eps that is no RMS statistic
    (:func:`resembling_statistic`: a scaled mean, a sum over another count, another axis) and
    near which no miss was recorded: the backward rule's scans read such a norm's backward as an
    RMSNorm's and record it, so its forward (the only site of an inference graph) is recorded too."""
    out = []
    for n in calls_to(graph, *ROOT_TARGETS):
        how = resembling_statistic(n, None) if n not in gradient else None
        if how is not None and not any(r.name in missed for r in downstream(graph, [n], Y_DEPTH)):
            out.append(Miss(OP.name, n.name, resembling_reason(how)))
    return out


#: why a forward RMSNorm whose statistic is the reciprocal of the root fuses in no form
RECIPROCAL_REASON = ("an RMS statistic spelled 1 / sqrt(mean(x*x) + eps) (the reciprocal of the root): no forward "
                     "form reads it; write torch.rsqrt(mean(x*x) + eps), the same value, to fuse it")


def _reciprocal_root(node: fx.Node) -> bool:
    """``node`` is ``reciprocal(sqrt(mean(y*y) + eps))`` (``1 / torch.sqrt(...)`` traces to it)."""
    return (node.op == "call_function" and node.target is aten.reciprocal.default and isinstance(node.args[0], fx.Node)
            and rms_root(node.args[0], None, lambda r: r.target is aten.sqrt.default) is not None)


def _unpaired_backwards(graph: fx.Graph, gradient: set, misses: List[Miss]) -> List[Miss]:
    """The fused RMSNorm backwards whose forward neither fused nor was recorded as a miss.

    A fused ``rms_norm_grad`` whose rstd is no fused forward op's and near which no forward miss
    was recorded: its forward ran and matched no form (``x / sqrt(...)``, a statistic built
    otherwise), each a miss named by the backward node (:mod:`..pairing`)."""
    missed, used, out = {m.node for m in misses}, set(), []
    for grad in calls(graph, RMS_NORM_GRAD):
        rstd = source(grad.args[2])
        if not isinstance(rstd, fx.Node) or rstd.target == OP.overload:
            continue
        near = {n.name for n in downstream(graph, [rstd], Y_DEPTH) + list(rstd.all_input_nodes)
                if n not in gradient} & missed
        if near:
            used |= near
            continue
        out.append(Miss(OP.name, grad.name, _unpaired_reason(grad, rstd)))
    # a miss recorded elsewhere on the site (its y, a reader of an intermediate) accounts for one
    return out[len(missed - used):]


def _unpaired_reason(grad: fx.Node, rstd: fx.Node) -> str:
    return (f"this norm's backward fused ({grad.name}), but its forward matched no forward RMSNorm form: its "
            f"statistic {rstd.name} ({_spelling(rstd)}) is no rsqrt(mean(x*x) + eps) with eps a number; spell it "
            f"as x * torch.rsqrt(...) to fuse it")


def _spelling(node: fx.Node) -> str:
    """What a statistic node is, for a miss's reason."""
    name = getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else node.op
    reads = ", ".join(getattr(a.target, "__name__", a.op) for a in node.all_input_nodes[:2])
    return f"{name} of {reads}" if reads else name


class RmsNormForwardRule(FusionRule):
    """RMSNorm's forward on the joint graph, matched by value in the norm algebra, rewritten into
    ``rms_norm`` once its backward is a fused ``rms_norm_grad`` (which then reads its rstd)."""

    stage = "joint"
    domain = "norm"
    ops = (OP,)
    reads_constant_floats = True  # the fused op's eps is an attribute
    #: each norm call the model runs is one forward site, the backward's site
    site_probe = SiteProbe(kind=OP.option, same_sites_as=RMS_NORM_GRAD.option)
    forms = tuple(Form(*row) for row in (
        ("forward on the joint graph, paired with its fused backward (which reads the forward's rstd): "
         "fp32 statistics with the casts, `nn.RMSNorm`/`F.rms_norm` with or without weight, `1 + weight`, "
         "T5's cast, per-head, gated, post and sandwich norms, under activation checkpointing",
         "HF `LlamaRMSNorm`, Qwen3 (q/k norms), Gemma, T5, PyTorch"),
    ))

    def find(self, graph: fx.Graph, ctx: RuleContext) -> RoundReport:
        return find_sites(graph, ctx)

    def emit(self, ctx: RuleContext, match: ForwardNormMatch):
        return emit_site(ctx, match)

    def unexplained(self, graph: fx.Graph, ctx: RuleContext, misses) -> List[Miss]:
        return unexplained(graph, ctx.provenance, misses)
