"""Whole ``aten._fused_rms_norm_backward`` calls: each one RMSNorm site, rewritten into ``rms_norm_grad``."""
from __future__ import annotations

import dataclasses
import operator
from typing import List

import torch
import torch.fx as fx

from ...compat import FUSED_RMS_NORM_BACKWARD
from ...lowering import RMS_NORM_GRAD as OP
from ...lowering.ops.rms_norm_grad import rms_norm_target_problem
from ..nodes import aten, dtype, shape, val
from ..rewrite import Insertion, Miss, RuleContext, commit, emit_fused_op, exact_common_dtype
from .emit import gamma_dtype_for
from ..rms_statistic import calls_of


# -- aten._fused_rms_norm_backward: the whole backward torch keeps on some devices ----

@dataclasses.dataclass
class WholeBackwardMatch:
    """One ``aten._fused_rms_norm_backward`` call; ``dx`` is the call itself (the key the rule
    runs the site's transaction under)."""
    dx: fx.Node


def whole_backward_sites(graph: fx.Graph) -> List[WholeBackwardMatch]:
    """Every ``aten._fused_rms_norm_backward`` call of the graph: each is one RMSNorm site."""
    return [WholeBackwardMatch(n) for n in calls_of(graph, FUSED_RMS_NORM_BACKWARD)]


def _whole_backward_outputs(node: fx.Node):
    """{"dx": getitem, "dgamma": getitem} of the outputs the program uses and its
    ``output_mask`` asks for, or a Miss when something else reads the call."""
    mask = node.args[5] if len(node.args) > 5 else node.kwargs["output_mask"]
    outputs = {}
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] not in (0, 1):
            return Miss(OP.name, node.name, f"{user.name} reads aten._fused_rms_norm_backward's result "
                                            f"other than by index")
        if mask[user.args[1]] and user.users:
            outputs[OP.outputs[user.args[1]]] = user
    return outputs


def emit_whole_backward(rewrites: RuleContext, match: WholeBackwardMatch):
    """Rewrite a whole ``aten._fused_rms_norm_backward`` into ``rms_norm_grad``.

    ``aten._fused_rms_norm_backward(dy, x, normalized_shape, rstd, weight, output_mask)``
    rewritten into ``rms_norm_grad(dy, x, rstd, gamma)``: the same formula, rstd the same
    float32 ``1/RMS(x)`` (eps inside it), gamma the weight or ones; each output the program
    uses cast back to the call's dtype and shape. A Miss when the target refuses."""
    node, graph, edit, target = match.dx, rewrites.graph, rewrites.edit, rewrites.target
    dy, x, normalized_shape, rstd, weight = (node.args + (None,) * 5)[:5]
    outputs = _whole_backward_outputs(node)
    if isinstance(outputs, Miss) or not outputs:
        return outputs or Miss(OP.name, node.name, "no output of aten._fused_rms_norm_backward is used")
    compute = exact_common_dtype((dtype(dy), dtype(x)))
    gamma_dtype = gamma_dtype_for(compute, dtype(weight) if weight is not None else compute)
    problem = rms_norm_target_problem(target, compute, gamma_dtype, shape(x), len(normalized_shape))
    if problem is None and exact_common_dtype((torch.float32, dtype(rstd))) != torch.float32:
        problem = f"rstd dtype {dtype(rstd)} does not fit RmsNormGrad's float32 rstd"
    if problem is not None:
        return Miss(OP.name, node.name, f"aten._fused_rms_norm_backward: {problem}")
    with Insertion(graph, node.prev) as inserted:
        operands = [edit.cast(dy, compute), edit.cast(x, compute), edit.cast(rstd, torch.float32)]
        if weight is not None:
            operands.append(edit.cast(weight, gamma_dtype))
        else:  # a norm without weight: gamma of ones, as the decomposed form does
            operands.append(edit.call(aten.full.default, (list(normalized_shape), 1.0),
                                      {"dtype": compute, "device": val(x).device}))
        emitted = emit_fused_op(rewrites, OP, node, operands, outputs)
        if isinstance(emitted, Miss):
            return emitted
    fused, replacements = emitted
    region = [node] + [u for u in node.users if u.target is operator.getitem]
    return commit(edit, OP.name, None, region, outputs, replacements,
                  {"dy": dy, "x": x, "rstd": rstd, "gamma": weight}, inserted.nodes(), fused)
