"""Reading a backward graph: a node's value (shape and dtype, sizes maybe symbolic), float
casts and the dtypes that hold others, and walks over users and inputs. Every module
of the pass reads graphs through these."""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Dict, Iterable, List, Optional

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims


#: the classes of recorded values that are tensors (``isinstance`` of a tensor class is slow, its answer fixed)
_TENSOR_TYPES = set()


def val(node) -> Optional[torch.Tensor]:
    """The node's recorded tensor value (its ``meta["val"]``), or None (not a node, not a tensor)."""
    if isinstance(node, fx.Node):
        v = node.meta.get("val")
        kind = type(v)
        if kind in _TENSOR_TYPES:
            return v
        if isinstance(v, torch.Tensor):
            _TENSOR_TYPES.add(kind)
            return v
    return None

def _geometry(node) -> Optional[tuple]:
    """(shape, dtype) of the node's recorded tensor value (:func:`val`), or None; inside :func:`one_round`
    remembered per node while its recorded value is the same object (a fake tensor's ``shape`` is slow)."""
    cache = _GEOMETRIES
    if cache is not None and isinstance(node, fx.Node):
        known = cache.get(node)
        if known is not None and known[0] is node.meta.get("val"):
            return known[1]
    v = val(node)
    if v is None:
        return None
    geometry = (v.shape, v.dtype)  # a torch.Size: a tuple
    if cache is not None:
        cache[node] = (v, geometry)
    return geometry

def shape(node) -> Optional[tuple]:
    """The shape of the node's recorded tensor value (:func:`val`), or None (remembered as :func:`_geometry` says)."""
    geometry = _geometry(node)
    return geometry[0] if geometry is not None else None

def dtype(node) -> Optional[torch.dtype]:
    """The dtype of the node's recorded tensor value (:func:`val`), or None (remembered as :func:`_geometry` says)."""
    geometry = _geometry(node)
    return geometry[1] if geometry is not None else None


#: inside :func:`one_round`, each node's shape and dtype with the recorded value they were read off
#: (an answer holds while ``meta["val"]`` is that object); None outside, where nothing is remembered
_GEOMETRIES: Optional[Dict[fx.Node, tuple]] = None

def meta_value(arg):
    """A node argument as a value: symbolic sizes are nodes in FX, their SymInt in meta."""
    if isinstance(arg, fx.Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return type(arg)(meta_value(a) for a in arg)
    return arg

def normalize_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim

def axis_order(target, args, rank: int) -> List[int]:
    """For ``transpose(x, a, b)`` or ``permute(x, dims)``: the input axis each output axis
    comes from (``args`` are the op's arguments after ``x``)."""
    if target is aten.transpose.int:
        order = list(range(rank))
        a, b = normalize_dim(args[0], rank), normalize_dim(args[1], rank)
        order[a], order[b] = order[b], order[a]
        return order
    return [normalize_dim(d, rank) for d in args[0]]

CAST_TARGETS = {
    aten._to_copy.default, prims.convert_element_type.default, aten.to.dtype,
    aten.clone.default, aten.alias.default, aten.detach.default, aten.contiguous.default,
    aten.lift_fresh_copy.default,
}

#: ops whose output is a view of their first input: it shares that input's storage
VIEWS = {
    aten.view.default, aten._unsafe_view.default, aten.expand.default, aten.slice.Tensor, aten.select.int,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default, aten.t.default,
    aten.transpose.int, aten.permute.default, aten.alias.default, aten.detach.default,
}


def is_float_cast(node: fx.Node) -> bool:
    """Casts between float dtypes, copies and aliases: the identity in real arithmetic, up
    to the rounding of a narrowing cast."""
    if node.op != "call_function" or node.target not in CAST_TARGETS:
        return False
    src = node.args[0] if node.args else None
    src_value, out_value = val(src), val(node)
    if src_value is None or out_value is None:
        return False
    if node.target is aten._to_copy.default:
        extra = set(node.kwargs) - {"dtype", "layout", "device", "memory_format", "non_blocking"}
        if extra or (src_value.device != out_value.device):
            return False
    src_dtype, out_dtype = dtype(src), dtype(node)
    if src_dtype.is_complex or out_dtype.is_complex:
        return src_dtype == out_dtype
    return src_dtype.is_floating_point and out_dtype.is_floating_point

def is_value_preserving_cast(node: fx.Node) -> bool:
    """A float cast, copy or alias that changes no value: to a dtype that holds every value
    of its source, or back to the dtype its source was widened from (``x.float().to(x.dtype)``).
    Any other float cast rounds; the evaluators see through it (they compute in real
    arithmetic) and remember it (``MemoEvaluator.rounded``, :func:`rounding_problem`)."""
    if not is_float_cast(node):
        return False
    out = dtype(node)
    if out.is_complex:
        return True
    origin = node.args[0]
    while True:
        if holds(out, dtype(origin)):
            return True
        if not (is_float_cast(origin) and holds(dtype(origin), dtype(origin.args[0]))):
            return False
        origin = origin.args[0]

@functools.lru_cache(maxsize=None)
def holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Every value of float dtype ``narrow`` is a value of ``wide``."""
    w, n = torch.finfo(wide), torch.finfo(narrow)
    return wide == narrow or (w.bits >= n.bits and w.eps <= n.eps and w.max >= n.max and w.tiny <= n.tiny)

def calls_to(graph: fx.Graph, *targets) -> List[fx.Node]:
    """The graph's calls of any of ``targets``, in graph order, read off FX's own index of nodes by
    target (which every insertion and erasure keeps), not by a walk over the whole graph."""
    if len(targets) == 1:
        return graph.find_nodes(op="call_function", target=targets[0])
    return sorted(n for t in targets for n in graph.find_nodes(op="call_function", target=t, sort=False))

@functools.lru_cache(maxsize=None)
def target_name(target: Any) -> str:
    return getattr(target, "__name__", str(target))

def last_of(graph: fx.Graph, nodes: Iterable[fx.Node]) -> fx.Node:
    return max(nodes)  # fx nodes compare by their position in the graph

def downstream(graph: fx.Graph, seeds: Iterable[fx.Node], depth: int) -> List[fx.Node]:
    """Nodes at most ``depth`` uses away from the seeds (seeds included), in graph order."""
    seen = set(seeds)
    frontier = list(seen)
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users if u not in seen]
        seen.update(frontier)
    return sorted(seen)

def outermost(items, node=lambda item: item, same=lambda outer, inner: True) -> list:
    """Drop an item whose node's only user is another item's node (a cast or a view of the
    same value), keeping the outermost of each such chain."""
    by_node = {node(item): item for item in items}

    def is_inner(item):
        users = node(item).users
        outer = by_node.get(next(iter(users))) if len(users) == 1 else None
        return outer is not None and same(outer, item)

    return [item for item in items if not is_inner(item)]

def region_of(outputs: Iterable[fx.Node], interior) -> List[fx.Node]:
    """The interpreted nodes the outputs are computed from, outputs included."""
    seen: Dict[fx.Node, None] = {}
    stack = list(outputs)
    while stack:
        node = stack.pop()
        if node in seen or not interior(node):
            continue
        seen[node] = None
        stack.extend(a for a in node.all_input_nodes)
    return list(seen)

def gradient_dependent(graph: fx.Graph) -> Optional[set]:
    """The nodes of a backward graph whose value depends on an incoming gradient
    (AOTAutograd's ``tangents_*`` placeholders), or None when the graph names none.

    The others are forward values: saved, or recomputed in the backward (activation
    checkpointing, the min-cut partitioner). A fused op reads them as inputs; they are
    never part of the subgraph it replaces, so their other users keep them.

    Inside :func:`one_round` the answer is computed once per graph and extended to the nodes
    the round inserts, judged by their inputs (a rule asks for each site it emits: a
    whole-graph walk each time made the pass quadratic in the layers).
    """
    if graph in _ROUND_ANSWERS:
        if _ROUND_ANSWERS[graph] is _UNKNOWN:
            _ROUND_ANSWERS[graph] = _gradient_nodes(graph)
        return _ROUND_ANSWERS[graph]
    return _gradient_nodes(graph)


def _is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and node.name.startswith("tangents")


class GradientNodes(set):
    """:func:`gradient_dependent`'s set, which also answers for nodes inserted after it was
    computed: such a node depends on a gradient when one of its inputs does."""

    def __init__(self, members, graph_nodes):
        super().__init__(members)
        self._judged = set(graph_nodes)

    def __contains__(self, node) -> bool:
        if node in self._judged or not isinstance(node, fx.Node):
            return set.__contains__(self, node)
        stack = [node]
        while stack:  # judge unjudged inputs first, without recursion
            top = stack[-1]
            pending = [a for a in top.all_input_nodes if a not in self._judged]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            if top not in self._judged:
                self._judged.add(top)
                if _is_tangent(top) or any(set.__contains__(self, a) for a in top.all_input_nodes):
                    self.add(top)
        return set.__contains__(self, node)


def _gradient_nodes(graph: fx.Graph) -> Optional[GradientNodes]:
    """The tangents and every node that reads one, directly or not.

    A walk over users from the tangents, which visits only those nodes (the same set as a pass over the whole graph in
    order asking each node whether an input is in it, and a placeholder reads nothing)."""
    tangents = [n for n in graph.find_nodes(op="placeholder") if _is_tangent(n)]
    if not tangents:
        return None
    found, stack = set(tangents), list(tangents)
    while stack:
        for user in stack.pop().users:
            if user not in found:
                found.add(user)
                stack.append(user)
    return GradientNodes(found, graph.nodes)


_UNKNOWN = object()
#: graphs inside :func:`one_round`: their gradient_dependent answer, once computed
_ROUND_ANSWERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def one_round(graph: fx.Graph):
    """One round of the rules on ``graph``: :func:`gradient_dependent` is computed once in it.
    Rewrites insert fused ops and casts whose inputs say what they depend on, and replace
    regions by values that depend on the same gradient, so the answer holds through the round.
    Each node's :func:`shape` and :func:`dtype` are remembered through the outermost round too."""
    global _GEOMETRIES
    _ROUND_ANSWERS[graph] = _UNKNOWN
    outer = _GEOMETRIES is None
    if outer:
        _GEOMETRIES = {}
    try:
        yield
    finally:
        _ROUND_ANSWERS.pop(graph, None)
        if outer:
            _GEOMETRIES = None


def gradient_product(node: fx.Node, gradient: set) -> Optional[tuple]:
    """``(gradient operand, other operand)`` of a tensor product of a value that depends on an
    incoming gradient and one that does not (a forward value); else None."""
    if node.op != "call_function" or node.target is not aten.mul.Tensor:
        return None
    operands = [a for a in node.args[:2] if isinstance(a, fx.Node)]
    if len(operands) != 2 or sum(a in gradient for a in operands) != 1:
        return None
    return tuple(operands) if operands[0] in gradient else (operands[1], operands[0])


def outside_users(region: List[fx.Node], outputs: Iterable[fx.Node]) -> List[fx.Node]:
    """Interior nodes (not outputs) used by nodes outside the region."""
    inside, outs = set(region), set(outputs)
    return [n for n in region if n not in outs and any(u not in inside for u in n.users)]


#: pointwise ops whose output is NaN wherever an operand is (a power: by a nonzero exponent), and clamps (which keep NaN)
NAN_KEEPING = {aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default, aten.neg.default, aten.pow.Tensor_Scalar,
               aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
               aten.div.Tensor, aten.div.Scalar, aten.clamp.default, aten.clamp_min.default}


def nan_wherever(node, source: fx.Node, definition=lambda n: n, depth: int = 8) -> bool:
    """Whether ``node`` is NaN wherever ``source`` is: ``source`` itself, or pointwise ops and float casts of it.

    ``definition`` maps a node to the node that computes it (a saved tensor to its forward definition)."""
    node = definition(node) if isinstance(node, fx.Node) else node
    if node is definition(source):
        return True
    if depth == 0 or not isinstance(node, fx.Node) or node.op != "call_function" or not (
            node.target in NAN_KEEPING or is_float_cast(node)):
        return False
    if node.target is aten.pow.Tensor_Scalar and node.args[1] == 0:
        return False  # NaN ** 0 is 1
    return any(nan_wherever(a, source, definition, depth - 1) for a in node.args[:2] if isinstance(a, fx.Node))
