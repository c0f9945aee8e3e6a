"""Fuse forward RoPE on the joint graph into ``npu_fusion.rotary_position_embedding``.

Unfused, as AOTAutograd writes HF ``apply_rotary_pos_emb`` for q (and again for k)::

    y = add(mul(q, cos), mul(cat(neg(slice(q, -1, D/2, D)), slice(q, -1, 0, D/2)), sin))

Fused::

    y = npu_fusion.rotary_position_embedding(q, cos, sin, mode=0)

How a match is found, by value in the backward rule's domain (:class:`~..lanes.LaneEvaluator`,
exact per-position polynomials of leaf elements) run on the forward nodes: a node is a RoPE
output when, for some mode and some leaves playing x, cos and sin, position i of its value is
``x[a(i)] * cos[i] + s(i) * x[b(i)] * sin[i]`` with ``a``, ``b`` and the signs ``s`` of the
mode (the transpose of the backward in docs/fused-ops.md#rotary_position_embedding_grad:
:func:`~..rotation.table_terms`), each table possibly negated as a whole. The fused op then reads the
nodes the site reads that hold x, cos
and sin exactly (a partial rotary's slice of q, a table after its ``unsqueeze``); an operand that
exists only in pieces (a half-width table read twice, x read as its even and odd lanes, the real
parts of a complex ``freqs_cis``, a cache's ``select``) is rebuilt from the node that holds its
elements with slices and ``cat`` (or ``stack``), and the rebuilt node is evaluated and must equal
the role position by position before the site fuses. Casts are identities of the domain and the rounding rules of
:func:`~..evaluator.rounding_problem` judge the output; since a rounded copy of a role equals the role in the
domain, every node the site reads of a role's elements must carry the rounding of the operand the fused op
reads (a table read rounded in some lanes and exactly in others is refused). A rotation is one site with its
backward: the backward rule's verdict on its tables' roundings and on what the target runs binds this rule,
and this rule's precision verdict gives a backward no form read its reason (:class:`~..context.SiteJudgements`). Only on a joint graph, after the backward
rules in each round: an intermediate a decomposed backward still reads (``rotate_half(q)`` for
a table's gradient) keeps the forward as it is until that backward is fused; and on an inference
graph (:class:`~..evaluator.InferenceProvenance`), where no backward pairs a rotation and what no
form matched is found by its shape (:func:`_left_rotations`).
"""
from __future__ import annotations

from typing import List

import torch.fx as fx

from ...lowering import ROPE as OP, ROPE_GRAD
from ..evaluator import InferenceProvenance, JointProvenance
from ..nodes import downstream, gradient_dependent
from ..rewrite import Miss, RuleContext
from ..pairing import calls, forward_is_complex, source, unpaired
from ..rotation import DX_DEPTH, element_moves, rotation_sums, symbolic_head_dims
from ..rule import Form, FusionRule, RoundReport, SiteProbe
from .match import ForwardRopeMatch
from .sites import sums_rotation_terms, find_sites
from .emit import emit as emit_site


def unexplained(graph: fx.Graph, provenance, misses: List[Miss]) -> List[Miss]:
    """Record each fused RoPE backward whose forward neither fused nor was recorded as a miss.

    No silent misses: a fused ``rotary_position_embedding_grad`` that no fused forward and no
    recorded forward miss accounts for is a rotation whose forward matched no form
    (:mod:`..pairing`); each a miss named by the backward node, saying what its forward is. An
    inference graph has no backward to pair with: there, each rotation left in it (:func:`_left_rotations`)."""
    if isinstance(provenance, InferenceProvenance):
        return _left_rotations(graph, misses)
    if not isinstance(provenance, JointProvenance):
        return []
    gradient = gradient_dependent(graph) or set()

    def tables(node, first):
        return source(node.args[first]), source(node.args[first + 1])

    lone = unpaired(calls(graph, ROPE_GRAD), calls(graph, OP), lambda n: tables(n, 1), lambda n: tables(n, 1),
                    misses)
    if not lone:
        return []
    why = ("its forward multiplies complex numbers (view_as_complex(x) * freqs_cis), and the fused op reads real "
           "cos and sin tables the program never holds whole; write the rotation with real cos/sin tables to fuse "
           "it" if forward_is_complex(graph, gradient) else
           "no forward RoPE form reads its forward (tables only in pieces, or a spelling the forward rule does "
           "not know; run with TORCH_LOGS=npu_fusion and dump_graphs to see it)")
    return [Miss(OP.name, n.name, f"this rotation's backward fused ({n.name}), but {why}") for n in lone]


#: why a rotation left in an inference graph stays as it is
LEFT_ROTATION_REASON = ("elements moved along the last axis and summed with products of tensors varying along it, as "
                        "a RoPE forward is, but no forward RoPE form reads it (its x, cos or sin not seen whole, or "
                        "a spelling the forward rule does not know; run with TORCH_LOGS=npu_fusion and dump_graphs "
                        "to see it)")


def _left_rotations(graph: fx.Graph, misses: List[Miss]) -> List[Miss]:
    """Rotations left after the pass on a graph with no backward to pair them, each a miss.

    Where no backward pairs a rotation (an inference graph), each sum of rotation terms (:func:`sums_rotation_terms`) near a move of elements along the last axis, left
    after the pass, that no recorded miss at it or after it accounts for, is a miss."""
    missed = {m.node for m in misses}
    seeds = element_moves(graph)
    left = rotation_sums(seeds, sums_rotation_terms, symbolic_only=False)
    return [Miss(OP.name, n.name, LEFT_ROTATION_REASON) for n in left
            if not any(d.name in missed for d in downstream(graph, [n], DX_DEPTH))]


class RopeForwardRule(FusionRule):
    """RoPE's forward on the joint graph, matched by value in per-position polynomials
    (:mod:`..lanes`), rewritten into ``rotary_position_embedding``."""

    stage = "joint"
    domain = "lanes"
    ops = (OP,)
    #: each rotation the model runs is one forward site, the backward's site
    site_probe = SiteProbe(kind=OP.option, same_sites_as=ROPE_GRAD.option)
    forms = tuple(Form(*row) for row in (
        ("forward on the joint graph, modes 0 to 3 (2 and 3 on Ascend 950 and `generic`), a table negated as "
         "a whole, partial rotary (the slice of x the rotation reads), tables broadcast from 11SD/1S1D/..., a 3-D x "
         "with `[S, D]` tables (as BNSD with N = 1)",
         "HF `apply_rotary_pos_emb`, GPT-J, DeepSeek-V3, nanochat"),
        ("forward operands only in pieces, rebuilt from the node holding them and checked by value: half-width "
         "tables read twice, x's even/odd lanes, complex `freqs_cis` (its real parts), a cache's selects",
         "GPT-OSS, HF DeepSeek/MLA, Llama 4, torchtitan, torchtune"),
    ))

    def find(self, graph: fx.Graph, ctx: RuleContext) -> RoundReport:
        return find_sites(graph, ctx)

    def static_sizes(self, graph: fx.Graph) -> list:
        return symbolic_head_dims(graph, False, sums_rotation_terms)

    def emit(self, ctx: RuleContext, match: ForwardRopeMatch):
        return emit_site(ctx, match)

    def unexplained(self, graph: fx.Graph, ctx: RuleContext, misses) -> List[Miss]:
        return unexplained(graph, ctx.provenance, misses)
