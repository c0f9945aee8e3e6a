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

How a match is found: nodes are evaluated symbolically (exact Laurent
polynomials, :mod:`.algebra`; one small interpreter per aten op, in the tables
:attr:`NormEvaluator.FORWARD_SAFE` and :attr:`NormEvaluator.BACKWARD_ONLY`, with
any other op a leaf) with the normalized axes as an abstract index: a
leaf is a symbol, ``x_i`` when it spans the normalized axes and ``r`` when it is
constant along them (``rstd``), and a sum over the normalized axes becomes a
symbol ``S[monomial]`` after expanding its summand. A node is dx when its expression equals, for some leaves,
``r*dy*g - r**3 * x * S[dy*g*x] / N`` (SPEC section 2), and dgamma when it is
``dy * x * r`` summed over exactly the leading axes to gamma's shape. Equality is
algebraic, so eps outside the square root, a wrong exponent or a missing term
do not match.

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
wheels; the README has the table), so on torch_npu the decomposed form is what the
pass sees today. A whole forward ``_fused_rms_norm`` has no fused op yet and no
torchair converter: each one is recorded as a miss.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from typing import Dict, List, Optional

import torch
import torch.fx as fx

from ..compat import FUSED_RMS_NORM, FUSED_RMS_NORM_BACKWARD
from ..lowering.constraints import RMS_NORM_DTYPES, rms_norm_target_problem
from ..lowering.rms_norm import OP
from ..lowering.sizes import same_shape, static_int
from .algebra import Expr, accumulate, graph_constant
from .evaluator import MemoEvaluator, Provenance, Unsupported, kept_precision, rounding_problem
from .nodes import (CAST_TARGETS, VIEWS, aten, downstream, dtype, gradient_dependent, gradient_product, is_float_cast,
                    is_value_preserving_cast, last_of, normalize_dim, outermost, outside_users, region_of, shape, val)
from .rewrite import Insertion, Miss, Rewrites, Rule, Site, call, cast, commit, emit_fused_op, exact_common_dtype
MAX_SYMBOLS = 16


@dataclasses.dataclass
class NormValue:
    expr: Expr
    #: for a sum over leading axes: (summand node, reduced dims), else None
    lead_sum: Optional[tuple] = None


def size_key(x):
    """A size as a hashable value that equal sizes share: an int, or its symbolic expression."""
    if isinstance(x, torch.SymInt):
        expr = x.node.expr
        return int(expr) if expr.is_number else expr
    return x


BINARY_OPS = {aten.add.Tensor: operator.add, aten.add.Scalar: operator.add,
              aten.sub.Tensor: operator.sub, aten.sub.Scalar: operator.sub,
              aten.mul.Tensor: operator.mul, aten.mul.Scalar: operator.mul,
              aten.div.Tensor: operator.truediv, aten.div.Scalar: operator.truediv}
#: ops read even where their shape neither spans the normalized axes nor is 1 along them:
#: their interpreters check shapes themselves
SHAPE_CHECK_EXEMPT = {aten.sum.dim_IntList, aten.view.default, aten.reshape.default, aten._unsafe_view.default}


class NormEvaluator(MemoEvaluator):
    """Memoized symbolic evaluation with the trailing ``len(norm_shape)`` axes abstracted."""

    POLICY_LEAVES = {aten.rsqrt.default}  # rstd is an input of the fused op: keep it a leaf
    #: ops whose every output element is >= 0 or NaN: only their leaves may take a fractional power
    NONNEGATIVE = {aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.abs.default}

    def __init__(self, norm_shape, provenance: Optional[Provenance] = None, forced_leaves=()):
        self.norm_shape = tuple(norm_shape)  # ints or SymInts
        self.norm_key = tuple(size_key(x) for x in norm_shape)
        self.k = len(norm_shape)
        super().__init__(provenance, forced_leaves)
        self.symbol_of: Dict[fx.Node, int] = {}
        self.node_of: Dict[int, fx.Node] = {}
        self.varying = set()  # symbols of leaves that span the normalized axes
        self.nonnegative = set()  # symbols of leaves known to be >= 0 (or NaN) everywhere
        self.sum_keys: Dict[tuple, int] = {}   # summand monomial -> its sum's symbol
        self.sum_body: Dict[int, tuple] = {}   # a sum's symbol -> its summand monomial
        self._symbols = 0
        self._spans: Dict[tuple, Optional[bool]] = {}
        self._by_value: Dict[Expr, List[fx.Node]] = {}
        self._by_body: Dict[tuple, List[fx.Node]] = {}
        self._indexed = -1
        self._size_symbols: Dict[object, int] = {}
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

    def nodes_varying_as(self, body: tuple, node_shape) -> List[fx.Node]:
        """Backward-graph nodes of shape ``node_shape`` whose value is one term whose factors
        that vary along the normalized axes are ``body`` (times anything constant there)."""
        return sorted((n for n in self._values()[1].get(body, ()) if same_shape(shape(n), node_shape)),
                      key=lambda n: (len(self.rounded.get(n, ())), n))

    def varying_part(self, mono) -> tuple:
        return tuple((s, e) for s, e in mono if s in self.varying)

    def _values(self):
        """Evaluated backward-graph nodes by value, and the one-term ones by varying part."""
        if self._indexed != len(self.memo):
            self._by_value, self._by_body, self._indexed = {}, {}, len(self.memo)
            for n, v in self.memo.items():
                if v is not None and v.lead_sum is None and not self._is_forward(n):
                    self._by_value.setdefault(v.expr, []).append(n)
                    if len(v.expr.terms) == 1:
                        self._by_body.setdefault(self.varying_part(next(iter(v.expr.terms))), []).append(n)
        return self._by_value, self._by_body

    def spans(self, s) -> Optional[bool]:
        """True: the shape spans the normalized axes; False: it is 1 along them; None: neither."""
        tail = tuple(s[max(0, len(s) - self.k):])
        if not all(type(x) is int for x in tail):  # symbolic sizes: no cache (== would guard)
            return self._tail_spans(tail)
        if tail not in self._spans:
            self._spans[tail] = self._tail_spans(tail)
        return self._spans[tail]

    def _tail_spans(self, tail) -> Optional[bool]:
        if len(tail) == self.k and tuple(size_key(x) for x in tail) == self.norm_key:
            return True
        if all(static_int(x) == 1 for x in tail):
            return False
        return None

    def _leaf(self, node) -> Optional[NormValue]:
        if self.provenance is not None and self.provenance.is_forward(node):
            raise Unsupported("forward node not saved for backward")
        v = val(node)
        if v is None or not v.dtype.is_floating_point or self.spans(v.shape) is None:
            return None
        sym = self._new_symbol()
        self.symbol_of[node], self.node_of[sym] = sym, node
        if self.spans(v.shape):
            self.varying.add(sym)
        definition = node
        if node.op == "placeholder" and self.provenance is not None:
            definition = self.provenance.forward_definition(node) or node
        if definition.op == "call_function" and definition.target in self.NONNEGATIVE:
            self.nonnegative.add(sym)
        return NormValue(Expr.symbol(sym))

    def _arg(self, arg) -> Expr:
        s = graph_constant(arg)
        if s is not None:
            return Expr.number(s)
        if isinstance(arg, fx.Node) and isinstance(arg.meta.get("val"), torch.SymInt):
            return self.size(arg.meta["val"])  # mean's backward divides by a symbolic N
        if not isinstance(arg, fx.Node) or val(arg) is None or self.spans(val(arg).shape) is None:
            raise Unsupported("operand")
        v = self.value(arg)
        if v is None or v.lead_sum is not None:
            raise Unsupported("operand")
        return v.expr

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
        out = val(node)
        if out is None or not out.dtype.is_floating_point:
            raise Unsupported("not a float tensor")
        if t in self.POLICY_LEAVES:
            raise Unsupported("policy leaf")
        if is_float_cast(node):
            v = self.value(node.args[0])
            if v is None:
                raise Unsupported("cast of opaque")
            return v
        if self.spans(out.shape) is None and t not in SHAPE_CHECK_EXEMPT:
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
        if all(len(shape(a)) <= self.k for a in args[:2] if isinstance(a, fx.Node)):
            # parameter arithmetic such as Gemma's (1 + weight): the result is gamma, an input
            raise Unsupported("gamma arithmetic")
        alpha = node.kwargs.get("alpha", 1)
        a, b = self._arg(args[0]), self._arg(args[1])
        if t in (aten.add.Tensor, aten.sub.Tensor) and (forward or not self.depends_on_gradient(node)):
            # a saved or recomputed residual sum is x itself, not something to see through
            raise Unsupported("forward sum: an input")
        if self._is_input_arithmetic(t, args, a, b):
            raise Unsupported("scaled input: the product is an input of the pattern")
        if t in (aten.add.Tensor, aten.sub.Tensor) and not forward and self._is_accumulation(a, b):
            raise Unsupported("gradient accumulation: the sum is an input of the pattern")
        if t in (aten.add.Tensor, aten.sub.Tensor):
            b = b * graph_constant(alpha)
        return self._bounded(BINARY_OPS[t](a, b))

    def _negate(self, node) -> NormValue:
        return NormValue(-self._arg(node.args[0]))

    def _power(self, node) -> NormValue:
        exponent = graph_constant(node.args[1])
        if exponent is None:
            raise Unsupported(f"op {node.target}")  # a tensor exponent is no Laurent polynomial
        return self._bounded(self._arg(node.args[0]).power(exponent, self.nonnegative))

    def _sqrt(self, node) -> NormValue:
        return self._bounded(self._arg(node.args[0]).sqrt(self.nonnegative))

    def _reciprocal(self, node) -> NormValue:
        return self._bounded(1 / self._arg(node.args[0]))

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

    def _bounded(self, expr) -> NormValue:
        # RMSNorm's backward involves dy, x, gamma, rstd and one sum, where x may be a chain
        # of earlier norms' outputs (two symbols each): anything with many more leaves is
        # some other computation, and expanding it would only cost time.
        if len(expr.free_symbols) > MAX_SYMBOLS:
            raise Unsupported("expression too large")
        return NormValue(expr)

    def _reduce(self, node) -> NormValue:
        src = node.args[0]
        rank = len(shape(src))
        dims = node.args[1] if len(node.args) > 1 else None
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if not dims or node.kwargs.get("dtype") is not None:
            raise Unsupported("reduction")
        dims = tuple(sorted(normalize_dim(d, rank) for d in dims))
        body = self._arg(src)
        if dims == tuple(range(rank - self.k, rank)) and keepdim and self.spans(shape(src)):
            total = self.sum_over_normalized(body)
            if node.target is aten.mean.dim:
                total = total / self.n
            return self._bounded(total)
        if node.target is aten.sum.dim_IntList and all(d < rank - self.k for d in dims):
            return NormValue(body, lead_sum=(src, dims))
        raise Unsupported("reduction axes")

    #: aten op -> the name of its interpreter, looked up on the instance (so a subclass or a
    #: test can replace one). FORWARD_SAFE interpreters take (node, forward) and may read
    #: forward nodes; BACKWARD_ONLY ones take (node). Ops in neither are leaves.
    FORWARD_SAFE = dict.fromkeys(BINARY_OPS, "_binary")
    BACKWARD_ONLY = {
        aten.neg.default: "_negate",
        aten.pow.Tensor_Scalar: "_power",
        aten.sqrt.default: "_sqrt",
        aten.reciprocal.default: "_reciprocal",
        aten.expand.default: "_expand",
        aten.sum.dim_IntList: "_reduce", aten.mean.dim: "_reduce",
        aten.view.default: "_view", aten.reshape.default: "_view", aten._unsafe_view.default: "_view",
    }


# -- matching -----------------------------------------------------------------

@dataclasses.dataclass
class NormMatch:
    dx: fx.Node                 # the node whose value is dx (plus ``rest``)
    dy: fx.Node
    x: fx.Node
    rstd: fx.Node
    gamma: Optional[fx.Node]
    ev: NormEvaluator
    parts: List[fx.Node] = dataclasses.field(default_factory=list)  # summands that make up dx
    rest: List[fx.Node] = dataclasses.field(default_factory=list)   # other gradients summed into dx's node
    chain: List[fx.Node] = dataclasses.field(default_factory=list)  # the adds that sum parts and rest
    dgamma: Optional[fx.Node] = None

    @property
    def roles(self):
        return (self.dy, self.x, self.rstd, self.gamma)


def expected_dx(ev: NormEvaluator, dy: Expr, x: Expr, r: Expr, g: Expr) -> Expr:
    return r * dy * g - r ** 3 * x * ev.sum_over_normalized(dy * g * x) / ev.n


def _symbols(mono) -> set:
    return {s for s, _ in mono}


def match_dx(ev: NormEvaluator, node: fx.Node, expr: Expr) -> Optional[NormMatch]:
    """Read the roles off the two terms of ``r*dy*g - r**3*x*S[dy*g*x]/N``, then check equality."""
    sums = {s for s in expr.free_symbols if s in ev.sum_body}
    if len(sums) != 1:
        return None
    terms = [mono for mono, _ in expr.split_terms()]
    plain = [m for m in terms if not (_symbols(m) & sums)]
    summed = [m for m in terms if _symbols(m) & sums]
    if len(plain) != 1 or len(summed) != 1:
        return None

    def leaves(term, varying, full_shape=None, rank=None):
        nodes = [ev.node_of[s] for s in _symbols(term) if s in ev.node_of]
        return [n for n in nodes if (ev.symbol_of[n] in ev.varying) == varying
                and (full_shape is None or same_shape(shape(n), full_shape))
                and (rank is None or len(shape(n)) == rank)]

    full = shape(node)
    stats, gammas = leaves(plain[0], False), leaves(plain[0], True, rank=ev.k) + [None]
    candidates = itertools.product(stats, leaves(plain[0], True, full_shape=full), gammas,
                                   leaves(summed[0], True, full_shape=full))
    for r, dy, g, x in candidates:
        if len({r, dy, g, x}) == 4 and expr == expected_dx(ev, ev.symbol(dy), ev.symbol(x), ev.symbol(r),
                                                           ev.value_of(g)):
            return NormMatch(node, dy, x, r, g, ev)
    return _match_expression_roles(ev, node, expr, stats, gammas, sums)


def _match_expression_roles(ev: NormEvaluator, node, expr: Expr, stats, gammas, sums) -> Optional[NormMatch]:
    """dy or x that are not leaves but any node of the right value: a gated norm's dy is
    ``grad * gate``, a post-norm's x the previous norm's output. The plain term gives dy's
    value, the summed body (what varies along the normalized axes of dy*g*x) x's varying
    part; each candidate is then checked against the whole formula."""
    (total,) = sums
    (plain, plain_coef), = [(m, c) for m, c in expr.split_terms() if total not in _symbols(m)]
    full = shape(node)
    for r, g in itertools.product(stats, gammas):
        gs = ev.value_of(g)
        dy = ev.node_with_value(Expr({plain: plain_coef}) / (ev.symbol(r) * gs), full)
        if dy is None or len(ev.value_of(dy).terms) != 1:
            continue
        known = Expr({ev.varying_part(next(iter((ev.value_of(dy) * gs).terms))): 1})
        x_body = Expr({ev.sum_body[total]: 1}) / known
        for x in ev.nodes_varying_as(next(iter(x_body.terms)), full):
            if len({r, dy, g, x}) == 4 and expr == expected_dx(ev, ev.value_of(dy), ev.value_of(x),
                                                               ev.symbol(r), gs):
                return NormMatch(node, dy, x, r, g, ev)
    return None


def _accumulation(node: fx.Node, stop) -> tuple:
    """(summands, adds) of the tree of single-use ``add`` nodes rooted at ``node``.

    Autograd sums every contribution to a tensor's gradient: with no cast in
    between, the two terms of RMSNorm's dx are added into the residual stream's
    gradient one by one, and dx itself is never a node of its own.
    """
    def is_add(n):
        return (isinstance(n, fx.Node) and n.op == "call_function" and n.target is aten.add.Tensor
                and n.kwargs.get("alpha", 1) == 1 and all(isinstance(a, fx.Node) for a in n.args[:2]))

    if not is_add(node):
        return [node], []
    summands, adds, stack = [], [node], list(node.args[:2])
    while stack:
        n = stack.pop()
        if is_add(n) and len(n.users) == 1 and n not in stop:
            adds.append(n)
            stack.extend(n.args[:2])
        else:
            summands.append(n)
    return summands, adds


def _stat_leaves(ev: NormEvaluator, expr) -> frozenset:
    return frozenset(s for s in expr.free_symbols if s in ev.node_of and s not in ev.varying)


def _match_root(ev: NormEvaluator, root: fx.Node, stop) -> Optional[NormMatch]:
    v = ev.memo.get(root)
    if v is not None and v.lead_sum is None:
        found = match_dx(ev, root, v.expr)
        if found is not None:
            found.parts = [root]
            return found
    summands, adds = _accumulation(root, stop)
    if len(summands) < 3:
        return None
    # dx's terms are the summands with this norm's rstd in every term (another norm's rstd
    # may be there too: a post-norm's output is this norm's x)
    exprs = {n: ev.memo[n].expr for n in summands if isinstance(n, fx.Node) and ev.memo.get(n) is not None
             and ev.memo[n].lead_sum is None}
    stats = dict.fromkeys(s for e in exprs.values() for s in sorted(_stat_leaves(ev, e)))
    for stat in stats:
        parts = [n for n, e in exprs.items() if all(stat in _symbols(m) for m, _ in e.split_terms())]
        if len(parts) < 2:
            continue
        found = match_dx(ev, root, sum((exprs[n] for n in parts), Expr.number(0)))
        if found is not None:
            found.parts = parts
            found.rest = [n for n in summands if n not in parts]
            found.chain = adds
            return found
    return None


def _dgamma_summand(ev: NormEvaluator, site: NormMatch) -> Expr:
    return ev.value_of(site.dy) * ev.value_of(site.x) * ev.value_of(site.rstd)


def match_dgamma(ev: NormEvaluator, node: fx.Node, site: NormMatch) -> bool:
    """``node`` sums ``dy * x * rstd`` over exactly the leading axes, to gamma's shape."""
    v = ev.memo.get(node)
    if v is None or v.lead_sum is None or site.gamma is None:
        return False
    summand, dims = v.lead_sum
    rank = len(shape(summand))
    return (same_shape(shape(node), shape(site.gamma)) and same_shape(shape(summand), shape(site.dx))
            and all(d in dims or static_int(shape(summand)[d]) == 1 for d in range(rank - ev.k))
            and v.expr == _dgamma_summand(ev, site))


#: uses between a sum over the normalized axes and the root of dx (with its accumulation)
DX_DEPTH = 9


def _norm_reductions(graph: fx.Graph):
    """[(normalized trailing shape, [keep-dim sum/mean nodes over exactly those axes])]."""
    found: Dict[tuple, tuple] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (aten.sum.dim_IntList, aten.mean.dim):
            continue
        src = node.args[0]
        s = shape(src) if isinstance(src, fx.Node) else None
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if not s or not keepdim or not node.args[1]:
            continue
        dims = sorted(normalize_dim(d, len(s)) for d in node.args[1])
        if dims != list(range(len(s) - len(dims), len(s))):
            continue
        tail = tuple(s[len(s) - len(dims):])
        found.setdefault(tuple(size_key(x) for x in tail), (tail, []))[1].append(node)
    return found.values()


def _lead_sums(graph: fx.Graph, rank: int) -> List[fx.Node]:
    """Sums over leading axes (dgamma) and the views and casts right after them."""
    seeds = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.sum.dim_IntList and isinstance(node.args[0], fx.Node):
            s = shape(node.args[0])
            if s and all(normalize_dim(d, len(s)) < len(s) - rank for d in node.args[1] or ()):
                seeds.append(node)
    return downstream(graph, seeds, 3)


def find_sites(graph: fx.Graph, provenance, forced_leaves=(), rewrites: Optional[Rewrites] = None):
    """(matches, near misses) of the graph's RMSNorm backward sites; an internal error while
    examining one candidate is recorded in ``rewrites`` (raised without it)."""
    rewrites = rewrites if rewrites is not None else Rewrites(graph, OP.name, strict=True)
    matches, misses = [], []
    gradient = gradient_dependent(graph)
    for norm_shape, reductions in _norm_reductions(graph):
        try:
            ev = NormEvaluator(norm_shape, provenance, forced_leaves)
        except Unsupported:  # a symbolic N that is not a product of sizes
            continue
        ev.gradient_nodes = gradient
        # dx is a few uses after a sum over the normalized axes; evaluation is lazy from there
        nodes = [n for n in downstream(graph, reductions, DX_DEPTH) if n.op == "call_function"
                 and val(n) is not None and val(n).dtype.is_floating_point]
        for n in nodes:
            ev.value(n)
        # dgamma candidates by the leaves they sum (dy, x, rstd): one lookup per site
        lead_sums: Dict[frozenset, List[fx.Node]] = {}
        for n in _lead_sums(graph, len(norm_shape)):
            v = ev.value(n) if val(n) is not None else None
            if v is not None and v.lead_sum is not None:
                lead_sums.setdefault(frozenset(v.expr.free_symbols), []).append(n)
        found, stop = [], set()
        for n in nodes:
            if ev.spans(shape(n)) and ev.depends_on_gradient(n):
                m = rewrites.examine(n, _match_root, ev, n, stop)
                if m is not None:
                    found.append(m)
                    stop.add(n)
        # keep the outermost of a chain of matches of one site (dx, then its cast)
        found = outermost(found, node=lambda m: m.dx, same=lambda a, b: a.roles == b.roles)
        seen = set()
        for site in found:
            if site.rstd in seen:  # one RMSNorm, one site: an accumulation root found twice
                continue
            seen.add(site.rstd)
            leaves = frozenset(_dgamma_summand(ev, site).free_symbols)
            grads = [n for n in lead_sums.get(leaves, ()) if rewrites.examine(n, match_dgamma, ev, n, site)]
            grads = outermost(grads)
            if len(grads) == 1:
                site.dgamma = grads[0]
            matches.append(site)
        misses += rewrites.examine(graph, _near_misses, ev, nodes, [m for m in matches if m.ev is ev],
                                   rewrites) or []
        rewrites.evaluated(ev)
    return matches, misses


def _near_misses(ev: NormEvaluator, nodes, matched: List[NormMatch], rewrites: Rewrites) -> List[Miss]:
    """Nodes that sum over the normalized axes once, as an RMSNorm dx does, yet matched nothing.
    One built on a matched site's sum outside that site (a post-norm whose dy is the next
    norm's dx, or the sum of several norms' dx) is pending: the next round, with those sites
    fused, decides it."""
    done, inside = set(), set()
    for site in matched:
        summand = ev.value_of(site.dy) * ev.value_of(site.gamma) * ev.value_of(site.x)
        done |= ev.sum_over_normalized(summand).free_symbols
        inside.update(_region(site, {"dx": site.dx}))
    suspects = []
    for n in nodes:
        v = ev.memo.get(n)
        if v is None or v.lead_sum is not None or not ev.spans(shape(n)) or not same_shape(
                shape(n)[len(shape(n)) - ev.k:], ev.norm_shape) or len(shape(n)) <= ev.k:
            continue
        sums = {s for s in v.expr.free_symbols if s in ev.sum_body}
        if len(sums) > 1 and sums & done and sums - done and n not in inside:
            # its own sum over a gradient that expands into matched sites' dx (a norm whose dy
            # is several norms' dx summed): the next round reads that dy as their fused outputs
            rewrites.pending += 1
            continue
        # a norm's dx scales by a saved statistic and has a term x * sum(product) with the
        # product of degree >= 2 (dy*g*x): (log-)softmax's backward has no statistic or sums
        # the gradient alone, normalizing by a plain sum (MoE routing weights) has no x there
        if len(sums) != 1 or not _stat_leaves(ev, v.expr) or sum(
                abs(e) for _, e in ev.sum_body[next(iter(sums))]) < 2:
            continue
        summed_terms = [_symbols(m) for m, _ in v.expr.split_terms() if _symbols(m) & sums]
        if not any(t & ev.varying for t in summed_terms):
            continue
        if not sums & done and len(v.expr.terms) >= 2:
            suspects.append(n)
        elif sums & done and n not in inside:
            rewrites.pending += 1
    outer = outermost(suspects)
    return [Miss(OP.name, n.name, "normalizes over the last axes like an RMSNorm dx, but its terms differ from "
                             "rstd*dy*g - rstd**3*x*sum(dy*g*x)/N (eps outside the root, another "
                             "statistic or a missing term)") for n in outer]


def unexplained(graph: fx.Graph, provenance: Optional[Provenance], misses: List[Miss]) -> List[Miss]:
    """No silent misses: a gradient multiplied by an RMS statistic (``rsqrt(mean(x*x) + eps)``,
    saved or recomputed) that is left in the graph after the pass, and that no recorded miss
    accounts for, is an RMSNorm no form matched; each becomes a miss."""
    gradient = gradient_dependent(graph)
    if gradient is None:
        return []
    missed = {m.node for m in misses}
    found, reached = [], set()
    for node in graph.nodes:
        product = gradient_product(node, gradient) if node not in reached else None
        if product is None or not _is_rms_statistic(product[1], provenance):
            continue
        reach = set(downstream(graph, [node], 2 * DX_DEPTH))
        reached |= reach
        if not any(n.name in missed for n in reach):
            found.append(node)
    return [Miss(OP.name, n.name, "a gradient scaled by an RMS statistic rsqrt(mean(x*x) + eps) that no "
                             "RMSNorm form matched (run with TORCH_LOGS=npu_fusion and dump_graphs to see it)")
            for n in found]


#: ops an RMS statistic may pass through on its way to the backward: casts, copies and views
_STAT_PASSTHROUGH = CAST_TARGETS | VIEWS


def _is_rms_statistic(node: fx.Node, provenance: Optional[Provenance]) -> bool:
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
    mean = next((a for a in node.args[0].args if isinstance(a, fx.Node)
                 and a.target in (aten.mean.dim, aten.sum.dim_IntList)), None)
    square = mean.args[0] if mean is not None else None
    return isinstance(square, fx.Node) and square.op == "call_function" and (
        (square.target is aten.pow.Tensor_Scalar and square.args[1] == 2)
        or (square.target is aten.mul.Tensor and square.args[0] is square.args[1]))


# -- the rewrite --------------------------------------------------------------

def _widened_from(node: fx.Node, to: torch.dtype, provenance: Optional[Provenance]) -> bool:
    """Whether a saved tensor is a widening cast of a tensor of dtype ``to`` (so narrowing is exact)."""
    fw = provenance.forward_definition(node) if provenance is not None and node.op == "placeholder" else None
    return fw is not None and is_value_preserving_cast(fw) and dtype(fw.args[0]) == to


def _gamma_dtype(compute: torch.dtype, gamma: torch.dtype) -> torch.dtype:
    """gamma's dtype for the fused op: its own, or float32 when SPEC's table has no
    (compute, gamma) row but has (compute, float32); the widening cast is exact."""
    if (compute, gamma) not in RMS_NORM_DTYPES and (compute, torch.float32) in RMS_NORM_DTYPES \
            and exact_common_dtype((gamma, torch.float32)) == torch.float32:
        return torch.float32
    return gamma


def _region(site: NormMatch, outputs) -> List[fx.Node]:
    roles = {n for n in site.roles if n is not None}
    ev = site.ev
    interior = lambda n: (n in ev.interpreted and n not in roles and n not in site.rest  # noqa: E731
                          and ev.depends_on_gradient(n))
    region = region_of(list(site.parts) + [o for k, o in outputs.items() if k != "dx"], interior)
    return list(dict.fromkeys(region + site.chain + [site.dx]))


def find(graph: fx.Graph, provenance: Optional[Provenance], rewrites: Rewrites):
    """The rule's ``find``: this round's matches and near misses."""
    return find_sites(graph, provenance, rewrites=rewrites)


def emit(rewrites: Rewrites, site: NormMatch, provenance, target: str):
    """The rule's ``emit``: the site rewritten into one fused call (a :class:`Site`), or a
    :class:`Miss` saying why not."""
    current = rewrites.current
    site.rest = [current(n) for n in site.rest]
    site.dy, site.x, site.rstd, site.gamma = (current(n) for n in site.roles)
    outputs = {"dx": site.dx, **({"dgamma": site.dgamma} if site.dgamma is not None else {})}
    # a dgamma the program computes from a value it rounded more coarsely than it keeps dgamma
    # (autocast: a bf16 normalized x times an fp32 weight) is left to the program; dx still fuses
    dgamma_left = site.dgamma is not None and rounding_problem(site.ev, {"dgamma": site.dgamma},
                                                               [*site.roles, *site.rest])
    if dgamma_left:
        del outputs["dgamma"]
    region = _region(site, outputs)
    shared = outside_users(region, outputs.values())
    if shared:
        again = [m for m in find_sites(rewrites.graph, provenance, forced_leaves=shared, rewrites=rewrites)[0]
                 if m.dx is site.dx]
        if not again or again[0].dgamma is not site.dgamma:
            return Miss(OP.name, site.dx.name, f"intermediate {shared[0].name} has a user outside "
                                               f"the pattern ({next(iter(shared[0].users)).name})")
        site = again[0]
        region = _region(site, outputs)
    done = _emit(rewrites, site, outputs, region, target, provenance)
    if dgamma_left and isinstance(done, Site):
        done.note = f"dgamma ({site.dgamma.name}) left to the program: {dgamma_left}"
    return done


def _emit(rewrites: Rewrites, site: NormMatch, outputs, region, target, provenance):
    graph, fake_mode = rewrites.graph, rewrites.fake_mode
    dy_dtype, x_dtype = dtype(site.dy), dtype(site.x)
    wide = exact_common_dtype((dy_dtype, x_dtype))
    compute = dy_dtype if (x_dtype == wide and _widened_from(site.x, dy_dtype, provenance)) else wide
    compute = exact_common_dtype((compute, kept_precision(site.dx)))  # dx is returned in this dtype
    gamma_dtype = _gamma_dtype(compute, dtype(site.gamma) if site.gamma is not None else compute)
    problem = rms_norm_target_problem(target, compute, gamma_dtype) or rounding_problem(site.ev, outputs, [*site.roles, *site.rest])
    if problem is not None:
        return Miss(OP.name, site.dx.name, problem)
    anchor = last_of(graph, [n for n in (site.dy, site.x, site.rstd, site.gamma) if n is not None])
    with Insertion(graph, anchor) as inserted:
        dy, x = cast(graph, fake_mode, site.dy, compute), cast(graph, fake_mode, site.x, compute)
        rstd = cast(graph, fake_mode, site.rstd, torch.float32)
        gamma = cast(graph, fake_mode, site.gamma, gamma_dtype) if site.gamma is not None else None
        if gamma is None:
            if not all(isinstance(x, int) for x in site.ev.norm_shape):
                return Miss(OP.name, site.dx.name, "a norm without weight over a symbolic size: mark the "
                                                   "hidden size static")
            gamma = call(graph, fake_mode, aten.full.default, (list(site.ev.norm_shape), 1.0),
                         {"dtype": compute, "device": val(site.dy).device})
        emitted = emit_fused_op(rewrites, OP, site.dx, (dy, x, rstd, gamma), outputs)
        if isinstance(emitted, Miss):
            return emitted
    fused, replacements = emitted
    added = inserted.nodes()
    if site.rest:
        added += _add_back_accumulated(graph, fake_mode, site, replacements)
    return commit(graph, OP.name, None, region, outputs, replacements,
                  {"dy": site.dy, "x": site.x, "rstd": site.rstd, "gamma": site.gamma}, added, fused)


def _add_back_accumulated(graph, fake_mode, site: NormMatch, replacements) -> List[fx.Node]:
    """The other gradients accumulated with dx, added back to the fused dx after all of them."""
    added = []
    with graph.inserting_before(site.dx):
        total = replacements[site.dx]
        for i, other in enumerate(site.rest):
            last = i == len(site.rest) - 1  # it computes the replaced node's value
            total = call(graph, fake_mode, aten.add.Tensor, (other, total),
                         value=site.dx.meta["val"] if last else None)
            added.append(total)
        replacements[site.dx] = total
    return added


# -- aten._fused_rms_norm_backward: the whole backward torch keeps on some devices ----

@dataclasses.dataclass
class WholeBackwardMatch:
    """One ``aten._fused_rms_norm_backward`` call; ``dx`` is the call itself (the key the rule
    runs the site's transaction under)."""
    dx: fx.Node


def _is_call(node: fx.Node, target) -> bool:
    return target is not None and node.op == "call_function" and node.target is target


def whole_backward_sites(graph: fx.Graph) -> List[WholeBackwardMatch]:
    """Every ``aten._fused_rms_norm_backward`` call of the graph: each is one RMSNorm site."""
    return [WholeBackwardMatch(n) for n in graph.nodes if _is_call(n, FUSED_RMS_NORM_BACKWARD)]


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


def emit_whole_backward(rewrites: Rewrites, match: WholeBackwardMatch, target: str):
    """``aten._fused_rms_norm_backward(dy, x, normalized_shape, rstd, weight, output_mask)``
    rewritten into ``rms_norm_grad(dy, x, rstd, gamma)``: the same formula, rstd the same
    float32 ``1/RMS(x)`` (eps inside it), gamma the weight or ones; each output the program
    uses cast back to the call's dtype and shape. A Miss when the target refuses."""
    node, graph, fake_mode = match.dx, rewrites.graph, rewrites.fake_mode
    dy, x, normalized_shape, rstd, weight = (node.args + (None,) * 5)[:5]
    outputs = _whole_backward_outputs(node)
    if isinstance(outputs, Miss) or not outputs:
        return outputs or Miss(OP.name, node.name, "no output of aten._fused_rms_norm_backward is used")
    compute = exact_common_dtype((dtype(dy), dtype(x)))
    gamma_dtype = _gamma_dtype(compute, dtype(weight) if weight is not None else compute)
    problem = rms_norm_target_problem(target, compute, gamma_dtype)
    if problem is None and exact_common_dtype((torch.float32, dtype(rstd))) != torch.float32:
        problem = f"rstd dtype {dtype(rstd)} does not fit RmsNormGrad's float32 rstd"
    if problem is not None:
        return Miss(OP.name, node.name, f"aten._fused_rms_norm_backward: {problem}")
    with Insertion(graph, node.prev) as inserted:
        operands = [cast(graph, fake_mode, dy, compute), cast(graph, fake_mode, x, compute),
                    cast(graph, fake_mode, rstd, torch.float32)]
        if weight is not None:
            operands.append(cast(graph, fake_mode, weight, gamma_dtype))
        else:  # a norm without weight: gamma of ones, as the decomposed form does
            operands.append(call(graph, fake_mode, aten.full.default, (list(normalized_shape), 1.0),
                                 {"dtype": compute, "device": val(x).device}))
        emitted = emit_fused_op(rewrites, OP, node, operands, outputs)
        if isinstance(emitted, Miss):
            return emitted
    fused, replacements = emitted
    region = [node] + [u for u in node.users if u.target is operator.getitem]
    return commit(graph, OP.name, None, region, outputs, replacements,
                  {"dy": dy, "x": x, "rstd": rstd, "gamma": weight}, inserted.nodes(), fused)


#: why a whole forward RMSNorm stays as it is (issue 24 adds a fused forward op)
WHOLE_FORWARD_REASON = (
    "aten._fused_rms_norm (the whole forward torch keeps where the device has its own kernel) has no fused "
    "forward op in npu-fusion yet, and no torchair from torch_npu 2.6.0 to 2.14.0 has a converter for it "
    "(torchair stops with 'Failed to auto-generated converter'): decompose it, with the backend option "
    "decompositions='core' or torchair's custom_decompositions="
    "torch._decomp.get_decompositions([torch.ops.aten._fused_rms_norm]); its backward still fuses")


def whole_forward_misses(graph: fx.Graph, provenance: Optional[Provenance]) -> List[Miss]:
    """A miss for every ``aten._fused_rms_norm`` call in the graph (recomputed there under
    activation checkpointing) or in the forward graph of its partition (named so): it stays as
    it is, never silently."""
    forward = provenance.forward if provenance is not None and provenance.forward is not None else None
    misses = [Miss(OP.name, n.name, WHOLE_FORWARD_REASON) for n in graph.nodes if _is_call(n, FUSED_RMS_NORM)]
    return misses + [Miss(OP.name, f"{n.name} (forward graph)", WHOLE_FORWARD_REASON)
                     for n in (forward.nodes if forward is not None else ()) if _is_call(n, FUSED_RMS_NORM)]


def _find_with_whole_backward(graph: fx.Graph, provenance: Optional[Provenance], rewrites: Rewrites):
    matches, misses = find(graph, provenance, rewrites)
    return matches + whole_backward_sites(graph), misses


def _emit_with_whole_backward(rewrites: Rewrites, site, provenance, target: str):
    if isinstance(site, WholeBackwardMatch):
        return emit_whole_backward(rewrites, site, target)
    return emit(rewrites, site, provenance, target)


def _unexplained_with_whole_ops(graph: fx.Graph, provenance: Optional[Provenance], misses: List[Miss]):
    return unexplained(graph, provenance, misses) + whole_forward_misses(graph, provenance)


#: the rule the pass manager runs
RULE = Rule(OP, _find_with_whole_backward, _emit_with_whole_backward, _unexplained_with_whole_ops)
