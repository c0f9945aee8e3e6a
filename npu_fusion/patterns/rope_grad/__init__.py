"""Fuse RoPE backward subgraphs into ``npu_fusion.rotary_position_embedding_grad``.

Unfused, as AOTAutograd writes the backward of ``q_embed = q * cos + rotate_half(q) * sin``
(HF ``apply_rotary_pos_emb``), for each of q and k::

    t     = mul(dy, sin)
    a, b  = slice(t, -1, 0, D/2), slice(t, -1, D/2, D)
    r     = slice_backward(neg(a), .., D/2, D) + slice_backward(b, .., 0, D/2)
    dx    = add(r, mul(dy, cos))                       # also full + slice_scatter forms
    dcos  = sum(mul(dy, x), broadcast dims)            # when cos/sin require grad
    dsin  = sum(mul(dy, rotate_half(x)), broadcast dims)

Fused::

    dx, dcos, dsin = npu_fusion.rotary_position_embedding_grad(dy, cos, sin, x?, mode)

How a match is found: every node is evaluated by :class:`~..lanes.LaneEvaluator`
into exact per-position polynomials of its leaves. A node is a ``dx`` when its
polynomials equal the op's formula (docs/fused-ops.md#rotary_position_embedding_grad) for some
mode and some leaves playing dy, cos and sin; a node is a ``dcos``/``dsin`` of that site when it equals the
broadcast-reduced ``dy * x`` / ``dy * rotate(x)`` with the same dy. Equality of
those polynomials is equality of the functions, so near misses (a wrong sign, a
wrong split point, a swapped table) simply do not match.

Where x is also read outside the rotation (``rope(q) * q``) or rotated twice, autograd sums
dx with x's other gradients and dx is no node of its own: at the root of such a tree of adds,
the summands but one are summed in the same algebra and matched as dx; the one left out
is added back to the fused dx (as the RMSNorm rule does with the residual gradient).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch.fx as fx

from ...lowering import ROPE as FORWARD_OP, ROPE_GRAD as OP
from ..pairing import backwards_of_forward_misses
from ..rotation import DX_DEPTH
from ..rewrite import Miss, RuleContext
from ..rule import Form, FusionRule, RoundReport, SiteProbe
from .match import RopeMatch, site_outputs, site_region
from ..rotation import sums_dx_terms, symbolic_head_dims
from .emit import emit as emit_site
from .sites import find_again, find_sites
from .misses import unexplained


class RopeGradRule(FusionRule):
    """RoPE's backward, matched by value in per-position polynomials (:mod:`..lanes`), rewritten
    into ``rotary_position_embedding_grad`` with the table gradients the graph computes."""

    stage = "backward"
    domain = "lanes"
    ops = (OP,)
    site_probe = SiteProbe(kind=OP.option, per_output=True,
                           functions=r"^_?apply_.*rot|^_?apply_.*rope|rotary_pos_emb$|^rotary_emb$",
                           excluded=r"vision|_2d|multidimensional|time_emb", module_classes=r"(?i)Rotary|RoPE")
    forms = tuple(Form(*row) for row in (
        ("mode 0 half: `rotate_half`", "HF `apply_rotary_pos_emb` (Llama, Qwen2/3, Mistral, Gemma, ...)"),
        ("mode 1 interleave: strided slices + stack + flatten", "GPT-J `rotate_every_two`, Cohere"),
        ("mode 1 interleave: complex `view_as_complex(x) * freqs_cis`", "Llama 4, DeepSeek-V2"),
        ("mode 2 quarter: four chunks", "targets `950`, `generic`"),
        ("mode 3 interleave-half: de-interleave then `rotate_half`", "DeepSeek-V3 (`view`/`transpose` or even/odd slices)"),
        ("partial rotary (`rotary_dim < head_dim`)", "GPT-NeoX `rotary_pct`, GPT-J `rotary_dim`, `partial_rotary_factor`"),
        ("half-width or complex tables rebuilt to full width", "`x1*cos - x2*sin` spellings, `freqs_cis`"),
        ("layouts BNSD, BSND, SBND, TND; cos/sin 11SD, B1SD, BNSD, 1S1D, BS1D, BSND, S11D, SB1D, T1D, TND, [S, D]", "`unsqueeze_dim=1/2`, packed sequences"),
        ("a 3-D q with `[S, D]` or `[1, S, D]` tables (heads folded into the batch, `[B*H, S, D]`, or one head, "
         "`[B, S, D]`): run as BNSD with N = 1 and 11SD tables, an axis of size 1 inserted",
         "GPT-NeoX-style code, single-head tutorials (`tests/test_rope_folded_heads.py`)"),
        ("cos/sin requiring grad: x passed, dcos/dsin wired", "learned or scaled tables; q and k sharing them"),
        ("learned tables rotating an x that takes no gradient: dcos/dsin alone, x passed and dx unused",
         "adversarial programs (`tests/test_spellings.py`)"),
        ("a rotation before the heads' transpose with its output flattened (dy a view of the flattened gradient)",
         "`proj(x).view(B, S, N, D)` rotated with `[B, S, 1, D]` tables, then `reshape(B, S, N * D)`"),
        ("one pair of `[S, D]` tables read as they are by a BNSD rotation (a transposed q) and as `cos[:, None]` "
         "by a BSND one (the `[S, 1, D]` view read as the BSND rotation's table)",
         "q transposed before its rotation and k after, or the other way round (`tests/test_rope_permuted.py`)"),
        ("output scaled by a constant before use", "`q * scale`, SDPA's math path"),
        ("a dy that is itself computed: output used elementwise, scaled per position, also when the rotation's backward reads it in pieces (halves, pair lanes)", "`q_rot . k_rot`, `q.square()`, Llama 4's L2 qk-norm, Ministral 3's q scaling, torchtune RoPE then `exp`"),
        ("dx summed in one accumulation with other gradients of x (x read again after the rotation, `rope(q) * q`, `rope(q) + q`; two rotations of one x), those added back", "adversarial programs (`tests/test_no_silent_misses.py`)"),
        ("a table negated as a whole (`cat(x2, -x1)`: mode 0 with sin negated)", "nanochat"),
        ("`[S, D]` and `[S, D/2]` tables on A2/A3, widened to 11SD as the forward widens them", "GPT-J-style interleave with half-width tables"),
        ("RoPE applied twice (the outer rotation built on the inner fused one)", "adversarial programs (`tests/test_spellings.py`)"),
        ("mode 1 interleave: `stack` of `x[..., 0]`/`x[..., 1]` products with a `[S, D/2, 2]` cache (`select_backward`)", "torchtune `RotaryPositionalEmbeddings`, `Llama3ScaledRoPE`"),
        ("`[S, B, H, D]` with tables computed from `freqs` in the graph, half or interleaved (`stack((-x2, x1), -1)`)", "Megatron-core `_apply_rotary_pos_emb_bshd`"),
        ("one rotated head expanded over the heads, or GQA's k expanded after RoPE (dy a sum over the copies)", "torchtitan DeepSeek-V3 MLA `k_pe`, torchtune GQA, DeepSeek-V2"),
        ("one table saved several times (copies of one forward expression are one value)", "torchtune's `cache[..., 0]` in two products"),
        ("complex tables broadcast head-first (`freqs_cis[None, None, :T]` on `[B, H, T, D]`), under either partitioner", "torchtitan `ComplexRoPE`"),
        ("autocast: a bf16 or fp16 x with float32 tables, GQA's k expanded while float32 (each term rounded to dk's dtype)", "Hugging Face Trainer `bf16=True`, `torch.autocast` training"),
        ("inside training graphs: activation checkpointing (full, selective), compiled autograd, DDP, FSDP2", "torchtitan, transformers' `gradient_checkpointing_enable`"),
    ))

    def find(self, graph: fx.Graph, ctx: RuleContext) -> RoundReport:
        return find_sites(graph, ctx)

    def static_sizes(self, graph: fx.Graph) -> list:
        return symbolic_head_dims(graph, True, sums_dx_terms)

    def outputs(self, match: RopeMatch) -> Dict[str, fx.Node]:
        return site_outputs(match)

    def region(self, match: RopeMatch, outputs) -> List[fx.Node]:
        return site_region(match, outputs)

    def find_again(self, ctx: RuleContext, match: RopeMatch, leaves) -> Optional[RopeMatch]:
        return find_again(ctx, match, leaves)

    def emit(self, ctx: RuleContext, match: RopeMatch):
        match.rest = [ctx.current(n) for n in match.rest]
        # the shared value may be a role now (a slice of a wide dy that dcos and dsin read
        # too): the match found again may see table gradients the first could not
        resolved = self.resolve_shared(ctx, match, site_outputs(match), refreshed_outputs=True)
        return resolved if isinstance(resolved, Miss) else emit_site(ctx, *resolved)

    def unexplained(self, graph: fx.Graph, ctx: RuleContext, misses) -> List[Miss]:
        found = unexplained(graph, ctx.provenance, misses)
        return found + backwards_of_forward_misses(ctx.context, FORWARD_OP.name, OP, "RoPE", [*misses, *found],
                                                   DX_DEPTH)
