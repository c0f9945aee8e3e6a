"""The lanes evaluator's interpreters of the ops that move elements: slices, selects, scatters, fills, cat, stack, views, permutes, expands."""
from __future__ import annotations


from ..lowering.sizes import same_shape, static_int
from .algebra import graph_constant
from .evaluator import Unsupported
from .nodes import axis_order, normalize_dim
from . import lane_pieces
from .lane_polys import Lanes, gather, index_argument, shape, strides, zeros


class LaneMoves:
    """The interpreters of :class:`~.lanes.LaneEvaluator` that move elements (see its ``INTERPRETERS``)."""

    def _slice(self, node, args) -> Lanes:
        v = self._checked(args[0])
        axis = self._inner_dim(args[0], v, args[1] if len(args) > 1 else 0)
        size = v.inner[axis]
        start, end, step = (list(args[2:5]) + [None, None, 1])[:3]
        start, end, step = (index_argument(x) for x in (start, end, step))
        return self._select_positions(v, axis, range(size)[slice(start, end, step)])

    def _select(self, node, args) -> Lanes:
        v = self._checked(args[0])
        axis = self._inner_dim(args[0], v, args[1])
        picked = self._select_positions(v, axis, [index_argument(args[2]) % v.inner[axis]])
        inner = picked.inner[:axis] + picked.inner[axis + 1:]
        if not inner:
            raise Unsupported("select removes the last tracked axis")
        return Lanes(inner, picked._polys, pieces=picked.flat)

    def _slice_backward(self, node, args) -> Lanes:
        grad, sizes, dim, start, end, step = args
        start, end, step = (index_argument(x) for x in (start, end, step))
        v = self._checked(grad)
        axis = self._inner_dim(grad, v, dim)
        full = static_int(sizes[normalize_dim(dim, len(sizes))])
        if full is None or not same_shape(sizes[:len(sizes) - len(v.inner)],
                                         shape(grad)[:len(sizes) - len(v.inner)]):
            raise Unsupported("slice_backward sizes")
        inner = v.inner[:axis] + (full,) + v.inner[axis + 1:]
        return self._scatter(zeros(inner), v, axis, range(full)[slice(start, end, step)])

    def _slice_scatter(self, node, args) -> Lanes:
        kw = node.kwargs
        base, src = self._checked(args[0]), self._checked(args[1])
        dim = args[2] if len(args) > 2 else kw.get("dim", 0)
        start = args[3] if len(args) > 3 else kw.get("start")
        end = args[4] if len(args) > 4 else kw.get("end")
        step = args[5] if len(args) > 5 else kw.get("step", 1)
        start, end, step = (index_argument(x) for x in (start, end, step))
        axis = self._inner_dim(args[0], base, dim)
        base = self._broadcast(base, shape(args[0]), base.inner)
        picks = range(base.inner[axis])[slice(start, end, step)]
        if src.inner[:axis] + src.inner[axis + 1:] != base.inner[:axis] + base.inner[axis + 1:] or \
                src.inner[axis] != len(picks):
            raise Unsupported("slice_scatter sizes")
        return self._scatter(base, src, axis, picks)

    def _fill(self, node, args) -> Lanes:
        fill = 0 if "zeros" in str(node.target) else graph_constant(args[1])
        if fill is None:
            raise Unsupported("fill")
        d = static_int(shape(node)[-1]) if shape(node) else None
        if d is None:
            raise Unsupported("a 0-dim or dynamic last axis")
        return Lanes((d,), pieces=lane_pieces.constant_pieces(fill, d))

    def _cat(self, node, args) -> Lanes:
        tensors = args[0]
        dim = args[1] if len(args) > 1 else node.kwargs.get("dim", 0)
        vals = [self._checked(a) for a in tensors]
        axis = self._inner_dim(tensors[0], vals[0], dim)
        inner = vals[0].inner
        if any(len(v.inner) != len(inner) for v in vals):
            raise Unsupported("cat ranks")
        total = sum(v.inner[axis] for v in vals)
        new_inner = inner[:axis] + (total,) + inner[axis + 1:]
        out = zeros(new_inner)
        offset = 0
        for v in vals:
            if v.inner[:axis] + v.inner[axis + 1:] != inner[:axis] + inner[axis + 1:]:
                raise Unsupported("cat sizes")
            out = self._scatter(out, v, axis, range(offset, offset + v.inner[axis]))
            offset += v.inner[axis]
        return out

    def _stack(self, node, args) -> Lanes:
        tensors = args[0]
        dim = args[1] if len(args) > 1 else node.kwargs.get("dim", 0)
        vals = [self._checked(a) for a in tensors]
        rank = len(shape(node))
        dim = normalize_dim(dim, rank)
        inner = vals[0].inner
        if any(v.inner != inner for v in vals) or dim < rank - len(inner) - 1:
            raise Unsupported("stack")
        axis = dim - (rank - len(inner) - 1)
        new_inner = inner[:axis] + (len(vals),) + inner[axis:]
        out = zeros(new_inner)
        for k, v in enumerate(vals):
            expanded = Lanes(inner[:axis] + (1,) + inner[axis:], v._polys, pieces=v.flat)
            out = self._scatter(out, expanded, axis, [k])
        return out

    def _view(self, node, args) -> Lanes:
        """view, reshape, flatten, squeeze and their kin."""
        v = self.value(args[0])
        if v is None:
            raise Unsupported("view of opaque")
        if v.reduction is not None:
            return self._reduced_view(node, v)
        return self._reshape(node, v)

    def _permute(self, node, args) -> Lanes:
        v = self._checked(args[0])
        rank = len(shape(args[0]))
        first = rank - len(v.inner)
        order = axis_order(node.target, args[1:], rank)
        if order[:first] != list(range(first)):  # the lanes prove values along the tracked axes only
            raise Unsupported("moves the last axis" if order[-1] != rank - 1 else "permutes leading axes")
        perm = [d - first for d in order[first:]]
        if perm == sorted(perm):  # the tracked axes stay in place (the heads and the sequence swapped): the value
            return v
        new_inner = tuple(v.inner[p] for p in perm)
        source = strides(v.inner)
        return Lanes(new_inner, [v.polys[f] for f in gather(new_inner, [source[p] for p in perm])])

    def _expand(self, node, args) -> Lanes:
        v = self._checked(args[0])
        inner = tuple(static_int(s) for s in shape(node)[len(shape(node)) - len(v.inner):])
        if None in inner:  # a symbolic size among the tracked axes (a mean's gradient over a dynamic axis)
            raise Unsupported("inner sizes")
        return self._broadcast(v, shape(args[0]), inner)

    def _select_backward(self, node, args) -> Lanes:
        """Evaluate ``select_backward``: the gradient placed at one index of a new axis.

        ``select_backward(grad, sizes, dim, index)``: grad placed at ``index`` of a new axis
        ``dim``, zeros elsewhere (torchtune's ``stack([x[..., 0] * c - ..., ...], -1)``). The
        new axis joins the tracked ones, so it must lie among them or just before them."""
        grad, sizes, dim, index = args
        v = self._checked(grad)
        rank = len(sizes)
        dim = normalize_dim(dim, rank)
        axis = dim - (rank - len(v.inner) - 1)
        full, index = static_int(sizes[dim]), index_argument(index)
        if axis < 0 or full is None or not same_shape(sizes[:rank - len(v.inner) - 1],
                                                      shape(grad)[:rank - len(v.inner) - 1]):
            raise Unsupported("select_backward sizes")
        inner = v.inner[:axis] + (full,) + v.inner[axis:]
        if self._too_wide(inner):
            raise Unsupported("select_backward too wide")
        return self._scatter(zeros(inner), Lanes(v.inner[:axis] + (1,) + v.inner[axis:], v._polys, pieces=v.flat),
                             axis, [index % full])
