"""RMSNorm backward rewrite: a matched site emitted as one ``rms_norm_grad`` call under the dtype table and chip limits."""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ...lowering import RMS_NORM_GRAD as OP
from ...lowering.ops.rms_norm_grad import RMS_NORM_DTYPES, rms_norm_target_problem
from ..evaluator import Provenance, kept_precision, rounding_problem
from ..nodes import aten, dtype, is_value_preserving_cast, last_of, shape, val
from ..rewrite import (Edit, Insertion, Miss, RuleContext, Site, add_back_accumulated, commit, emit_fused_op,
                       exact_common_dtype)
from ..pairing import site_key
from ..rule import FusionRule
from .match import NormMatch


# -- the rewrite --------------------------------------------------------------

def _widened_from(node: fx.Node, to: torch.dtype, provenance: Optional[Provenance]) -> bool:
    """Whether a saved tensor is a widening cast of a tensor of dtype ``to`` (so narrowing is exact)."""
    fw = provenance.forward_definition(node) if provenance is not None and node.op == "placeholder" else None
    return fw is not None and is_value_preserving_cast(fw) and dtype(fw.args[0]) == to


def gamma_dtype_for(compute: torch.dtype, gamma: torch.dtype) -> torch.dtype:
    """gamma's dtype for the fused op: its own, or float32 when the op's dtype table has no
    (compute, gamma) row but has (compute, float32); the widening cast is exact."""
    if (compute, gamma) not in RMS_NORM_DTYPES and (compute, torch.float32) in RMS_NORM_DTYPES \
            and exact_common_dtype((gamma, torch.float32)) == torch.float32:
        return torch.float32
    return gamma


def emit(rewrites: RuleContext, rule: FusionRule, site: NormMatch):
    """The site rewritten into one fused call (a :class:`Site`), or a :class:`Miss` saying why not."""
    current = rewrites.current
    site.rest = [current(n) for n in site.rest]
    site.dy, site.x, site.rstd, site.gamma = (current(n) for n in site.roles)
    if site.dgamma_only:
        outputs = {"dgamma": site.dgamma}
    else:
        outputs = {"dx": site.dx, **({"dgamma": site.dgamma} if site.dgamma is not None else {})}
    # a dgamma the program computes from a value it rounded more coarsely than it keeps dgamma
    # (autocast: a bf16 normalized x times an fp32 weight) is left to the program; dx still fuses
    dgamma_left = site.dgamma is not None and not site.dgamma_only and rounding_problem(
        site.ev, {"dgamma": site.dgamma}, [*site.roles, *site.rest])
    if dgamma_left:
        del outputs["dgamma"]
    resolved = rule.resolve_shared(rewrites, site, outputs)
    if isinstance(resolved, Miss):
        return resolved
    # dgamma judged above, in this evaluator with these roles: not judged again (found again, it is)
    judged = {"dgamma"} if "dgamma" in outputs and not site.dgamma_only and resolved[0] is site else set()
    site, outputs, region = resolved
    done = _emit(rewrites, site, outputs, region, judged)
    if dgamma_left and isinstance(done, Site):
        done.note = f"dgamma ({site.dgamma.name}) left to the program: {dgamma_left}"
    return done


def _emit(rewrites: RuleContext, site: NormMatch, outputs, region, judged=frozenset()):
    """The fused call for a resolved site, or a Miss; ``judged`` names outputs whose roundings were found fine already."""
    graph, edit, target, provenance = rewrites.graph, rewrites.edit, rewrites.target, rewrites.provenance
    dy_dtype, x_dtype = dtype(site.dy), dtype(site.x)
    wide = exact_common_dtype((dy_dtype, x_dtype))
    compute = dy_dtype if (x_dtype == wide and _widened_from(site.x, dy_dtype, provenance)) else wide
    if "dx" in outputs:
        compute = exact_common_dtype((compute, kept_precision(site.dx)))  # dx is returned in this dtype
    gamma_dtype = gamma_dtype_for(compute, dtype(site.gamma) if site.gamma is not None else compute)
    rounding = rounding_problem(site.ev, {k: v for k, v in outputs.items() if k not in judged},
                                [*site.roles, *site.rest])
    problem = rms_norm_target_problem(target, compute, gamma_dtype, shape(site.x), site.ev.k) or rounding
    if site.rstd is not None and "dx" in outputs:
        # the norm's verdict binds its forward (the same chips, dtypes and roundings; the shape
        # limits the forward op's own, not RmsNormGrad's); a dgamma-only site's is its dgamma's,
        # which the forward leaves to the program where it cannot fuse
        forward_problem = rms_norm_target_problem(target, compute, gamma_dtype, shape(site.x), site.ev.k,
                                                  ge_op="RmsNorm")
        rewrites.context.judgements.record(site_key(OP.option, site.rstd), forward_problem or rounding)
    if problem is not None:
        return Miss(OP.name, site.dx.name, problem)
    anchor = last_of(graph, [n for n in (site.dy, site.x, site.rstd, site.gamma) if n is not None])
    with Insertion(graph, anchor) as inserted:
        dy, x = edit.cast(site.dy, compute), edit.cast(site.x, compute)
        rstd = edit.cast(site.rstd, torch.float32) if site.rstd is not None else None
        if site.rstd_power != 1:  # the statistic the program holds, raised to rstd
            rstd = edit.call(aten.pow.Tensor_Scalar, (rstd, float(site.rstd_power)))
        gamma = edit.cast(site.gamma, gamma_dtype) if site.gamma is not None else None
        if gamma is None and site.dgamma_only:  # dx unused: any gamma; ones need no static size
            gamma = _ones_of_part(edit, x, site.ev.k, compute, gamma_part=True)
        if gamma is None:
            if not all(isinstance(x, int) for x in site.ev.norm_shape):
                return Miss(OP.name, site.dx.name, "a norm without weight over a symbolic size: mark the "
                                                   "hidden size static")
            gamma = edit.call(aten.full.default, (list(site.ev.norm_shape), 1.0),
                              {"dtype": compute, "device": val(site.dy).device})
        if rstd is None:  # dgamma from the saved normalized value alone: sum(dy * x_hat * 1)
            rstd = _ones_of_part(edit, x, site.ev.k, torch.float32, gamma_part=False)
        emitted = emit_fused_op(rewrites, OP, site.dx, (dy, x, rstd, gamma), outputs)
        if isinstance(emitted, Miss):
            return emitted
    fused, replacements = emitted
    added = inserted.nodes()
    if site.rest:
        added += add_back_accumulated(edit, site, replacements)
    return commit(edit, OP.name, None, region, outputs, replacements,
                  {"dy": site.dy, "x": site.x, "rstd": site.rstd, "gamma": site.gamma}, added, fused)


def _ones_of_part(edit: Edit, x: fx.Node, k: int, to: torch.dtype, gamma_part: bool) -> fx.Node:
    """Ones in the shape of rstd, or of a part of gamma, built from x.

    Ones of rstd's keep-dim shape ``x.shape[:n] + [1] * k`` (x sliced to one element along
    each normalized axis), or with ``gamma_part`` of gamma's ``x.shape[n:]`` (x's first element
    along each leading axis): views of x, so symbolic sizes need no size nodes."""
    part, n = x, len(shape(x)) - k
    for d in range(n) if gamma_part else range(n, n + k):
        part = edit.call(*((aten.select.int, (part, 0, 0)) if gamma_part
                                        else (aten.slice.Tensor, (part, d, 0, 1))))
    return edit.call(aten.full_like.default, (part, 1.0), {"dtype": to})
