"""Fuse RMSNorm backward subgraphs into ``npu_fusion.rms_norm_grad``.

Unfused, as AOTAutograd writes the backward of HF ``LlamaRMSNorm``
(``weight * (x32 * rsqrt(mean(x32**2) + eps)).to(dtype)``)::

    g32    = _to_copy(mul(dy, weight), float32)
    s      = sum(mul(g32, x32), [-1], keepdim)
    dvar   = div(expand(mul(mul(s, -0.5), pow(rstd, 3))), D)
    dx     = _to_copy(add(mul(g32, rstd), mul(dvar, mul(pow(x32, 1), 2))), dtype)
    dgamma = view(sum(mul(dy, x_hat), leading axes), [D])

Fused::

    dx, dgamma = npu_fusion.rms_norm_grad(dy, x, rstd, gamma)

How a match is found: nodes are evaluated symbolically in the norm domain
(:mod:`..norm_algebra`, with RMSNorm's bounds: :func:`norm_evaluator`; exact Laurent
polynomials, :mod:`..algebra`; one small interpreter per aten op, in the tables
:attr:`NormEvaluator.FORWARD_SAFE` and :attr:`NormEvaluator.BACKWARD_ONLY`, with
any other op a leaf) with the normalized axes as an abstract index: a
leaf is a symbol, ``x_i`` when it spans the normalized axes and ``r`` when it is
constant along them (``rstd``), and a sum over the normalized axes becomes a
symbol ``S[monomial]`` after expanding its summand. A node is dx when its expression equals, for some leaves,
``r*dy*g - r**3 * x * S[dy*g*x] / N`` (docs/fused-ops.md#rms_norm_grad), and dgamma when it is
``dy * x * r`` summed over exactly the leading axes to gamma's shape. Equality is
algebraic, so eps outside the square root, a wrong exponent or a missing term
do not match.

A norm whose input takes no gradient (applied to a model input) has no dx: its
backward is only ``dgamma = sum(dy * x_hat)`` over the leading axes, and the
algebra cannot tell rstd from any other factor there. So the statistic is proven
by its definition (:func:`rms_statistic_operand`, through casts, reshapes and
saved tensors' forward definitions): rstd is ``rsqrt(mean(x*x, last k axes) + eps)``
with a number eps inside the root, of the very tensor x the product reads (not a
centred LayerNorm value). The backward holds either x and rstd (min-cut, or
recomputed): dgamma is ``sum(dy * x * rstd)``; or only the saved normalized value
``x_hat = x * rstd`` (default partitioner), proven so by its forward definition
(:func:`normalized_operand`): dgamma is ``sum(dy * x_hat * 1)``, and the fused op
reads x_hat as x with an rstd of ones. Either way the site is ``rms_norm_grad``
with only its dgamma output used, through the dx form's emit path (dtype table,
chip limits, gamma of ones, rounding rules). A norm a dx site covers (this round,
or fused by an earlier one whose dgamma may be left to the program on purpose) is
never read again as a dgamma-only site.

The whole ops (last section). torch 2.13 routes ``F.rms_norm`` to
``aten._fused_rms_norm``, which decomposes (CompositeImplicitAutograd) except on a
device with its own kernel (CUDA, MPS, XPU); there autograd's backward is
``aten._fused_rms_norm_backward(dy, x, normalized_shape, rstd, weight,
output_mask) -> (dx, dweight)`` and AOTAutograd keeps it whole. Its rstd is
``rsqrt(mean(x**2) + eps)`` (float32 for fp16/bf16/fp32 x, keep-dim shaped; the
plain ``x.shape[:n]`` is taken too), the same 1/RMS as RmsNormGrad's, so each call
is rewritten into ``rms_norm_grad(dy, x, rstd, weight or ones)`` with the outputs
``output_mask`` asks for, cast back to the call's dtypes and shapes, under the same
dtype table and chip limits, or left whole as a miss with the reason. No torch_npu
line from 2.6.0 to 2.14.0 registers an NPU kernel for either op (read in the
wheels; docs/compatibility.md has the table), so on torch_npu the decomposed form is what the
pass sees today. A whole forward ``_fused_rms_norm`` is not rewritten (and has no torchair
converter): each one is recorded as a miss, by the forward rule where it runs.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch.fx as fx

from ...lowering import RMS_NORM as FORWARD_OP, RMS_NORM_GRAD as OP
from ..evaluator import JointProvenance
from ..pairing import backwards_of_forward_misses
from ..rewrite import Miss, RuleContext
from ..rule import Form, FusionRule, RoundReport, SiteProbe
from .match import NormMatch, site_region
from .whole import WholeBackwardMatch, emit_whole_backward, whole_backward_sites
from .emit import emit as emit_site
from .sites import DX_DEPTH, find_again, find_sites
from .misses import unexplained
from ..rms_statistic import whole_forward_misses


class RmsNormGradRule(FusionRule):
    """RMSNorm's backward, matched by value in exact symbolic expressions (:mod:`..algebra`),
    rewritten into ``rms_norm_grad``; also every whole ``aten._fused_rms_norm_backward``."""

    stage = "backward"
    domain = "norm_algebra"
    ops = (OP,)
    site_probe = SiteProbe(kind=OP.option, module_classes=r"RMSNorm",
                           source=r"rsqrt\(\s*\w+\.pow\(2\)\.mean\(|\.pow\(2\)\.mean\(-1, keepdim=True\)",
                           excluded=r"-\s*mean\b")
    forms = tuple(Form(*row) for row in (
        ("fp32 statistics, `weight * x.to(dtype)`", "HF `LlamaRMSNorm` and its copies"),
        ("`torch.nn.RMSNorm`, `F.rms_norm`, with or without weight", "PyTorch"),
        ("`x * (1 + weight)` in fp32", "Gemma"),
        ("normalized input cast to the weight's dtype", "T5"),
        ("per-head norms on 4-D tensors; gamma over several trailing axes", "Qwen3 q/k norms"),
        ("dx summed into the residual gradient (no cast in between)", "fp32 models"),
        ("rstd saved by the partitioner or recomputed in the backward", "default and min-cut partitioners"),
        ("output scaled by a constant before use", "MiniCPM3's logits scaling"),
        ("gated norms: `norm(x) * gate` (dy = grad * gate)", "Qwen3-Next, Qwen3.5, Kimi `o_norm`"),
        ("post- and sandwich norms: dy is another norm's dx (or the sum of several), x another norm's output", "Gemma 2/3, OLMo 2/3, GLM-4, EXAONE 4, nanochat, HRM"),
        ("x a computed value (`norm(relu(g)**2 * up)`)", "BitNet"),
        ("float32 statistics with a bf16 weight (gamma widened exactly, dgamma narrowed back)", "torchtitan Qwen3 qk-norms in bf16"),
        ("autocast with fp32 weights; a bf16 input's normalized value rounded to bf16 before an fp32 weight (dx fused, dgamma left to the program)", "Trainer `bf16=True`; Qwen3 q/k norms under autocast"),
        ("symbolic hidden size (`dynamic=True` with the size from an input)", "dynamic shapes"),
        ("`(mean(x*x) + eps) ** -0.5`, `x / sqrt(mean(x*x) + eps)`, a statistic taken with `keepdim=False` then `unsqueeze(-1)`", "hand-written norms"),
        ("the norm's output read by several readers (dy the sum of their gradients)", "a final norm feeding an extra head and an auxiliary loss"),
        ("inside training graphs: activation checkpointing (full, selective), compiled autograd, DDP, FSDP2", "torchtitan, transformers' `gradient_checkpointing_enable`"),
        ("`aten._fused_rms_norm_backward` kept whole (the outputs its `output_mask` asks for; with or without weight)", "`F.rms_norm` on a device with its own RMSNorm kernel (CUDA, XPU; none on torch_npu yet)"),
    ))

    def find(self, graph: fx.Graph, ctx: RuleContext) -> RoundReport:
        report = find_sites(graph, ctx)
        report.matches += whole_backward_sites(graph)
        return report

    def outputs(self, match: NormMatch) -> Dict[str, fx.Node]:
        if match.dgamma_only:
            return {"dgamma": match.dgamma}
        return {"dx": match.dx, **({"dgamma": match.dgamma} if match.dgamma is not None else {})}

    def region(self, match: NormMatch, outputs) -> List[fx.Node]:
        return site_region(match, outputs)

    def find_again(self, ctx: RuleContext, match: NormMatch, leaves) -> Optional[NormMatch]:
        return find_again(ctx, match, leaves)

    def emit(self, ctx: RuleContext, match):
        if isinstance(match, WholeBackwardMatch):
            return emit_whole_backward(ctx, match)
        return emit_site(ctx, self, match)

    def unexplained(self, graph: fx.Graph, ctx: RuleContext, misses) -> List[Miss]:
        # the whole forward is a forward site: the forward rule's where it runs (a joint graph);
        # that rule is on when its op's option is (a rule's option is its op's unless it declares one)
        owned = FORWARD_OP.option in ctx.context.enabled and isinstance(ctx.provenance, JointProvenance)
        whole = [] if owned else whole_forward_misses(graph, ctx.provenance, OP.name)
        found = unexplained(graph, ctx.provenance, misses, ctx.subjects) + whole
        return found + backwards_of_forward_misses(ctx.context, FORWARD_OP.name, OP, "RMSNorm", [*misses, *found],
                                                   DX_DEPTH)
