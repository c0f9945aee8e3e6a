"""How an RMS statistic and a normalized value are spelled and proven by their definitions, shared by the RMSNorm rules."""
from __future__ import annotations

import operator
from typing import List, Optional

import torch.fx as fx

from ..compat import FUSED_RMS_NORM
from ..lowering import RMS_NORM as FORWARD_OP
from ..lowering.sizes import static_int
from .algebra import graph_constant
from .evaluator import Provenance
from .mean_squares import (MOVING_CLAMPS, SAME_VALUES, VECTOR_NORM_HOW, definition_of, is_centred, moving_clamp_how,  # noqa: F401
                           is_number, other_mean_square, squared_vector_norm, squares_of)
from .norm_algebra import CLAMPS, NormEvaluator, clamp_bounds
from .nodes import CAST_TARGETS, VIEWS, aten, calls_to, normalize_dim, shape, val
from .rewrite import Miss


#: RMSNorm's backward involves dy, x, gamma, rstd and one sum, where x may be a chain of
#: earlier norms' outputs (two symbols each): anything with many more leaves is some other
#: computation, and expanding it would only cost time
MAX_SYMBOLS = 16
#: rstd is an input of the fused op: the evaluator keeps it a leaf
POLICY_LEAVES = frozenset({aten.rsqrt.default})


def norm_evaluator(norm_shape, provenance: Optional[Provenance] = None, forced_leaves=()) -> NormEvaluator:
    """The norm domain's evaluator with RMSNorm's bounds."""
    return NormEvaluator(norm_shape, provenance, forced_leaves, max_symbols=MAX_SYMBOLS, policy_leaves=POLICY_LEAVES)


#: ops an RMS statistic may pass through on its way to the backward: casts, copies and views
_STAT_PASSTHROUGH = CAST_TARGETS | VIEWS


def is_rms_statistic(node: fx.Node, provenance: Optional[Provenance]) -> bool:
    """``rsqrt(mean(y*y) + eps)`` or ``(mean(y*y) + eps) ** -0.5``, seen through casts, views and
    saved tensors' forward definitions: the statistic of an RMSNorm, not of a LayerNorm (whose
    mean is of a centred square)."""
    for _ in range(8):
        if node.op == "placeholder" and provenance is not None:
            node = provenance.forward_definition(node) or node
        if node.op != "call_function" or node.target not in _STAT_PASSTHROUGH:
            break
        node = node.args[0]
    root = node.op == "call_function" and (node.target is aten.rsqrt.default or (
        node.target is aten.pow.Tensor_Scalar and node.args[1] == -0.5))
    if not root or not isinstance(node.args[0], fx.Node) or node.args[0].target not in (
            aten.add.Tensor, aten.add.Scalar):
        return False
    mean = next((a for a in map(unclamped, node.args[0].args) if isinstance(a, fx.Node)
                 and a.target in (aten.mean.dim, aten.sum.dim_IntList)), None)
    square = mean.args[0] if mean is not None else None
    return isinstance(square, fx.Node) and square.op == "call_function" and (
        (square.target is aten.pow.Tensor_Scalar and square.args[1] == 2)
        or (square.target is aten.mul.Tensor and square.args[0] is square.args[1]))


# -- dgamma alone: a norm whose input takes no gradient ----------------------------

#: what the forward rule puts between the fused ``rms_norm`` and the program's values: casts,
#: reshapes and the permutations of a norm run in another memory order (each undone on the way out)
_FUSED_FORWARD_WRAPPING = SAME_VALUES | {aten.permute.default}


def _fused_forward_output(node: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """Which output of a fused ``npu_fusion.rms_norm`` ``node`` is, if any.

    ``(index, x, k, gamma)`` when ``node`` is output ``index`` of a fused ``npu_fusion.rms_norm``
    of ``x`` over its last k axes (0: y, 1: rstd), seen through the casts, reshapes and
    permutations the forward rule wraps it in and saved tensors' forward definitions; ``x`` is
    the program's own node."""
    def unwrapped(n: fx.Node) -> fx.Node:
        for _ in range(12):
            if n.op == "placeholder" and provenance is not None:
                n = provenance.forward_definition(n) or n
            if n.op != "call_function" or n.target not in _FUSED_FORWARD_WRAPPING \
                    or not isinstance(n.args[0], fx.Node):
                break
            n = n.args[0]
        return n
    node = unwrapped(node)
    if not (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node) and node.args[0].target is FORWARD_OP.overload):
        return None
    x, gamma, _ = node.args[0].args[:3]
    return node.args[1], unwrapped(x), len(shape(gamma)), gamma


def fused_statistic_operand(node: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """``(x, k)`` when ``node`` is the rstd output of a fused forward ``rms_norm`` of x: what
    :func:`rms_statistic_operand` reads in a decomposed statistic. The backward's scans read both:
    a forward fused before its backward hides no statistic from them."""
    found = _fused_forward_output(node, provenance)
    return found[1:3] if found is not None and found[0] == 1 else None


def fused_normalized_operand(node: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """The x and axes that ``node`` is normalized over by a fused forward ``rms_norm``, if any.

    ``(x, k)`` when ``node`` is x normalized by a fused forward ``rms_norm``: its y where the
    weight is ones (a norm without weight), or ``x * its rstd`` (the program's y the forward rule
    leaves to the backward's readers under min-cut); :func:`normalized_operand`'s fused twin."""
    found = _fused_forward_output(node, provenance)
    if found is not None:
        index, x, k, gamma = found
        return (x, k) if index == 0 and _is_ones(gamma, provenance) else None
    return normalized_operand(node, provenance, statistic=fused_statistic_operand)


def _is_ones(node, provenance: Optional[Provenance]) -> bool:
    """``node`` is a tensor of ones the program or the forward rule made (a norm without weight)."""
    node = definition_of(node, provenance) if isinstance(node, fx.Node) else node
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in (
        aten.full.default, aten.ones.default) and (node.target is aten.ones.default or node.args[1] == 1)


def exact_source(node: fx.Node, provenance: Optional[Provenance]) -> fx.Node:
    """The tensor ``node`` holds exactly (through exact casts and reshapes), as a backward node
    where the backward has it: one key for a forward value and its saved or recomputed copy."""
    node = definition_of(node, provenance, exact=True)
    saved = provenance.saved_in_backward(node) if provenance is not None and provenance.is_forward(node) else None
    return node if saved is None else definition_of(saved, provenance, exact=True)


def rms_statistic_operand(node: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """``(y, k)`` when ``node`` is ``rsqrt(mean(y*y, last k axes, keepdim) + eps)`` (or its
    ``** -0.5``) with eps inside the root (a number >= 0, or a one-element tensor): the statistic
    of an RMSNorm of ``y`` over its last k axes. Structural, as the forward is no Laurent
    polynomial: a LayerNorm's centred square, eps outside the root or another axis is none."""
    found = rms_root(definition_of(node, provenance), provenance, _is_reciprocal_root)
    return found[:2] if found is not None and found[2] else None


def unclamped(node):
    """The v of ``clamp(v, min=c)`` with c <= 0 a number and no max, else ``node`` itself.

    Below a root, v a mean of squares: such a clamp moves no value (a mean of squares is >= 0, and
    clamp keeps NaN), and the norm algebra reads it as v (:meth:`~.norm_algebra.NormEvaluator._clamp`)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in CLAMPS
            and isinstance(node.args[0], fx.Node)):
        return node
    low, high = clamp_bounds(node)
    return node.args[0] if low is not None and low <= 0 and high is None else node


def _mean_below(node: fx.Node, provenance: Optional[Provenance]) -> fx.Node:
    """``node`` through casts, reshapes, saved tensors' definitions and a clamp at or below 0 (:func:`unclamped`)."""
    return definition_of(unclamped(definition_of(node, provenance)), provenance)


def _is_reciprocal_root(node: fx.Node) -> bool:
    return node.target is aten.rsqrt.default or (node.target is aten.pow.Tensor_Scalar and node.args[1] == -0.5)


def rms_root(node: fx.Node, provenance: Optional[Provenance], is_root, every_axis: bool = False) -> Optional[tuple]:
    """``(y, k, keepdim)`` when ``node`` is ``root(mean(y*y, last k axes) + eps)`` for a ``root``
    op ``is_root`` accepts, eps inside the root; ``keepdim`` whether the mean keeps its axes.

    The mean is over some of y's axes, never all (the forms need a leading axis); with
    ``every_axis`` it is over all of them instead (:func:`over_every_axis`)."""
    if node.op != "call_function" or not is_root(node):
        return None
    shifted = node.args[0]
    if not (isinstance(shifted, fx.Node) and shifted.target in (aten.add.Tensor, aten.add.Scalar)
            and shifted.kwargs.get("alpha", 1) == 1):
        return None
    operands = [a for a in shifted.args[:2]
                if isinstance(a, fx.Node) and _mean_below(a, provenance).target is aten.mean.dim]
    if len(operands) != 1:
        return None
    mean = _mean_below(operands[0], provenance)
    if not is_scalar_eps(next(a for a in shifted.args[:2] if a is not operands[0])):
        return None
    square, dims = mean.args[0], mean.args[1]
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if not (isinstance(square, fx.Node) and dims and mean.kwargs.get("dtype") is None):
        return None
    if square.target is aten.pow.Tensor_Scalar and square.args[1] == 2:
        y = square.args[0]
    elif square.target is aten.mul.Tensor and square.args[0] is square.args[1]:
        y = square.args[0]
    else:
        return None
    rank = len(shape(y))
    dims = sorted(normalize_dim(d, rank) for d in dims)
    if dims != list(range(rank - len(dims), rank)) or (len(dims) == rank) != every_axis or is_centred(y, provenance):
        return None
    return y, len(dims), bool(keepdim)


#: why an RMSNorm over every axis of its input stays unfused (in either direction)
EVERY_AXIS_REASON = ("an RMSNorm over every axis of x (no leading axis: a 1-D x, or a mean over all of x's axes), "
                     "which no decomposed form reads; give x a leading axis of size 1 (x.unsqueeze(0), then "
                     "squeeze the result) and it fuses")


def over_every_axis(node: fx.Node, provenance: Optional[Provenance]) -> bool:
    """``node`` is an RMS statistic ``rsqrt(mean(y*y) + eps)`` (or its ``** -0.5``, through casts,
    views and saved tensors' definitions) whose mean is over every axis of y: a norm no form reads."""
    return rms_root(definition_of(node, provenance), provenance, _is_reciprocal_root, every_axis=True) is not None


#: why an RMSNorm spelled with a division by the root did not fuse (the dgamma-only form cannot read it)
DIVISION_REASON = ("an RMSNorm spelled x / sqrt(mean(x*x) + eps) (a division by the root) that no form matched "
                   "here (the weight-gradient-only backward does not read the division); write "
                   "x * torch.rsqrt(mean(x*x) + eps), the same value, and it fuses wherever the rsqrt spelling does")
#: why an RMSNorm whose statistic drops the normalized axes did not fuse (the dgamma-only form cannot read it)
KEEPDIM_REASON = ("an RMSNorm statistic rsqrt(mean(x*x) + eps) taken with keepdim=False and unsqueezed after, "
                  "that no form matched here (the weight-gradient-only backward does not read it); write "
                  "x.pow(2).mean(-1, keepdim=True), the same value, and it fuses wherever that spelling does")


def unmatched_spelling(node: fx.Node, provenance: Optional[Provenance]) -> Optional[str]:
    """Why ``node`` is an RMSNorm spelling no form reads, or None.

    Why ``node`` (through casts, reshapes and saved tensors' definitions) is an RMSNorm
    spelling no form reads, or None: a value divided by the root ``sqrt(mean(y*y) + eps)``, or a
    statistic ``rsqrt(mean(y*y) + eps)`` whose mean drops its axes (``keepdim=False``)."""
    root = spelled_root(node, provenance)
    if root is None:
        return None
    return DIVISION_REASON if root.target is aten.sqrt.default else KEEPDIM_REASON


def spelled_root(node: fx.Node, provenance: Optional[Provenance]) -> Optional[fx.Node]:
    """The root node of an RMSNorm spelling no form reads (see :func:`unmatched_spelling`):
    ``node`` is a value divided by a ``sqrt`` root, or a statistic taken with ``keepdim=False``
    or a value times it."""
    node = definition_of(node, provenance)
    candidates = [node]
    if node.op == "call_function" and node.target in (aten.div.Tensor, aten.mul.Tensor):
        candidates += [definition_of(a, provenance) for a in node.args[:2] if isinstance(a, fx.Node)]
    for root in candidates:
        if rms_root(root, provenance, lambda n: n.target is aten.sqrt.default) is not None and (
                node.target is aten.div.Tensor and root is definition_of(node.args[1], provenance)):
            return root
        found = rms_root(root, provenance, _is_reciprocal_root)
        if found is not None and not found[2]:
            return root
    return None


#: why an RMSNorm whose eps bounds the mean square from below stays unfused (in either direction)
CLAMPED_EPS_REASON = ("an RMS statistic rsqrt(clamp_min(mean(x*x), eps)) (eps as a lower bound of the mean square, not "
                      "added to it): another function than the fused ops' rsqrt(mean(x*x) + eps), so no RMSNorm form "
                      "reads it; if the model can take eps added inside the root, write "
                      "x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) and it fuses")


def clamped_statistic(node: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """``(y, k, reason)`` when ``node`` is ``root(clamp_min(mean(y*y, k axes), eps))``, eps a number >= 0: a clamped statistic.

    ``node`` (through casts, views and saved tensors' definitions) is ``rsqrt``, ``** -0.5`` or
    ``sqrt`` of ``clamp_min(mean(y*y), eps)`` (or ``clamp(..., min=eps)``) over k of y's axes: a norm
    no form reads, each way one miss whose ``reason`` is :data:`CLAMPED_EPS_REASON` over some of y's
    last axes, and says which axes where the mean is over others or over all of them (each alone a
    miss too: :func:`resembling_statistic`, :data:`EVERY_AXIS_REASON`)."""
    node = definition_of(node, provenance)
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node) or not (
            node.target in (aten.rsqrt.default, aten.sqrt.default)
            or (node.target is aten.pow.Tensor_Scalar and node.args[1] == -0.5)):
        return None
    clamped = definition_of(node.args[0], provenance)
    if clamped.op != "call_function" or clamped.target not in (aten.clamp_min.default, aten.clamp.default):
        return None
    low = clamped.args[1] if len(clamped.args) > 1 else clamped.kwargs.get("min")
    high = clamped.args[2] if len(clamped.args) > 2 else clamped.kwargs.get("max")
    mean = definition_of(clamped.args[0], provenance) if isinstance(clamped.args[0], fx.Node) else None
    if high is not None or isinstance(low, fx.Node) or graph_constant(low) is None or graph_constant(low) < 0 \
            or mean is None or mean.target is not aten.mean.dim or len(mean.args) < 2 or not mean.args[1]:
        return None
    square = mean.args[0]
    if not isinstance(square, fx.Node) or not (
            (square.target is aten.pow.Tensor_Scalar and square.args[1] == 2)
            or (square.target is aten.mul.Tensor and square.args[0] is square.args[1])):
        return None
    y = square.args[0]
    rank = len(shape(y)) if isinstance(y, fx.Node) and shape(y) is not None else 0
    dims = sorted(set(normalize_dim(d, rank) for d in mean.args[1])) if rank else []
    if not dims or is_centred(y, provenance):
        return None
    if dims != list(range(rank - len(dims), rank)):
        return y, len(dims), _clamped_over(f"axes {dims} of a rank-{rank} tensor, not its last axes")
    if len(dims) == rank:
        return y, len(dims), _clamped_over(f"every axis of a rank-{rank} tensor (an RMSNorm keeps a leading axis)")
    return y, len(dims), CLAMPED_EPS_REASON


def _clamped_over(axes: str) -> str:
    """The reason of a miss at a clamped statistic whose mean is over ``axes``, not some of the last ones."""
    return (f"an RMS statistic rsqrt(clamp_min(mean(x*x), eps)) whose mean is over {axes}: eps as a lower bound of "
            "the mean square, not added to it, and no RMSNorm form is over those axes; if this is an RMSNorm, write "
            "x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) and it fuses")


#: arithmetic by a number a near miss's mean of squares may pass through before eps is added
_SCALINGS = (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar)


def resembling_statistic(node: fx.Node, provenance: Optional[Provenance]) -> Optional[str]:
    """How ``node``, a root of a mean of squares plus eps that is no RMS statistic, differs from one, or None.

    ``node`` is ``rsqrt``, ``** -0.5`` or ``sqrt`` of ``c * mean(y*y, axes) + eps`` (or a
    ``sum`` divided by any count, over any axes, y not centred) but not
    ``root(mean(y*y, last axes) + eps)`` itself (:func:`rms_root`): the statistic an RMSNorm
    near miss computes (a scaled mean, a sum over another count, another axis), which the
    backward rule's scans read as an RMS statistic too. None for anything else."""
    found = _resembling(node, provenance)
    return found[0] if found is not None else None


def resembling_operand(node: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """``(y, k, how)`` when ``node`` is a statistic of y over k axes resembling an RMS statistic.

    ``node`` (through casts, views and saved tensors' definitions) is a statistic of y over k axes that
    :func:`resembling_statistic` says ``how`` differs from an RMS statistic, over some of y's axes (one
    over every axis is :func:`over_every_axis`'s)."""
    found = _resembling(definition_of(node, provenance), provenance)
    if found is None or found[2] == len(shape(found[1])):
        return None
    how, y, k = found
    return y, k, how


def _resembling(node: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """``(how, y, k)`` for :func:`resembling_statistic`: how it differs, what it is a statistic of, over how many axes."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node) or not (
            node.target in (aten.rsqrt.default, aten.sqrt.default)
            or (node.target is aten.pow.Tensor_Scalar and node.args[1] == -0.5)):
        return None
    if rms_root(node, provenance, lambda n: True) is not None:
        return None
    shifted = definition_of(node.args[0], provenance)
    if shifted.target not in (aten.add.Tensor, aten.add.Scalar) or shifted.kwargs.get("alpha", 1) != 1:
        return None
    for reduced, eps in (shifted.args[:2], shifted.args[1::-1]):
        if not isinstance(reduced, fx.Node) or not is_scalar_eps(eps):
            continue
        scaled = False
        reduced = definition_of(reduced, provenance)
        for _ in range(2):
            if reduced.target in _SCALINGS and is_number(reduced.args[1]):
                reduced, scaled = definition_of(reduced.args[0], provenance), True
        norm = squared_vector_norm(reduced, provenance)
        if norm is not None:
            return VECTOR_NORM_HOW, norm[0], len(norm[1])
        if reduced.target in MOVING_CLAMPS and isinstance(reduced.args[0], fx.Node):
            if unclamped(reduced) is reduced.args[0]:  # a clamp that moves no value: read what it clamps
                reduced = definition_of(reduced.args[0], provenance)
            elif (clamped := squares_of(definition_of(reduced.args[0], provenance), provenance)) is not None:
                y, dims = clamped
                return moving_clamp_how(reduced), y, len(dims)
        other = other_mean_square(reduced, provenance)
        if other is not None:
            return other
        if reduced.target not in (aten.mean.dim, aten.sum.dim_IntList) or not isinstance(reduced.args[0], fx.Node):
            continue
        square = reduced.args[0]
        axes = reduced.args[1] if len(reduced.args) > 1 else None
        squared = square.args[0] if (square.target is aten.pow.Tensor_Scalar and square.args[1] == 2) or (
            square.target is aten.mul.Tensor and square.args[0] is square.args[1]) else None
        if not isinstance(squared, fx.Node) or shape(squared) is None or is_centred(squared, provenance):
            continue
        rank = len(shape(squared))
        dims = sorted(normalize_dim(d, rank) for d in (axes or range(rank)))
        if dims != list(range(rank - len(dims), rank)):
            return f"a mean of squares over axes {dims} of a rank-{rank} tensor, not its last axes", squared, len(dims)
        if len(dims) == rank:
            return "a mean of squares over every axis of the tensor (an RMSNorm keeps a leading axis)", squared, rank
        if scaled or reduced.target is aten.sum.dim_IntList:
            return ("a mean of squares scaled by a constant, or a sum of squares divided by a count", squared,
                    len(dims))
        return "a cast or a view between the root and its mean plus eps", squared, len(dims)
    return None


def eps_outside_reason(written: str) -> str:
    """The reason of a miss at a norm whose eps is added to its root ``written`` (``sqrt(mean(x*x))``), not inside it."""
    return (f"eps is added outside the root ({written} + eps): another function "
            "than the fused ops' x * rsqrt(mean(x*x) + eps), which no RMSNorm form reads; if the model can take eps "
            "inside the root, write x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) and it fuses")


def root_plus_eps(node: fx.Node, provenance: Optional[Provenance]) -> Optional[str]:
    """``sqrt(mean(y*y))`` (or ``rsqrt``) written as the program did, when ``node`` is it plus a number, else None."""
    node = definition_of(node, provenance)
    if node.op != "call_function" or node.target not in (aten.add.Tensor, aten.add.Scalar):
        return None
    for root, eps in (node.args[:2], node.args[1::-1]):
        root = definition_of(root, provenance) if isinstance(root, fx.Node) else None
        if root is None or not is_scalar_eps(eps) or root.op != "call_function" \
                or root.target not in (aten.sqrt.default, aten.rsqrt.default) or not isinstance(root.args[0], fx.Node):
            continue
        mean = _mean_below(root.args[0], provenance)
        found = squares_of(mean, provenance) if mean.target is aten.mean.dim else None
        if found is not None:
            return written_statistic(root, 0)
    return None


def written_statistic(root: fx.Node, eps) -> str:
    """The statistic at ``root`` as the program wrote it (its root, eps inside it or none), for a miss's reason."""
    inside = "mean(x*x) + eps" if eps else "mean(x*x)"
    if root.target is aten.sqrt.default:
        return f"sqrt({inside})"
    return f"({inside}) ** -0.5" if root.target is aten.pow.Tensor_Scalar else f"rsqrt({inside})"


def resembling_reason(how: str) -> str:
    """The reason of a miss at a norm whose statistic :func:`resembling_statistic` says ``how`` differs (either way)."""
    return (f"a root of a mean of squares plus eps like an RMS statistic, but {how}: no RMSNorm form is "
            "rsqrt(mean(x*x) + eps) over x's last axes with eps a number; if this is an RMSNorm, write "
            "x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) and it fuses")


def is_scalar_eps(eps) -> bool:
    """A number >= 0, or a one-element tensor (``dynamic=True`` passes a float as a graph input)."""
    if isinstance(eps, fx.Node):
        return val(eps) is not None and all(static_int(n) == 1 for n in shape(eps))
    value = graph_constant(eps)
    return value is not None and value >= 0


def normalized_operand(node: fx.Node, provenance: Optional[Provenance],
                       statistic=rms_statistic_operand) -> Optional[tuple]:
    """``(y, k)`` when ``node`` is ``y * rms_statistic(y)`` (the normalized value the forward
    saves for the weight's gradient), the statistic read by ``statistic`` (by default as
    :func:`rms_statistic_operand` reads a decomposed one)."""
    node = definition_of(node, provenance)
    if node.op != "call_function" or node.target is not aten.mul.Tensor:
        return None
    for a, b in (node.args[:2], node.args[1::-1]):
        stat = statistic(b, provenance) if isinstance(b, fx.Node) else None
        if stat is not None and isinstance(a, fx.Node) and exact_source(a, provenance) is exact_source(stat[0], provenance):
            return stat
    return None


def is_call(node: fx.Node, target) -> bool:
    return target is not None and node.op == "call_function" and node.target is target


#: why a whole forward RMSNorm stays as it is
WHOLE_FORWARD_REASON = (
    "aten._fused_rms_norm (the whole forward torch keeps where the device has its own kernel) is not rewritten "
    "into npu-fusion's rms_norm (no torch_npu line routes F.rms_norm to it), and no torchair from torch_npu 2.6.0 "
    "to 2.14.0 has a converter for it (torchair stops with 'Failed to auto-generated converter'): decompose it, "
    "with the backend option decompositions='core' or torchair's custom_decompositions="
    "torch._decomp.get_decompositions([torch.ops.aten._fused_rms_norm]); its backward still fuses")


def whole_forward_misses(graph: fx.Graph, provenance: Optional[Provenance], op: str) -> List[Miss]:
    """A miss for ``op`` at every ``aten._fused_rms_norm`` call in the graph (recomputed there
    under activation checkpointing) or in the forward graph of its partition (named so): it
    stays as it is, never silently."""
    forward = provenance.forward if provenance is not None and provenance.forward is not None else None
    misses = [Miss(op, n.name, WHOLE_FORWARD_REASON) for n in calls_of(graph, FUSED_RMS_NORM)]
    return misses + [Miss(op, f"{n.name} (forward graph)", WHOLE_FORWARD_REASON)
                     for n in (calls_of(forward, FUSED_RMS_NORM) if forward is not None else ())]


def calls_of(graph: fx.Graph, target) -> List[fx.Node]:
    """The graph's calls of ``target`` in graph order (none where this torch has no such op: None)."""
    return calls_to(graph, target) if target is not None else []
