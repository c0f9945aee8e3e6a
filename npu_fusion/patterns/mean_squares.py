"""Means of squares a program spells otherwise than ``mean(x*x)``: what each is, and how it differs from the fused ops'.

The fused RMSNorm ops compute ``mean(x*x)`` over x's last axes and round it once. A statistic
built from another computation of the same mathematical value (``linalg.vector_norm(x)**2 / D``,
a matrix product of x with itself, ``var(x) + mean(x)**2``) or from a clamp that moves its values
is another function in floating point: the RMSNorm rules record each as a miss whose reason is the
``how`` these readers give (:func:`~.rms_statistic.resembling_statistic`), never a fused site.
"""
from __future__ import annotations

import math
import operator
from fractions import Fraction
from typing import Optional

import torch
import torch.fx as fx

from .algebra import graph_constant
from .evaluator import Provenance
from .nodes import CAST_TARGETS, VIEWS, aten, is_value_preserving_cast, normalize_dim, shape, val
from ..lowering.sizes import same_size

#: ops a statistic or a normalized value keeps its values through (casts, copies, reshapes);
#: slices, selections and transposes move elements and are not among them
SAME_VALUES = CAST_TARGETS | {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                               aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default}


def definition_of(node: fx.Node, provenance: Optional[Provenance], exact: bool = False) -> fx.Node:
    """``node`` seen through casts, reshapes and saved tensors' forward definitions (with
    ``exact``, through the casts that change no value only)."""
    for _ in range(8):
        if node.op == "placeholder" and provenance is not None:
            node = provenance.forward_definition(node) or node
        if node.op != "call_function" or node.target not in SAME_VALUES or not isinstance(node.args[0], fx.Node):
            break
        if exact and node.target in CAST_TARGETS and not is_value_preserving_cast(node):
            break
        node = node.args[0]
    return node


def is_centred(y: fx.Node, provenance: Optional[Provenance]) -> bool:
    """``y`` is ``a - mean(a)`` (a LayerNorm's centred value: its statistic is a variance)."""
    y = definition_of(y, provenance, exact=True)
    return y.op == "call_function" and y.target in (aten.sub.Tensor, aten.add.Tensor) and any(
        isinstance(a, fx.Node) and definition_of(a, provenance).target is aten.mean.dim for a in y.args[:2])


def _is_square(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and (
        (node.target is aten.pow.Tensor_Scalar and node.args[1] == 2)
        or (node.target is aten.mul.Tensor and node.args[0] is node.args[1]))


def squares_of(node: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """``(y, axes)`` when ``node`` is ``mean(y*y, axes)`` or ``sum(y*y, axes)`` (sorted, non-negative), y not centred."""
    if node.op != "call_function" or node.target not in (aten.mean.dim, aten.sum.dim_IntList) \
            or not _is_square(node.args[0]):
        return None
    y = node.args[0].args[0]
    if not isinstance(y, fx.Node) or shape(y) is None or is_centred(y, provenance):
        return None
    rank = len(shape(y))
    axes = node.args[1] if len(node.args) > 1 else None
    return y, sorted({normalize_dim(d, rank) for d in (axes or range(rank))})


#: how a statistic spelled through ``linalg.vector_norm`` differs from an RMS statistic
VECTOR_NORM_HOW = ("its mean of squares is spelled through linalg.vector_norm (vector_norm(x)**2 / D: a square root "
                   "then a square, rounded twice where the fused ops compute the mean of x*x and round once, so "
                   "not the same function in floating point)")


def squared_vector_norm(node: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """``(y, axes)`` when ``node`` is ``vector_norm(y, 2, axes) ** 2`` (or a square of ``sum(y*y) ** 0.5``, of
    ``sqrt(sum(y*y))``: its decompositions), y not centred; else None."""
    if node.op != "call_function" or node.target is not aten.pow.Tensor_Scalar or graph_constant(node.args[1]) != 2 \
            or not isinstance(node.args[0], fx.Node):
        return None
    norm = definition_of(node.args[0], provenance)
    if norm.op != "call_function" or not isinstance(norm.args[0], fx.Node):
        return None
    if norm.target is aten.linalg_vector_norm.default:
        order = norm.args[1] if len(norm.args) > 1 else norm.kwargs.get("ord", 2)
        axes = norm.args[2] if len(norm.args) > 2 else norm.kwargs.get("dim")
        y = norm.args[0]
        if graph_constant(order) != 2 or norm.kwargs.get("dtype") is not None:
            return None
    elif norm.target is aten.sqrt.default or (norm.target is aten.pow.Tensor_Scalar
                                              and graph_constant(norm.args[1]) == Fraction(1, 2)):
        total = definition_of(norm.args[0], provenance)
        found = squares_of(total, provenance) if total.target is aten.sum.dim_IntList else None
        return found
    else:
        return None
    if not isinstance(y, fx.Node) or shape(y) is None or is_centred(y, provenance):
        return None
    rank = len(shape(y))
    return y, sorted({normalize_dim(d, rank) for d in (axes or range(rank))})


def moving_clamp_how(clamp: fx.Node) -> str:
    """How a mean of squares passed through ``clamp`` (one that moves values) differs from an RMS statistic's."""
    low = clamp.args[1] if len(clamp.args) > 1 else clamp.kwargs.get("min")
    high = clamp.args[2] if len(clamp.args) > 2 else clamp.kwargs.get("max")
    if clamp.target is aten.clamp_max.default:
        low, high = None, low if low is not None else high
    bounds = ", ".join(f"{k}={'a tensor' if isinstance(b, fx.Node) else b}"
                       for k, b in (("min", low), ("max", high)) if b is not None)
    return (f"its mean of squares passes through clamp({bounds}), which is no identity on it (a NaN bound makes "
            "every value NaN, a bound above 0 or an upper bound moves values, a bound that is a tensor is unknown), "
            "so not the fused ops' mean of x*x; drop the clamp (a lower bound at or below 0 is kept: it moves no "
            "mean of squares)")


#: clamps a mean of squares may pass through (``clamp_max`` is Inductor's spelling of ``clamp(max=c)``)
MOVING_CLAMPS = (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default)
#: matrix products: a sum of products of x with itself accumulated by the matmul unit
_PRODUCTS = {aten.bmm.default, aten.mm.default, aten.matmul.default, aten.dot.default, aten.vdot.default}
_VECDOT = getattr(aten, "linalg_vecdot", None)
#: what the operands of a product may pass through on their way from x (moving no value of x)
_OPERAND_VIEWS = VIEWS | CAST_TARGETS | {aten.reshape.default}

SELF_PRODUCT_HOW = ("its mean of squares is spelled as a matrix product of x with itself (einsum('...d,...d->...', x, "
                    "x), x.unsqueeze(-2) @ x.unsqueeze(-1), bmm, dot or vecdot, divided by D): the matmul unit "
                    "accumulates the products in its own order and precision (in x's dtype for bf16 or fp16, "
                    "possibly at reduced precision on the device), so not the same function as the fused ops' mean "
                    "of x*x in floating point")


def _product_source(node, provenance: Optional[Provenance]):
    """The tensor an operand of a product reads, through views, expansions, casts and saved tensors' definitions."""
    for _ in range(12):
        if not isinstance(node, fx.Node):
            return node
        if node.op == "placeholder" and provenance is not None:
            node = provenance.forward_definition(node) or node
        if node.op != "call_function" or node.target not in _OPERAND_VIEWS or not isinstance(node.args[0], fx.Node):
            break
        node = node.args[0]
    return node


def _self_product(node: fx.Node, provenance: Optional[Provenance]) -> Optional[fx.Node]:
    """The y of a matrix product that is, per row, the dot product of y's last axis with itself, else None.

    One value per row of y (the product has y's element count over its last axis: not a Gram matrix,
    which pairs rows)."""
    if node.op != "call_function":
        return None
    if node.target is aten.einsum.default and len(node.args) > 1 and len(node.args[1]) == 2:
        operands = list(node.args[1])
    elif node.target is aten.sum.dim_IntList and isinstance(node.args[0], fx.Node) \
            and node.args[0].target is aten.mul.Tensor and node.args[0].args[0] is not node.args[0].args[1]:
        operands = list(node.args[0].args[:2])  # a product with a unit axis as Inductor decomposes it: mul, then sum
    elif node.target in _PRODUCTS or (_VECDOT is not None and node.target is _VECDOT.default):
        operands = list(node.args[:2])
    else:
        return None
    a, b = (_product_source(o, provenance) for o in operands)
    if a is not b or not isinstance(a, fx.Node) or not shape(a) or shape(node) is None or is_centred(a, provenance):
        return None
    total = math.prod(shape(a))
    if any(not isinstance(o, fx.Node) or shape(o) is None or not same_size(math.prod(shape(o)), total)
           for o in operands):
        return None  # a slice or a selection of x: some of its elements, not all of them
    return a if same_size(math.prod(shape(node)) * shape(a)[-1], total) else None


def is_number(arg) -> bool:
    """``arg`` is a number: a constant, or a symbolic size or float (``dynamic=True`` passes ``x.shape[-1]`` so)."""
    return graph_constant(arg) is not None or (
        isinstance(arg, fx.Node) and isinstance(arg.meta.get("val"), (torch.SymInt, torch.SymFloat, int, float)))


def _variance_and_mean(node: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """``(y, axes, correction)`` when ``node`` is ``var(y, axes) + mean(y, axes)**2`` (either order), else None."""
    if node.op != "call_function" or node.target is not aten.add.Tensor or node.kwargs.get("alpha", 1) != 1:
        return None
    for var, square in (node.args[:2], node.args[1::-1]):
        var = definition_of(var, provenance) if isinstance(var, fx.Node) else None
        square = definition_of(square, provenance) if isinstance(square, fx.Node) else None
        if var is None or square is None or not _is_square(square):
            continue
        mean = definition_of(square.args[0], provenance)
        var = _of_var_mean(var, 0)
        if var.target not in (aten.var.correction, aten.var_mean.correction):
            continue
        y = var.args[0]
        if not isinstance(y, fx.Node) or shape(y) is None:
            continue
        var_axes = var.args[1] if len(var.args) > 1 else var.kwargs.get("dim")
        if _of_var_mean(mean, 1) is var:  # torch.var_mean's own mean
            mean_axes = var_axes
        elif mean.target is aten.mean.dim and definition_of(mean.args[0], provenance) is definition_of(y, provenance):
            mean_axes = mean.args[1]
        else:
            continue
        rank = len(shape(y))
        axes = [sorted({normalize_dim(d, rank) for d in (dims or range(rank))}) for dims in (var_axes, mean_axes)]
        if axes[0] != axes[1]:
            continue
        correction = var.kwargs.get("correction", 1)
        return y, axes[0], graph_constant(correction) if correction is not None else 1
    return None


def _of_var_mean(node: fx.Node, index: int) -> fx.Node:
    """The ``var_mean`` call whose output ``index`` ``node`` is (0 the variance, 1 the mean), else ``node`` itself."""
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == index \
            and isinstance(node.args[0], fx.Node) and node.args[0].target is aten.var_mean.correction:
        return node.args[0]
    return node


def variance_how(correction) -> str:
    """How ``var(x) + mean(x)**2`` with this ``correction`` differs from an RMS statistic's mean of squares."""
    if correction == 0:
        return ("its mean of squares is spelled var(x, unbiased=False) + mean(x)**2: equal to mean(x*x) only up to "
                "rounding (a centred square's mean, a squared mean and their sum, each rounded, where the fused ops "
                "compute the mean of x*x and round once), so not the same function in floating point")
    return (f"its mean of squares is spelled var(x) + mean(x)**2 with the variance's correction {correction} (the "
            "unbiased variance, D/(D-1) times the mean of centred squares): not the mean of x*x at all")


def other_mean_square(node: fx.Node, provenance: Optional[Provenance]) -> Optional[tuple]:
    """``(how, y, k)`` when ``node`` is a mean of squares of y over its last k axes spelled by another computation.

    A matrix product of y with itself (per row: k is 1) or ``var(y) + mean(y)**2``; ``how`` says why
    it is not the fused ops' mean of ``y*y``. None for anything else."""
    y = _self_product(_product_source(node, provenance), provenance)
    if y is not None:
        return SELF_PRODUCT_HOW, y, 1
    found = _variance_and_mean(node, provenance)
    if found is not None and val(found[0]) is not None:
        y, axes, correction = found
        return variance_how(correction), y, len(axes)
    return None
