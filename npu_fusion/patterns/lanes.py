"""An exact abstract interpreter for RoPE-like backward subgraphs.

RoPE's backward is bilinear and only moves elements along the last axis, so a
node's value can be written, for every position ``i`` of its trailing axes, as
a small polynomial in leaf elements ``leaf[..., p]``. Besides float casts and
complex views and products, the ops read are those of
:attr:`LaneEvaluator.INTERPRETERS`, a table of one small interpreter per aten
op; any other op is a leaf. Leading axes never mix: every op the interpreter
accepts either acts element-wise with PyTorch's right-aligned broadcasting or
works on the trailing axes only. So two nodes whose per-position polynomials are
equal compute the same function of their leaves, whatever the (possibly
symbolic) leading sizes are. That is what makes a match a proof rather than a
resemblance: signs, split points, which table feeds which term and the broadcast
axes are all part of the compared value.

Coefficients are exact rationals (:func:`~.algebra.graph_constant`), so equal
means equal, never "within a tolerance". Casts between float dtypes count as the
identity; the rewrite computes in a dtype that holds every operand exactly and
casts to the replaced node's dtype.
"""
from __future__ import annotations

import math
import operator
from fractions import Fraction
from typing import Dict, List, Optional

import torch.fx as fx

from ..lowering.sizes import same_shape, static_int
from .algebra import exact_number, graph_constant
from .evaluator import MemoEvaluator, Provenance, Unsupported
from .nodes import aten, is_float_cast, meta_value, normalize_dim, val, shape as node_shape
from . import lane_pieces
from .lane_polys import (DegreeExceeded, Lanes, MOVES_LANES, along_axis, degree_of, gather, index_argument, mul_polys,
                         add_polys, shape, step_one, strides, uniform)
from .lane_moves import LaneMoves


def _is_complex(node) -> bool:
    v = val(node) if isinstance(node, fx.Node) else None
    return v is not None and v.dtype.is_complex


CONJ_TARGETS = {aten._conj.default, aten.conj.default, aten.conj_physical.default}
COMPLEX_VIEWS = {aten.view_as_complex.default, aten.view_as_real.default, aten.resolve_conj.default,
                 aten.resolve_neg.default}
ADDITIVE_TARGETS = {aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar}
SCALING_TARGETS = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}


class LaneEvaluator(LaneMoves, MemoEvaluator):
    """Memoized evaluation of nodes into :class:`Lanes`; unknown nodes become leaves."""

    def __init__(self, provenance: Optional[Provenance] = None, forced_leaves=(), max_lanes: Optional[int] = None):
        super().__init__(provenance, forced_leaves)
        #: the widest trailing extent worth tracking (None: any), a bound of the rule's op (RoPE:
        #: no target accepts a head dim above it); a wider leaf is no value, a wider result a leaf
        self.max_lanes = max_lanes
        #: nodes cut into leaves where they are used (reductions, wide factors), beside their value
        self.cut_leaves: Dict[fx.Node, Optional[Lanes]] = {}
        #: wide factors cut from a product, as values of their wide root (see _cut_value)
        self.cut_values: Dict[fx.Node, Lanes] = {}
        self.leaf_ids: Dict[fx.Node, int] = {}
        self.leaves: List[fx.Node] = []
        #: what a rule's matcher found at a node, by (matcher, node): it reads only the node's value and
        #: the leaves', which this evaluator never changes (see :func:`~.rope.match.match_y`)
        self.found: Dict[tuple, object] = {}

    def _too_wide(self, inner) -> bool:
        return self.max_lanes is not None and math.prod(inner) > self.max_lanes

    # -- leaves -------------------------------------------------------------
    def leaf_id(self, node: fx.Node) -> int:
        if node not in self.leaf_ids:
            same = self.provenance.same_saved_value(node) if self.provenance is not None else node
            if same is not node and shape(same) == shape(node):
                self.leaf_ids[node] = self.leaf_id(same)
            else:
                self.leaf_ids[node] = len(self.leaves)
                self.leaves.append(node)
        return self.leaf_ids[node]

    def _leaf(self, node: fx.Node) -> Optional[Lanes]:
        if self.provenance is not None and self.provenance.is_forward(node):
            raise Unsupported("forward node not saved for backward")
        s, v = shape(node), val(node)
        if s is None or not s or not (v.dtype.is_floating_point or v.dtype.is_complex):
            return None
        inner = tuple(static_int(x) for x in s[len(s) - (2 if v.dtype.is_complex else 1):])
        if None in inner or self._too_wide(inner):
            return None
        # position i (flat, over every tracked axis) is the leaf's element i
        return Lanes(inner, pieces=lane_pieces.leaf_pieces(self.leaf_id(node), math.prod(inner)),
                     complex=v.dtype.is_complex)

    def _operand(self, arg, out_node) -> Lanes:
        """An element-wise operand, broadcast to ``out_node``'s trailing sizes."""
        s = graph_constant(arg)
        out_shape = shape(out_node)
        if s is not None:
            d = static_int(out_shape[-1]) if out_shape else None
            if d is None:
                raise Unsupported("dynamic last axis")
            return Lanes((d,), pieces=lane_pieces.constant_pieces(s, d))
        return self._checked(arg)

    def _broadcast(self, v: Lanes, node_shape, inner) -> Lanes:
        """Bring v, the value of a tensor shaped ``node_shape``, to trailing sizes ``inner``."""
        if v.inner == inner:
            return v
        if v.is_constant() and uniform(v):
            if len(inner) == 1:
                return Lanes(inner, pieces=lane_pieces.constant_pieces(v.poly_at(0).get((), 0), inner[0]))
            return Lanes(inner, [dict(v.poly_at(0)) for _ in range(math.prod(inner))])
        k, own = len(inner), len(v.inner)
        node_shape = tuple(node_shape)
        if len(node_shape) < k:
            node_shape = (1,) * (k - len(node_shape)) + node_shape
        tail = tuple(static_int(s) for s in node_shape[len(node_shape) - k:])
        # axes tracked for the output but not for v must be broadcast (size 1) in v's tensor
        src_inner = (1,) * (k - own) + v.inner
        if own > k or tail != src_inner or any(s not in (1, i) for s, i in zip(src_inner, inner)):
            raise Unsupported("broadcast")
        source_strides = [0 if sz == 1 else st for sz, st in zip(src_inner, strides(src_inner))]
        return Lanes(inner, [v.polys[f] for f in gather(inner, source_strides)])

    def _elementwise(self, node, args, combine, cut=()) -> Lanes:
        """``combine`` position by position; the ``cut`` arguments are taken as leaves."""
        out_shape = shape(node)
        if out_shape is None or not out_shape:
            raise Unsupported("no shape")
        operands = [self._cut_value(a) if a in cut else self._operand(a, node) for a in args]
        width = max(len(o.inner) for o in operands)
        inner = tuple(static_int(s) for s in out_shape[len(out_shape) - width:])
        if len(inner) != width or None in inner:
            raise Unsupported("inner sizes")
        shapes = [shape(a) if isinstance(a, fx.Node) else () for a in args]
        operands = [self._broadcast(o, s if s else out_shape, inner) for o, s in zip(operands, shapes)]
        if all(o.flat is not None for o in operands):  # once a run: the same sums and products
            return Lanes(inner, pieces=lane_pieces.combine([o.flat for o in operands], combine))
        return Lanes(inner, [combine(*ps) for ps in zip(*(o.polys for o in operands))])

    def _inner_dim(self, node_in, v: Lanes, dim) -> int:
        rank = len(shape(node_in))
        dim = normalize_dim(dim, rank)
        first = rank - len(v.inner)
        if dim < first:
            raise Unsupported("leading-axis op")
        return dim - first

    def _select_positions(self, v: Lanes, axis: int, picks) -> Lanes:
        if v.pieces is not None and step_one(picks):
            return Lanes((len(picks),), pieces=lane_pieces.window(v.pieces, picks[0], picks[0] + len(picks)))
        inner = list(v.inner)
        new_inner = tuple(inner[:axis] + [len(picks)] + inner[axis + 1:])
        return Lanes(new_inner, [v.polys[f] for f in along_axis(v.inner, axis, picks)])

    def _scatter(self, base: Lanes, src: Lanes, axis: int, picks) -> Lanes:
        if base.pieces is not None and src.pieces is not None and step_one(picks) and \
                lane_pieces.length(src.pieces) == len(picks) and picks[-1] < base.inner[0]:
            return Lanes(base.inner, pieces=lane_pieces.placed(base.pieces, src.pieces, picks[0]))
        polys = list(base.polys)  # polynomials are never changed in place: shared, not copied
        for target, poly in zip(along_axis(base.inner, axis, picks), src.polys):
            polys[target] = poly
        return Lanes(base.inner, polys)

    def _reshape(self, node, v: Lanes) -> Lanes:
        in_shape, out_shape = shape(node.args[0]), shape(node)
        lead_in = in_shape[:len(in_shape) - len(v.inner)]
        total = math.prod(v.inner)
        # leading axes all of size 1 on both sides (a sequence of length 1) hold one element per tracked
        # position however many there are: [1, D/2] complex viewed as [1, 1, 1, D/2] keeps (D/2, 2)
        single = all(static_int(s) == 1 for s in lead_in)
        for k in range(1, len(out_shape) + 1):
            tail = [static_int(s) for s in out_shape[len(out_shape) - k:]]
            if None in tail:
                break
            lead_out = out_shape[:len(out_shape) - k]
            if math.prod(tail) == total and (same_shape(lead_out, lead_in) or single and all(
                    static_int(s) == 1 for s in lead_out)):
                # row-major order is kept: the same flat positions
                return Lanes(tuple(tail), v._polys, pieces=v.flat)
            if math.prod(tail) > total:
                break
        raise Unsupported("reshape crosses leading axes")

    def _interpret(self, node: fx.Node, forward: bool = False) -> Lanes:
        """Read ``node`` through :attr:`INTERPRETERS`, after the checks that hold for every op."""
        t = node.target
        # tensors stay nodes; symbolic sizes and indices become their SymInt values
        args = tuple(a if isinstance(a, fx.Node) and val(a) is not None else meta_value(a) for a in node.args)
        if t in (aten.cat.default, aten.stack.default):
            args = (list(node.args[0]),) + args[1:]
        if is_float_cast(node):
            v = self.value(args[0])
            if v is None:
                raise Unsupported("cast of opaque")
            return v
        # add and sub are read position by position even on complex values' (re, im) view
        if t not in ADDITIVE_TARGETS and (_is_complex(node) or any(_is_complex(a) for a in args[:1])):
            return self._complex(node, args)
        if t in SCALING_TARGETS and not forward:
            self._refuse_scaled_input(args)
        interpreter = self.INTERPRETERS.get(t)
        if interpreter is None:
            raise Unsupported(f"op {t}")
        return getattr(self, interpreter)(node, args)

    # -- interpreters, one per op (see INTERPRETERS); each takes the node and its read args --
    def _additive(self, node, args) -> Lanes:
        t = node.target
        alpha = node.kwargs.get("alpha", 1)
        alpha = graph_constant(alpha)
        if alpha is None:
            raise Unsupported("alpha")
        sign = (-1 if t in (aten.sub.Tensor, aten.sub.Scalar) else 1) * alpha
        if _is_complex(node) and not all(_is_complex(a) for a in args[:2]):
            # a real operand adds to the real parts only; read lane by lane it would add to both
            raise Unsupported("complex sum with a real operand")
        if t in (aten.add.Tensor, aten.sub.Tensor) and all(
                isinstance(a, fx.Node) and degree_of(self._checked(a)) <= 1 for a in args[:2]):
            raise Unsupported("gradient accumulation: the sum is an input of the pattern")
        return self._elementwise(node, args[:2], lambda a, b: add_polys(a, b, sign))

    def _refuse_scaled_input(self, args) -> None:
        """A product or quotient by a constant of a degree-one value is a leaf."""
        if graph_constant(args[1]) is None and graph_constant(args[0]) is None:
            return
        tensor = args[0] if graph_constant(args[1]) is not None else args[1]
        if isinstance(tensor, fx.Node) and degree_of(self._checked(tensor)) <= 1:
            # a scaled gradient (q * scale after RoPE, SDPA's scaled q) is the pattern's dy
            raise Unsupported("scaled input: a leaf")

    def _multiply(self, node, args) -> Lanes:
        return self._product(node, args[:2])

    def _addcmul(self, node, args) -> Lanes:
        """Read ``addcmul(a, b, c, value=v)`` as ``a + v * b * c`` position by position (a rotation summed in one call)."""
        value = graph_constant(node.kwargs.get("value", 1))
        if value is None:
            raise Unsupported("value")
        return self._elementwise(node, args[:3], lambda a, b, c: add_polys(a, mul_polys(b, c), value))

    def _divide(self, node, args) -> Lanes:
        if graph_constant(args[1]) in (None, 0):
            raise Unsupported(f"op {node.target}")  # a quotient by a tensor is no polynomial
        inv = exact_number(1 / Fraction(graph_constant(args[1])))
        return self._elementwise(node, args[:1], lambda a: add_polys({}, a, inv))

    def _negate(self, node, args) -> Lanes:
        return self._elementwise(node, args[:1], lambda a: add_polys({}, a, -1))

    def _complex(self, node, args) -> Lanes:
        """view_as_complex/real, conjugation and products of complex tensors, on (re, im) pairs."""
        t = node.target
        if t in COMPLEX_VIEWS or is_float_cast(node):
            v = self._checked(args[0])
            return Lanes(v.inner, v._polys, complex=_is_complex(node), pieces=v.flat)
        if t in CONJ_TARGETS:
            v = self._checked(args[0])
            return Lanes(v.inner, [p if i % 2 == 0 else add_polys({}, p, -1) for i, p in enumerate(v.polys)],
                         complex=True)
        if t is aten.mul.Tensor and all(_is_complex(a) for a in args[:2]):
            try:
                return self._complex_product(node, args[:2])
            except DegreeExceeded:  # as for real products: a wide factor is dy, a leaf
                wide = [a for a in args[:2] if degree_of(self._checked(a)) >= 2]
                return self._complex_product(node, args[:2], cut=wide)
        if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints):
            v = self._checked(args[0])
            return Lanes(self._reshape(node, v).inner, v._polys, complex=_is_complex(node), pieces=v.flat)
        raise Unsupported(f"complex op {t}")

    def _complex_product(self, node, args, cut=()) -> Lanes:
        inner = tuple(static_int(x) for x in shape(node)[-2:])
        a, b = (self._broadcast(self._cut_value(x) if x in cut else self._checked(x), shape(x), inner) for x in args)
        polys = []
        for j in range(0, len(a.polys), 2):
            (ar, ai), (br, bi) = a.polys[j:j + 2], b.polys[j:j + 2]
            polys.append(add_polys(mul_polys(ar, br), mul_polys(ai, bi), -1))
            polys.append(add_polys(mul_polys(ar, bi), mul_polys(ai, br)))
        return Lanes(inner, polys, complex=True)

    def _product(self, node, args) -> Lanes:
        """Evaluate a product, cutting factors wider than any RoPE term into leaves.

        A product; where it would be wider than any RoPE term, its factors of degree two
        or more are cut into leaves: such a factor is the pattern's dy, an expression of its
        own (``2 * grad * y`` after ``y.square()``, ``grad * k_rot`` after ``q_rot . k_rot``,
        a per-position scale). Cutting is always sound: a leaf is the node's own value."""
        try:
            return self._elementwise(node, args, mul_polys)
        except DegreeExceeded:
            wide = [a for a in args if isinstance(a, fx.Node) and degree_of(self._checked(a)) >= 2]
            return self._elementwise(node, args, mul_polys, cut=wide)

    def _cut_value(self, node: fx.Node) -> Lanes:
        """A wide factor cut from a product: a leaf, or, when it only moves the elements of a
        wider value (a slice, a negation, a view of ``2 * grad * y``), that movement of the wide
        value made a leaf, so that every piece of one dy reads one leaf. Exact either way: the
        moving ops are interpreted on the leaf, which is its own value."""
        if node not in self.cut_values:
            root, chain = self._wide_root(node)
            self.cut_values[node] = self._as_leaf(node) if not chain else self._over_leaf(root, chain)
        return self.cut_values[node]

    def _wide_root(self, node: fx.Node):
        """The value ``node`` moves the elements of, through one-input moving ops whose input
        is still of degree two or more, and those ops (``node`` first)."""
        chain = []
        while node.op == "call_function" and (node.target in MOVES_LANES or is_float_cast(node)) \
                and isinstance(node.args[0], fx.Node):
            parent = self.memo.get(node.args[0])
            if parent is None or parent.reduction is not None or degree_of(parent) < 2:
                break
            chain.append(node)
            node = node.args[0]
        return node, chain

    def _over_leaf(self, root: fx.Node, chain: List[fx.Node]) -> Lanes:
        """``chain[0]``'s value with ``root`` a leaf; the memo keeps their values as they were."""
        nodes = [root, *chain]
        memo, rounded = {n: self.memo.pop(n) for n in nodes if n in self.memo}, \
            {n: self.rounded.pop(n) for n in nodes if n in self.rounded}
        self.forced_leaves.add(root)
        try:
            value = self.value(chain[0])
        finally:
            self.forced_leaves.discard(root)
            for n in nodes:
                self.memo.pop(n, None)
                self.rounded.pop(n, None)
            self.memo.update(memo)
            self.rounded.update(rounded)
        if value is None:
            raise Unsupported("no leaf")
        return value

    def _as_leaf(self, node: fx.Node) -> Lanes:
        if node not in self.cut_leaves:
            self.cut_leaves[node] = self._leaf(node)
        if self.cut_leaves[node] is None:
            raise Unsupported("no leaf")
        return self.cut_leaves[node]

    def _checked(self, arg) -> Lanes:
        """The value of a node used as an operand. A reduction over leading axes (GQA's
        repeat_kv backward, a broadcast's sum) is an input here: it becomes a leaf."""
        v = self.value(arg) if isinstance(arg, fx.Node) else None
        if v is not None and v.reduction is not None:
            return self._as_leaf(arg)
        if v is None:
            raise Unsupported("operand")
        return v

    def _getitem(self, node, _args) -> Lanes:
        """An output of unbind, split or chunk, read from the parent's own arguments."""
        parent, index = node.args
        if not isinstance(parent, fx.Node) or parent.op != "call_function":
            raise Unsupported("getitem")
        t, pargs = parent.target, parent.args
        v = self._checked(pargs[0])
        if t is aten.unbind.int:
            axis = self._inner_dim(pargs[0], v, pargs[1] if len(pargs) > 1 else 0)
            picked = self._select_positions(v, axis, [index])
            inner = picked.inner[:axis] + picked.inner[axis + 1:]
            if not inner:
                raise Unsupported("unbind removes the last tracked axis")
            return Lanes(inner, picked._polys, pieces=picked.flat)
        if t in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
            dim = pargs[2] if len(pargs) > 2 else 0
            axis = self._inner_dim(pargs[0], v, dim)
            size = v.inner[axis]
            if t is aten.split_with_sizes.default:
                sizes = [index_argument(meta_value(x)) for x in pargs[1]]
            elif t is aten.chunk.default:
                step = -(-size // pargs[1])
                sizes = [min(step, size - s) for s in range(0, size, step)]
            else:
                step = index_argument(meta_value(pargs[1]))
                sizes = [min(step, size - s) for s in range(0, size, step)]
            start = sum(sizes[:index])
            return self._select_positions(v, axis, range(start, start + sizes[index]))
        raise Unsupported("getitem")

    def _sum(self, node, _args) -> Lanes:
        src = node.args[0]
        v = self._checked(src)
        rank = len(shape(src))
        dims = node.args[1] if len(node.args) > 1 else None
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if node.kwargs.get("dtype") is not None or not dims:
            raise Unsupported("sum")
        dims = sorted(normalize_dim(d, rank) for d in dims)
        if any(d >= rank - len(v.inner) for d in dims):
            raise Unsupported("sum over a tracked axis")
        return Lanes(v.inner, v._polys, reduction=(src, tuple(dims), bool(keepdim)), pieces=v.flat)

    def _reduced_view(self, node, v: Lanes) -> Lanes:
        """Unit-axis reshapes after a reduction keep its value (the matcher checks shapes);
        any other reshape reads the reduction as an input, a leaf (GQA's summed k gradient,
        cast and viewed as ``[..., D/2, 2]`` by torchtune's RoPE)."""
        def squeezed(s):
            return [x for x in s if not (static_int(x) == 1)]
        if not same_shape(squeezed(shape(node)), squeezed(shape(node.args[0]))):
            return self._reshape(node, self._checked(node.args[0]))
        return v

    #: aten op -> the name of its interpreter, looked up on the instance (so a subclass or a
    #: test can replace one); ops not listed are leaves, ``Unsupported("op ...")``
    INTERPRETERS = {
        **dict.fromkeys(ADDITIVE_TARGETS, "_additive"),
        aten.mul.Tensor: "_multiply", aten.mul.Scalar: "_multiply",
        aten.addcmul.default: "_addcmul",
        aten.div.Tensor: "_divide", aten.div.Scalar: "_divide",
        aten.neg.default: "_negate",
        aten.slice.Tensor: "_slice",
        aten.select.int: "_select",
        aten.slice_backward.default: "_slice_backward",
        aten.select_backward.default: "_select_backward",
        aten.slice_scatter.default: "_slice_scatter",
        **dict.fromkeys([aten.full.default, aten.zeros.default, aten.full_like.default,
                         aten.zeros_like.default, aten.new_zeros.default], "_fill"),
        aten.cat.default: "_cat",
        aten.stack.default: "_stack",
        **dict.fromkeys([aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                         aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.dims,
                         aten.squeeze.dim, aten.unsqueeze.default], "_view"),
        aten.transpose.int: "_permute", aten.permute.default: "_permute",
        aten.expand.default: "_expand",
        operator.getitem: "_getitem",
        aten.sum.dim_IntList: "_sum", aten.sum.default: "_sum",
    }
