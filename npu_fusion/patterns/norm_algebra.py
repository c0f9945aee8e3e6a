"""The norm domain: values of a graph with the normalized (trailing) axes abstracted.

A node's value is an exact Laurent polynomial in leaf symbols (:mod:`.algebra`: rational
coefficients, integer powers, fractional powers only of values known to be non-negative).
The trailing ``len(norm_shape)`` axes are abstracted: a leaf is a symbol that either spans
them (``x_i``) or is constant along them (a statistic ``r``), and a sum over them becomes a
symbol ``S[monomial]`` after expanding its summand; a symbolic size is a symbol too. Sums
over the leading axes are kept aside as ``lead_sum`` (a weight's gradient). One small
interpreter per aten op (:attr:`NormEvaluator.FORWARD_SAFE`, :attr:`NormEvaluator.BACKWARD_ONLY`);
any other op is a leaf.

Any normalization over trailing axes (RMSNorm, an AddRmsNorm, a LayerNorm's algebra) can be
read in it; bounds and policies specific to one op (how many leaves a value may have, which
ops stay leaves) are parameters, given by the rule (:func:`~.rms_statistic.norm_evaluator`).
No rule is imported here.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from typing import Dict, List, Optional

import torch
import torch.fx as fx

from ..compat import symbolic_expr
from ..lowering.sizes import same_shape, static_int
from .algebra import Expr, accumulate, graph_constant
from .evaluator import MemoEvaluator, Provenance, Unsupported
from .nodes import (CAST_TARGETS, VIEWS, aten, dtype, is_float_cast, is_value_preserving_cast, nan_wherever, normalize_dim,
                    shape, val)


@dataclasses.dataclass
class NormValue:
    expr: Expr
    #: for a sum over leading axes: (summand node, reduced dims), else None
    lead_sum: Optional[tuple] = None
    #: how many of the normalized axes the value's shape drops (a statistic taken with
    #: ``keepdim=False``): constant along them, read only by pointwise ops among such values and by
    #: the ``unsqueeze(-1)`` that puts the axes back (broadcast against x, its trailing axes are leading ones)
    dropped: int = 0


def size_key(x):
    """A size as a hashable value that equal sizes share: an int, or its symbolic expression."""
    if isinstance(x, torch.SymInt):
        expr = symbolic_expr(x)
        return int(expr) if expr.is_number else expr
    return x


BINARY_OPS = {aten.add.Tensor: operator.add, aten.add.Scalar: operator.add,
              aten.sub.Tensor: operator.sub, aten.sub.Scalar: operator.sub,
              aten.mul.Tensor: operator.mul, aten.mul.Scalar: operator.mul,
              aten.div.Tensor: operator.truediv, aten.div.Scalar: operator.truediv}
#: ops that only add or drop axes of size 1, keeping every element where it was along the others
ALIGNED_VIEWS = {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims}
#: pointwise ops, read among values that drop the normalized axes (:attr:`NormValue.dropped`) too
POINTWISE = {*BINARY_OPS, aten.pow.Tensor_Scalar, aten.neg.default, aten.sqrt.default, aten.reciprocal.default}
#: ops read even where their shape neither spans the normalized axes nor is 1 along them:
#: their interpreters check shapes themselves
SHAPE_CHECK_EXEMPT = {aten.sum.dim_IntList, aten.mean.dim, aten.view.default, aten.reshape.default,
                      aten._unsafe_view.default, *ALIGNED_VIEWS, *POINTWISE}


#: clamps whose bounds are numbers: identities of a value they cannot move (:meth:`NormEvaluator._clamp`)
CLAMPS = (aten.clamp.default, aten.clamp_min.default)


def clamp_bounds(node: fx.Node) -> tuple:
    """(min, max) of a ``clamp`` or ``clamp_min`` call: each a number, or None where there is no such bound.

    A bound that is no number (a tensor, a symbolic value) makes it no clamp by numbers: (None, NaN), which
    no reader takes."""
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    bounds = tuple(graph_constant(b) if b is not None else None for b in (low, high))
    if any(b is not None and n is None for b, n in zip((low, high), bounds)):
        return None, float("nan")
    return bounds


def is_zero(value) -> bool:
    """A zero number, or the zero scalar tensor AOTAutograd writes for one."""
    if isinstance(value, fx.Node):
        return value.op == "call_function" and value.target is aten.scalar_tensor.default and \
            graph_constant(value.args[0]) == 0
    return graph_constant(value) == 0


def _is_trailing_unit_view(node: fx.Node) -> bool:
    """An unsqueeze at the last axis, or a squeeze of trailing axes of size 1: every element stays
    where it was along the leading axes, counted from the right as broadcasting counts them."""
    if node.target not in ALIGNED_VIEWS or not isinstance(node.args[0], fx.Node):
        return False
    rank_in, rank_out = len(shape(node.args[0])), len(shape(node))
    if node.target is aten.unsqueeze.default:
        return normalize_dim(node.args[1], rank_out) == rank_out - 1
    dims = node.args[1] if node.target is aten.squeeze.dims else [node.args[1]]
    dims = {normalize_dim(d, rank_in) for d in dims if static_int(shape(node.args[0])[normalize_dim(d, rank_in)]) == 1}
    return bool(dims) and dims == set(range(rank_in - len(dims), rank_in))


class NormEvaluator(MemoEvaluator):
    """Memoized symbolic evaluation with the trailing ``len(norm_shape)`` axes abstracted."""

    #: ops whose every output element is >= 0 or NaN: only their leaves may take a fractional power
    NONNEGATIVE = {aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.abs.default}

    def __init__(self, norm_shape, provenance: Optional[Provenance] = None, forced_leaves=(),
                 max_symbols: Optional[int] = None, policy_leaves=frozenset()):
        #: at most this many leaves in one value (None: no bound): the op's backward has a few
        self.max_symbols = max_symbols
        #: ops kept leaves whatever their value (an op's input, as RMSNorm's rstd)
        self.policy_leaves = frozenset(policy_leaves)
        self.norm_shape = tuple(norm_shape)  # ints or SymInts
        self.norm_key = tuple(size_key(x) for x in norm_shape)
        self.k = len(norm_shape)
        #: every normalized axis has static size 1 (a norm over one element): nothing varies along
        #: them, so every value is constant there and a sum over them is its summand
        self.unit = all(static_int(x) == 1 for x in norm_shape)
        super().__init__(provenance, forced_leaves)
        self.symbol_of: Dict[fx.Node, int] = {}
        self.node_of: Dict[int, fx.Node] = {}
        self.varying = set()  # symbols of leaves that span the normalized axes
        self.nonnegative = set()  # symbols of leaves known to be >= 0 (or NaN) everywhere
        self.sum_keys: Dict[tuple, int] = {}   # summand monomial -> its sum's symbol
        self.sum_body: Dict[int, tuple] = {}   # a sum's symbol -> its summand monomial
        self._symbols = 0
        self._spans: Dict[tuple, Optional[bool]] = {}
        self._spans_by_shape: Dict[tuple, Optional[bool]] = {}  # whole static shapes: spans' answers
        self._by_value: Dict[Expr, List[fx.Node]] = {}
        self._by_body: Dict[tuple, List[fx.Node]] = {}
        self._indexed = -1
        self._indexed_settled = False  # the index was made with no evaluation under way
        self._size_symbols: Dict[object, int] = {}
        self._origin_symbol: Dict[fx.Node, int] = {}
        #: N, the number of normalized elements: a number, or a product of size symbols
        self.n = functools.reduce(operator.mul, (self.size(x) for x in norm_shape), Expr.number(1))

    def size(self, x) -> Expr:
        """A (symbolic) size as an expression: a symbolic size is a symbol of its own,
        constant along the normalized axes and positive; a product of sizes their product."""
        key = size_key(x)
        if isinstance(key, int):
            return Expr.number(key)
        factors = key.as_ordered_factors() if key.is_Mul else [key]
        out = Expr.number(1)
        for factor in factors:
            base, exp = factor.as_base_exp()
            if factor.is_Integer:
                out = out * int(factor)
            elif base.is_Symbol and exp.is_Integer and int(exp) > 0:
                if base not in self._size_symbols:
                    self._size_symbols[base] = sym = self._new_symbol()
                    self.nonnegative.add(sym)
                out = out * Expr.symbol(self._size_symbols[base]) ** int(exp)
            else:
                raise Unsupported(f"size {key}")
        return out

    def _new_symbol(self) -> int:
        self._symbols += 1
        return self._symbols

    def symbol(self, node) -> Expr:
        return Expr.symbol(self.symbol_of[node])

    def value_of(self, node: Optional[fx.Node]) -> Expr:
        """A role's value: its leaf symbol or its expression (1 for a missing gamma)."""
        return self.memo[node].expr if node is not None else Expr.number(1)

    def node_with_value(self, expr: Expr, node_shape) -> Optional[fx.Node]:
        """The first backward-graph node of shape ``node_shape`` whose value is ``expr``."""
        sym = expr.as_symbol()
        if sym is not None:
            node = self.node_of.get(sym)
            return node if node is not None and same_shape(shape(node), node_shape) else None
        found = [n for n in self._values()[0].get(expr, ()) if same_shape(shape(n), node_shape)]
        # of equal values, the one rounded least (a cast to bf16 of the value is not the value)
        return min(found, key=lambda n: (len(self.rounded.get(n, ())), n)) if found else None

    def keep_dim_node_with_value(self, expr: Expr) -> Optional[fx.Node]:
        """The backward-graph node whose value is ``expr`` with a shape of size 1 along the
        normalized axes (a statistic the fused op can read: not a copy that drops them), the least
        rounded first; None if there is none."""
        sym = expr.as_symbol()
        found = [n for n in self._values()[0].get(expr, ()) if self.spans(shape(n)) is False
                 and not self.memo[n].dropped]
        leaf = self.node_of.get(sym) if sym is not None else None
        if leaf is not None and leaf in found:
            return leaf
        return min(found, key=lambda n: (len(self.rounded.get(n, ())), n)) if found else None

    def nodes_varying_as(self, body: tuple, node_shape) -> List[fx.Node]:
        """Backward-graph nodes of shape ``node_shape`` whose value is one term whose factors
        that vary along the normalized axes are ``body`` (times anything constant there)."""
        return sorted((n for n in self._values()[1].get(body, ()) if same_shape(shape(n), node_shape)),
                      key=lambda n: (len(self.rounded.get(n, ())), n))

    def varying_part(self, mono) -> tuple:
        return tuple((s, e) for s, e in mono if s in self.varying)

    def _values(self):
        """Evaluated backward-graph nodes by value, and the one-term ones by varying part.

        Indexed in memo order; an index made with no evaluation under way (every value in the memo
        final, and only ever added to) is extended by the nodes evaluated since, any other is made again."""
        memo = self.memo
        if self._indexed != len(memo):
            start = self._indexed if self._indexed_settled else 0
            if start <= 0:
                self._by_value, self._by_body, start = {}, {}, 0
            for n, v in itertools.islice(memo.items(), start, None):
                if v is not None and v.lead_sum is None and not self._is_forward(n):
                    self._by_value.setdefault(v.expr, []).append(n)
                    if len(v.expr.terms) == 1:
                        self._by_body.setdefault(self.varying_part(next(iter(v.expr.terms))), []).append(n)
            self._indexed, self._indexed_settled = len(memo), not self._depth
        return self._by_value, self._by_body

    def is_full(self, s) -> bool:
        """Whether a shape can be x's: it spans the normalized axes, or they are unit axes and it
        keeps them (with a leading axis)."""
        return bool(self.spans(s)) or (self.unit and len(s) > self.k and self.spans(s) is False)

    def spans(self, s) -> Optional[bool]:
        """Whether a shape spans the normalized axes (True), is 1 along them (False), or neither (None).

        True: the shape spans the normalized axes; False: it is 1 along them; None: neither."""
        try:  # a shape of ints, asked before: its answer (a symbolic size is unhashable: no guard is made)
            return self._spans_by_shape[s]
        except (KeyError, TypeError):
            pass
        tail = tuple(s[max(0, len(s) - self.k):])
        if not all(type(x) is int for x in tail):  # symbolic sizes: no cache (== would guard)
            return self._tail_spans(tail)
        if tail not in self._spans:
            self._spans[tail] = self._tail_spans(tail)
        if all(type(x) is int for x in s):
            self._spans_by_shape[tuple(s)] = self._spans[tail]
        return self._spans[tail]

    def _tail_spans(self, tail) -> Optional[bool]:
        if self.unit and all(static_int(x) == 1 for x in tail):
            return False  # over unit axes, a value spanning them is also constant along them
        if len(tail) == self.k and tuple(size_key(x) for x in tail) == self.norm_key:
            return True
        if all(static_int(x) == 1 for x in tail):
            return False
        return None

    def _leaf(self, node) -> Optional[NormValue]:
        if self.provenance is not None and self.provenance.is_forward(node):
            raise Unsupported("forward node not saved for backward")
        if val(node) is None or not dtype(node).is_floating_point:
            return None
        spans = self.spans(shape(node))
        # copies of one constant along the normalized axes are one leaf, whatever axes of size 1 they keep
        origin = (self._origin(node) or node) if spans is not True else None
        sym = self._origin_symbol.get(origin) if origin is not None else None
        if sym is None:
            sym = self._new_symbol()
            self.node_of[sym] = node
            if origin is not None:
                self._origin_symbol[origin] = sym
        self.symbol_of[node] = sym
        if spans:
            self.varying.add(sym)
        if self.is_nonnegative(node):
            self.nonnegative.add(sym)
        return NormValue(Expr.symbol(sym), dropped=self.k if spans is None else 0)

    def _origin(self, node) -> Optional[fx.Node]:
        """The value a leaf holds, seen through the copies that hold it too.

        Seen through saved tensors' forward definitions, exact copies and
        the unsqueezes and squeezes of trailing axes of size 1 (a statistic saved both as ``rstd`` and
        as ``rstd.unsqueeze(-1)``): copies of one value are one leaf. None where the leaf is its own
        value."""
        seen = node
        for _ in range(8):
            if node.op == "placeholder" and self.provenance is not None:
                node = self.provenance.forward_definition(node) or node
            if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node) or not (
                    _is_trailing_unit_view(node) or is_float_cast(node) and is_value_preserving_cast(node)):
                break
            node = node.args[0]
        return node if node is not seen else None

    def is_nonnegative(self, node, depth: int = 8) -> bool:
        """Whether every element of ``node`` is >= 0 (or NaN), by its definition.

        Read through saved
        tensors' forward definitions): a root or an exponential, a square, an even power, a power of
        such a value, and sums, means, products, quotients, casts and views of such values with
        numbers >= 0 (a mean square plus eps, ``mean(x*x) + eps``: the statistic under the root of
        an RMSNorm written ``(mean(x*x) + eps) ** -0.5``). Rounding keeps a sign, so a proof in real
        arithmetic holds in floating point."""
        if not isinstance(node, fx.Node):
            value = graph_constant(node)
            return value is not None and value >= 0
        if depth == 0:
            return False
        if node.op == "placeholder" and self.provenance is not None:
            node = self.provenance.forward_definition(node) or node
        if node.op != "call_function" or not node.args:
            return False
        t, args = node.target, node.args
        if t in self.NONNEGATIVE:
            return True
        if t is aten.pow.Tensor_Scalar:
            exponent = graph_constant(args[1])
            return exponent is not None and (
                (exponent == int(exponent) and int(exponent) % 2 == 0) or self.is_nonnegative(args[0], depth - 1))
        if t is aten.mul.Tensor and args[0] is args[1]:
            return True
        if t in (aten.add.Tensor, aten.add.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor,
                 aten.div.Scalar):
            return self.is_nonnegative(node.kwargs.get("alpha", 1), depth) and all(
                self.is_nonnegative(a, depth - 1) for a in args[:2])
        if t in (aten.mean.dim, aten.sum.dim_IntList) or t in CAST_TARGETS or t in VIEWS:
            return self.is_nonnegative(args[0], depth - 1)
        if t in CLAMPS:
            low, high = clamp_bounds(node)
            return (low is not None and low >= 0 and (high is None or high >= 0)) or (
                (low is None or low <= 0) and high is None and self.is_nonnegative(args[0], depth - 1))
        return False

    def _arg(self, arg) -> Expr:
        s = graph_constant(arg)
        if s is not None:
            return Expr.number(s)
        if isinstance(arg, fx.Node) and isinstance(arg.meta.get("val"), torch.SymInt):
            return self.size(arg.meta["val"])  # mean's backward divides by a symbolic N
        if not isinstance(arg, fx.Node) or val(arg) is None or self.spans(shape(arg)) is None:
            raise Unsupported("operand")
        v = self.value(arg)
        if v is None or v.lead_sum is not None or v.dropped:
            raise Unsupported("operand")
        return v.expr

    def _pointwise(self, node) -> tuple:
        """The tensor operands' values of a pointwise ``node`` and how many normalized axes they drop
        (:attr:`NormValue.dropped`): all the same, else the op broadcasts leading axes against
        normalized ones, which no value here describes. A zero-dimensional operand fits any."""
        counts = set()
        for arg in node.args[:2]:
            if isinstance(arg, fx.Node) and val(arg) is not None and len(shape(arg)) > 0:
                v = self.value(arg)
                counts.add(v.dropped if v is not None and v.lead_sum is None else 0)
        if len(counts) > 1:
            raise Unsupported("the normalized axes dropped from one operand only")
        dropped = counts.pop() if counts else 0
        if not dropped and self.spans(shape(node)) is None:
            raise Unsupported("shape")
        return dropped

    def _operand(self, arg) -> Expr:
        """``_arg`` of a pointwise op's operand, which may drop the normalized axes (checked by
        :meth:`_pointwise`)."""
        if isinstance(arg, fx.Node) and isinstance(val(arg), torch.Tensor):
            v = self.value(arg)
            if v is not None and v.dropped and v.lead_sum is None:
                return v.expr
        return self._arg(arg)

    def sum_over_normalized(self, expr: Expr) -> Expr:
        """Sum of ``expr`` over the normalized index: each term's factors that vary along
        the normalized axes (its body) become one symbol ``S[body]``, the rest stay."""
        terms: Dict[tuple, object] = {}
        constant: Dict[tuple, object] = {}  # terms with no varying factor: N times each
        for mono, coef in expr.split_terms():
            body = tuple((s, e) for s, e in mono if s in self.varying)
            const = tuple((s, e) for s, e in mono if s not in self.varying)
            if not body:
                accumulate(constant, const, coef)
                continue
            if body not in self.sum_keys:
                sym = self._new_symbol()
                self.sum_keys[body], self.sum_body[sym] = sym, body
            accumulate(terms, tuple(sorted(const + ((self.sum_keys[body], 1),))), coef)
        return Expr(terms) + Expr(constant) * self.n

    def _interpret(self, node: fx.Node, forward: bool) -> NormValue:
        """Read ``node`` through :attr:`FORWARD_SAFE` or :attr:`BACKWARD_ONLY`, after the checks
        that hold for every op."""
        t = node.target
        if val(node) is None or not dtype(node).is_floating_point:
            raise Unsupported("not a float tensor")
        if t in self.policy_leaves:
            raise Unsupported("policy leaf")
        if is_float_cast(node):
            v = self.value(node.args[0])
            if v is None:
                raise Unsupported("cast of opaque")
            return v
        if self.spans(shape(node)) is None and t not in SHAPE_CHECK_EXEMPT:
            raise Unsupported("shape")
        if t in self.FORWARD_SAFE:
            return getattr(self, self.FORWARD_SAFE[t])(node, forward)
        if forward:  # saved-tensor provenance: only value-preserving arithmetic, no reductions
            raise Unsupported("forward op")
        interpreter = self.BACKWARD_ONLY.get(t)
        if interpreter is None:
            raise Unsupported(f"op {t}")
        return getattr(self, interpreter)(node)

    # -- interpreters, one per op (see FORWARD_SAFE and BACKWARD_ONLY) --------
    def _binary(self, node, forward: bool) -> NormValue:
        t, args = node.target, node.args
        dropped = self._pointwise(node)
        if not dropped and all(len(shape(a)) <= self.k for a in args[:2] if isinstance(a, fx.Node)):
            # parameter arithmetic such as Gemma's (1 + weight): the result is gamma, an input
            raise Unsupported("gamma arithmetic")
        alpha = node.kwargs.get("alpha", 1)
        a, b = self._operand(args[0]), self._operand(args[1])
        if t in (aten.add.Tensor, aten.sub.Tensor) and (forward or not self.depends_on_gradient(node)):
            # a saved or recomputed residual sum is x itself, not something to see through
            raise Unsupported("forward sum: an input")
        if self._is_input_arithmetic(t, args, a, b):
            raise Unsupported("scaled input: the product is an input of the pattern")
        if t in (aten.add.Tensor, aten.sub.Tensor) and not forward and self._is_accumulation(a, b):
            raise Unsupported("gradient accumulation: the sum is an input of the pattern")
        if t in (aten.add.Tensor, aten.sub.Tensor):
            b = b * graph_constant(alpha)
        return self._bounded(BINARY_OPS[t](a, b), dropped)

    def _negate(self, node) -> NormValue:
        dropped = self._pointwise(node)
        return NormValue(-self._operand(node.args[0]), dropped=dropped)

    def _power(self, node) -> NormValue:
        exponent = graph_constant(node.args[1])
        if exponent is None:
            raise Unsupported(f"op {node.target}")  # a tensor exponent is no Laurent polynomial
        dropped = self._pointwise(node)
        return self._bounded(self._operand(node.args[0]).power(exponent, self.nonnegative), dropped)

    def _sqrt(self, node) -> NormValue:
        dropped = self._pointwise(node)
        return self._bounded(self._operand(node.args[0]).sqrt(self.nonnegative), dropped)

    def _reciprocal(self, node) -> NormValue:
        dropped = self._pointwise(node)
        return self._bounded(1 / self._operand(node.args[0]), dropped)

    def _aligned_view(self, node) -> NormValue:
        """An unsqueeze or squeeze of trailing axes: ``unsqueeze(-1)`` puts back a normalized axis a
        value drops, a squeeze of a trailing axis of size 1 drops one (within the normalized axes,
        keeping the leading ones where they were)."""
        src = node.args[0]
        v = self.value(src) if isinstance(src, fx.Node) else None
        if v is None or v.lead_sum is not None:
            raise Unsupported("view")
        rank_in, rank_out = len(shape(src)), len(shape(node))
        if node.target is aten.unsqueeze.default:
            if v.dropped and normalize_dim(node.args[1], rank_out) == rank_out - 1:
                return NormValue(v.expr, dropped=v.dropped - 1)
            raise Unsupported("unsqueeze")
        dims = node.args[1] if node.target is aten.squeeze.dims else [node.args[1]]
        dims = {normalize_dim(d, rank_in) for d in dims if static_int(shape(src)[normalize_dim(d, rank_in)]) == 1}
        tail = set(range(rank_in - (self.k - v.dropped), rank_in))
        if v.dropped < self.k and dims and dims == set(range(rank_in - len(dims), rank_in)) and dims <= tail \
                and self.spans(shape(src)) is not True:
            return NormValue(v.expr, dropped=v.dropped + len(dims))
        raise Unsupported("squeeze")

    def _expand(self, node) -> NormValue:
        return NormValue(self._arg(node.args[0]))

    def _view(self, node) -> NormValue:
        src = node.args[0]
        v = self.value(src)
        if v is not None and v.lead_sum is not None:
            squeezed = lambda s: [x for x in s if static_int(x) != 1]  # noqa: E731
            if same_shape(squeezed(shape(node)), squeezed(shape(src))):
                return v
        if v is not None and same_shape(shape(node), shape(src)):
            return v
        raise Unsupported("view")

    def _is_input_arithmetic(self, t, args, a, b) -> bool:
        """c * grad (a logits scale before the LM head, a residual scale): a leaf scaled by a
        constant is the pattern's dy or x, not part of it. (A product of two leaves is not
        cut here: without gamma, dy * x is the norm's own product.)"""
        if t not in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
            return False

        def bare(expr, arg):  # the operand is itself a leaf (not, say, pow(x, 1.0))
            sym = expr.as_symbol()
            return (isinstance(arg, fx.Node) and sym is not None and self.symbol_of.get(arg) == sym
                    and sym in self.varying and len(shape(arg)) > self.k)

        if b.is_number():
            return bare(a, args[0])
        if a.is_number():
            return bare(b, args[1])
        return False

    def _is_accumulation(self, a, b) -> bool:
        """Two tensors added with no normalization statistic in either: upstream gradients."""
        stats = lambda e: any(s not in self.varying for s in e.free_symbols)  # noqa: E731
        return not a.is_number() and not b.is_number() and not (stats(a) or stats(b))

    def _bounded(self, expr, dropped: int = 0) -> NormValue:
        # a value with many more leaves than the op's backward has is some other computation,
        # and expanding it would only cost time
        if self.max_symbols is not None and len(expr.free_symbols) > self.max_symbols:
            raise Unsupported("expression too large")
        return NormValue(expr, dropped=dropped)

    def _reduce(self, node) -> NormValue:
        src = node.args[0]
        rank = len(shape(src))
        dims = node.args[1] if len(node.args) > 1 else None
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if not dims or node.kwargs.get("dtype") is not None:
            raise Unsupported("reduction")
        dims = tuple(sorted(normalize_dim(d, rank) for d in dims))
        body = self._arg(src)
        if dims == tuple(range(rank - self.k, rank)) and self.is_full(shape(src)):
            total = self.sum_over_normalized(body)
            if node.target is aten.mean.dim:
                total = total / self.n
            return self._bounded(total, 0 if keepdim else self.k)
        if node.target is aten.mean.dim:
            raise Unsupported("reduction axes")
        if node.target is aten.sum.dim_IntList and all(d < rank - self.k for d in dims):
            return NormValue(body, lead_sum=(src, dims))
        raise Unsupported("reduction axes")

    def _clamp(self, node, forward: bool) -> NormValue:
        """``clamp(v, min=c)`` with c <= 0 a number and no max, of a v that is >= 0 or NaN: v itself
        (``clamp(mean(x*x), min=0)``, a guard some models put on a mean square). clamp keeps NaN, so
        the identity holds for every input; any other clamp is a leaf."""
        low, high = clamp_bounds(node)
        src = node.args[0]
        if high is not None or low is None or not low <= 0 or not isinstance(src, fx.Node) \
                or not self.is_nonnegative(src) or not same_shape(shape(src), shape(node)):
            raise Unsupported("clamp")
        v = self.value(src)
        if v is None:
            raise Unsupported("clamp of opaque")
        return v

    def _passed_gate(self, node) -> NormValue:
        """``where(v >= c, g, 0)`` with c <= 0 (``> c``, c < 0) and v >= 0 or NaN: g, clamp(v, min=c)'s backward.

        Exact in real arithmetic, as the algebra is; where v is NaN, the gate passes 0, not g, so each
        term of g must have a factor NaN there (:func:`~.nodes.nan_wherever`), as the norm's statistic
        ``rsqrt(clamp(v) + eps)``: every gradient it scales is NaN either way (a user's gate is no such)."""
        if len(node.args) != 3 or not isinstance(node.args[1], fx.Node) or not is_zero(node.args[2]):
            raise Unsupported("where")
        condition, passed = node.args[0], node.args[1]
        bound = graph_constant(condition.args[1]) if isinstance(condition, fx.Node) and len(condition.args) > 1 else None
        if not (isinstance(condition, fx.Node) and condition.op == "call_function" and bound is not None
                and ((condition.target is aten.ge.Scalar and bound <= 0)
                     or (condition.target is aten.gt.Scalar and bound < 0))
                and self.is_nonnegative(condition.args[0]) and same_shape(shape(passed), shape(node))):
            raise Unsupported("where")
        expr, source = self._arg(passed), condition.args[0]
        if not all(any(s in self.node_of and nan_wherever(self.node_of[s], source, self._definition) for s, _ in mono)
                   for mono, _ in expr.split_terms()):
            raise Unsupported("where: a gate of a value that may be NaN where what it passes is not")
        return NormValue(expr)

    def _definition(self, node: fx.Node) -> fx.Node:
        return (self.provenance.forward_definition(node) or node) if self.provenance and node.op == "placeholder" else node

    def _forward_power(self, node, forward: bool) -> NormValue:
        """A power by a number, also of a saved tensor's forward definition: pointwise, so a saved
        ``(mean(x*x) + eps) ** -0.5`` is the saved mean square's power, the value its backward's
        ``** -1.5`` is the cube of."""
        return self._power(node)

    #: aten op -> the name of its interpreter, looked up on the instance (so a subclass or a
    #: test can replace one). FORWARD_SAFE interpreters take (node, forward) and may read
    #: forward nodes; BACKWARD_ONLY ones take (node). Ops in neither are leaves.
    FORWARD_SAFE = {**dict.fromkeys(BINARY_OPS, "_binary"), aten.pow.Tensor_Scalar: "_forward_power",
                    **dict.fromkeys(CLAMPS, "_clamp")}
    BACKWARD_ONLY = {
        aten.neg.default: "_negate",
        aten.sqrt.default: "_sqrt",
        aten.reciprocal.default: "_reciprocal",
        aten.expand.default: "_expand",
        aten.where.self: "_passed_gate",
        aten.sum.dim_IntList: "_reduce", aten.mean.dim: "_reduce",
        aten.view.default: "_view", aten.reshape.default: "_view", aten._unsafe_view.default: "_view",
        **dict.fromkeys(ALIGNED_VIEWS, "_aligned_view"),
    }
