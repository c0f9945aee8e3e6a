"""What the pattern modules share: shapes that may be symbolic, node metadata,
forward-graph provenance of saved tensors, the memoized evaluator both matchers
build on, and the rewrite, one transaction per candidate (:class:`Rewrites`)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import operator
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..compat import outside_fake_mode
from ..lowering.constraints import FusedOpInputError

aten = torch.ops.aten
prims = torch.ops.prims
log = logging.getLogger("npu_fusion")


class Unsupported(Exception):
    """A node is outside the abstract domain: the evaluator treats it as a leaf."""


def val(node) -> Optional[torch.Tensor]:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def shape(node) -> Optional[tuple]:
    v = val(node)
    return v.shape if v is not None else None  # a torch.Size: a tuple


def dtype(node) -> Optional[torch.dtype]:
    v = val(node)
    return v.dtype if v is not None else None


def meta_value(arg):
    """A node argument as a value: symbolic sizes are nodes in FX, their SymInt in meta."""
    if isinstance(arg, fx.Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return type(arg)(meta_value(a) for a in arg)
    return arg


def static_int(size) -> Optional[int]:
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        if expr.is_number:
            return int(expr)
    return None


def same_size(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(statically_known_true(a == b))


def same_shape(a: Sequence, b: Sequence) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


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
        if _holds(out, dtype(origin)):
            return True
        if not (is_float_cast(origin) and _holds(dtype(origin), dtype(origin.args[0]))):
            return False
        origin = origin.args[0]


def input_problem(fake_mode, check, *args) -> Optional[str]:
    """The message of the fused op's own input ``check`` (a SPEC constraint it breaks) on the
    values of ``args`` (nodes, None or plain values), under the graph's fake mode; None if none."""
    values = [val(a) if isinstance(a, fx.Node) else a for a in args]
    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            check(*values)
    except FusedOpInputError as exc:
        return str(exc)
    return None


def rounding_problem(ev: "MemoEvaluator", nodes: Iterable[fx.Node], roles: Iterable[fx.Node]) -> Optional[str]:
    """Why a site cannot fuse because the program rounds a value inside it more coarsely than
    any of its inputs is stored (``x.to(bf16)`` in a float32 program), which the fused op
    would not do; None when every such cast is to a dtype an input already has (a bf16 or
    fp16 model rounds to its own dtype everywhere: that is its precision, not a step)."""
    stored = {native_dtype(n, ev.provenance) for n in roles if n is not None}
    coarse = sorted({str(d) for n in nodes if n is not None for d in ev.rounded_inside(n)
                     if not any(_holds(d, s) for s in stored)})
    if coarse:
        return (f"the program rounds a value inside the site to {', '.join(coarse)} (a narrowing cast) "
                f"more coarsely than its inputs are stored; the fused op would not round it")
    return None


def native_dtype(node: fx.Node, provenance: Optional["Provenance"] = None) -> torch.dtype:
    """The dtype a value was stored in before a widening cast (a bf16 activation upcast to
    float32 and saved for the backward is bf16 data)."""
    definition = node
    if node.op == "placeholder" and provenance is not None:
        definition = provenance.forward_definition(node) or node
    while is_float_cast(definition) and is_value_preserving_cast(definition):
        definition = definition.args[0]
    return dtype(definition) if dtype(definition) is not None else dtype(node)


def replacement_of(graph: fx.Graph, fake_mode, result: fx.Node, old: fx.Node) -> fx.Node:
    """What replaces output ``old``: a fused op's ``result``, cast as the program casts the
    value it computes on its way to ``old`` (the float casts ending at ``old``), so every
    rounding the program does there happens here too; in ``old``'s shape."""
    chain = []
    while is_float_cast(old):
        chain.append(old)
        old = old.args[0]
    matched = old
    dtypes = [dtype(matched)] + [dtype(c) for c in reversed(chain)]
    precision = dtype(result)
    for d in dtypes[:-1]:  # keep the casts that round; widening ones change no value
        if not _holds(d, precision):
            result, precision = cast(graph, fake_mode, result, d), d
    result = cast(graph, fake_mode, result, dtypes[-1])
    target = chain[0] if chain else matched
    if not same_shape(shape(result), shape(target)):
        result = call(graph, fake_mode, aten.view.default, (result, list(shape(target))))
    return result


def is_float_cast(node: fx.Node) -> bool:
    """Casts between float dtypes, copies and aliases: the identity in real arithmetic, up
    to the rounding of a narrowing cast."""
    if node.op != "call_function" or node.target not in CAST_TARGETS:
        return False
    src, out = node.args[0] if node.args else None, node
    if not isinstance(src, fx.Node) or dtype(src) is None or dtype(out) is None:
        return False
    if node.target is aten._to_copy.default:
        extra = set(node.kwargs) - {"dtype", "layout", "device", "memory_format", "non_blocking"}
        if extra or (val(src).device != val(out).device):
            return False
    if dtype(src).is_complex or dtype(out).is_complex:
        return dtype(src) == dtype(out)
    return dtype(src).is_floating_point and dtype(out).is_floating_point


def _holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Every value of float dtype ``narrow`` is a value of ``wide``."""
    w, n = torch.finfo(wide), torch.finfo(narrow)
    return wide == narrow or (w.bits >= n.bits and w.eps <= n.eps and w.max >= n.max and w.tiny <= n.tiny)


def exact_common_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The narrowest float dtype that holds every operand exactly: one of them when it holds
    the others, else float32 (float16 and bfloat16 each hold only part of the other), so a
    fused op never rounds data through a dtype the program did not use for it."""
    dtypes = set(dtypes)
    for candidate in sorted(dtypes | {torch.float32, torch.float64}, key=lambda t: torch.finfo(t).bits):
        if all(_holds(candidate, d) for d in dtypes):
            return candidate
    raise Unsupported(f"no float dtype holds {sorted(map(str, dtypes))}")


class Provenance:
    """What a backward graph's saved-tensor placeholders were in the forward graph.

    AOTAutograd's partitioners give each saved tensor's backward placeholder the
    name of the forward node that produced it. Looking through those forward
    definitions (an alias, a cast, ``rotate_half(q)``) lets a matcher prove that a
    saved tensor equals an expression of other saved tensors.
    """

    def __init__(self, forward: Optional[fx.Graph], backward: fx.Graph):
        self.forward = forward
        self._fw_by_name: Dict[str, fx.Node] = {}
        self._bw_by_name: Dict[str, fx.Node] = {}
        self._representatives: Optional[Dict[fx.Node, fx.Node]] = None
        if forward is None:
            return
        outputs = set()
        for node in forward.nodes:
            if node.op == "output":
                outputs = {a for a in node.args[0] if isinstance(a, fx.Node)}
        bw_placeholders = {n.name: n for n in backward.nodes if n.op == "placeholder"}
        for node in forward.nodes:
            bw = bw_placeholders.get(node.name)
            if bw is None or not (node in outputs or node.op == "placeholder"):
                continue
            fv, bv = val(node), val(bw)
            if fv is None or bv is None or fv.dtype != bv.dtype or len(fv.shape) != len(bv.shape):
                continue
            self._fw_by_name[node.name] = node
            self._bw_by_name[node.name] = bw

    def forward_definition(self, bw_placeholder: fx.Node) -> Optional[fx.Node]:
        fw = self._fw_by_name.get(bw_placeholder.name)
        return fw if fw is not None and fw.op == "call_function" else None

    def saved_in_backward(self, fw_node: fx.Node) -> Optional[fx.Node]:
        bw = self._bw_by_name.get(fw_node.name)
        return bw if bw is not None and self._fw_by_name.get(fw_node.name) is fw_node else None

    def is_forward(self, node: fx.Node) -> bool:
        return self.forward is not None and node.graph is self.forward

    def same_saved_value(self, bw_placeholder: fx.Node) -> fx.Node:
        """The first saved tensor whose forward definition is the same expression of the same
        forward inputs as this one's, else itself. The forward often computes one table twice
        (``cache[..., 0]`` written in two products) and the partitioner saves both copies;
        deterministic ops on the same inputs give the same values, so both are one leaf."""
        if self._representatives is None:
            self._representatives, first = {}, {}
            memo, interned = {}, {}  # shared: each forward node is keyed once
            for name, bw in self._bw_by_name.items():
                key = _expression_key(self._fw_by_name[name], memo, interned)
                self._representatives[bw] = first.setdefault(key, bw) if key is not None else bw
        return self._representatives.get(bw_placeholder, bw_placeholder)


def _expression_key(node: fx.Node, memo: Dict[fx.Node, Any], interned: Dict[tuple, int]):
    """An id of a forward node's expression, equal for nodes that compute the same values from
    the same graph inputs; None for a random or impure op anywhere in it. Expressions are
    interned (an op and the ids of its arguments), so a key stays small however deep it is;
    nodes are keyed in graph order, inputs first, so no recursion runs as deep as the graph."""
    for n in sorted(_unkeyed_ancestors(node, memo)):  # fx.Node orders by position in the graph
        if n.op == "placeholder":
            key = ("input", n.name)
        elif n.op == "call_function" and not n.is_impure() and \
                torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()):
            parts = [_argument_key(a, memo) for a in (n.args, tuple(sorted(n.kwargs.items())))]
            key = None if any(p is None for p in parts) else (str(n.target), *parts)
        else:
            key = None
        memo[n] = None if key is None else interned.setdefault(key, len(interned))
    return memo[node]


def _unkeyed_ancestors(node: fx.Node, memo) -> List[fx.Node]:
    """The node and its ancestors not keyed yet (a keyed node's ancestors are keyed too)."""
    if node in memo:
        return []
    seen, stack = {node}, [node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen and a not in memo:
                seen.add(a)
                stack.append(a)
    return list(seen)


def _argument_key(arg, memo):
    if isinstance(arg, fx.Node):
        return memo.get(arg)
    if isinstance(arg, (list, tuple)):
        parts = tuple(_argument_key(a, memo) for a in arg)
        return None if any(p is None for p in parts) else parts
    if isinstance(arg, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                        torch.memory_format)):
        return (type(arg).__name__, arg)
    return None


class MemoEvaluator:
    """Memoized abstract interpretation of graph nodes; what cannot be interpreted is a leaf.

    Subclasses give ``_interpret(node, forward)`` (raise :class:`Unsupported` to make the
    node a leaf) and ``_leaf(node)``. A backward placeholder whose forward definition is
    known (``provenance``) is interpreted through that definition, where forward nodes
    saved for the backward stand for their backward placeholders; ``forward`` tells
    ``_interpret`` that it is looking at a forward node.
    """

    def __init__(self, provenance: Optional[Provenance] = None, forced_leaves=()):
        self.provenance = provenance
        self.forced_leaves = set(forced_leaves)
        self.memo: Dict[fx.Node, Any] = {}
        self.interpreted: set = set()
        #: (node, exception) of evaluator failures other than Unsupported: each costs only
        #: its node, which stays opaque (a leaf), and is reported as a miss by the caller
        self.errors: List[tuple] = []
        #: why a node the evaluator could not read is opaque (the nearest difference a miss names)
        self.unsupported: Dict[fx.Node, str] = {}
        #: the dtypes each value was rounded to by narrowing casts the evaluation saw through
        #: (casts are identities of real arithmetic; a site rounded inside more coarsely than
        #: its inputs are stored is refused, see :func:`rounding_problem`)
        self.rounded: Dict[fx.Node, frozenset] = {}
        #: :func:`gradient_dependent` of the graph (None: not known, every node may be)
        self.gradient_nodes: Optional[set] = None

    def depends_on_gradient(self, node: fx.Node) -> bool:
        return self.gradient_nodes is None or node in self.gradient_nodes

    def _is_forward(self, node) -> bool:
        return self.provenance is not None and self.provenance.is_forward(node)

    def value(self, node):
        if node in self.memo:
            return self.memo[node]
        self.memo[node] = None  # cycle guard; graphs are DAGs
        result = None
        if self._is_forward(node):
            saved = self.provenance.saved_in_backward(node)
            if saved is not None:
                self.memo[node] = result = self.value(saved)
                self.rounded[node] = self.rounded.get(saved, frozenset())
                return result
        if node not in self.forced_leaves:
            definition = node
            if node.op == "placeholder" and self.provenance is not None:
                definition = self.provenance.forward_definition(node)
            if definition is not None and definition.op == "call_function":
                try:
                    result = self._interpret(definition, forward=definition is not node or self._is_forward(node))
                    if definition is node:
                        self.interpreted.add(node)
                    if result is not None:
                        self.rounded[node] = self._rounding(definition)
                except Unsupported as exc:
                    result = None
                    if self._is_forward(node):
                        raise
                    self.unsupported[node] = str(exc)
                except Exception as exc:  # an evaluator bug: this node stays opaque, which is sound
                    self.errors.append((node, exc))
                    result = None
                    if self._is_forward(node):
                        raise Unsupported("evaluation failed") from exc
        if result is None:
            result = self._leaf(node)
        self.memo[node] = result
        return result

    def _rounding(self, definition: fx.Node) -> frozenset:
        """The dtypes a value was rounded to on its way, by narrowing casts seen through."""
        out = frozenset().union(*(self.rounded.get(a, frozenset()) for a in definition.all_input_nodes))
        if is_float_cast(definition) and not is_value_preserving_cast(definition):
            out |= {dtype(definition)}
        return out

    def rounded_inside(self, node: fx.Node) -> frozenset:
        """:meth:`_rounding` of a site's output, not counting its own trailing casts (the fused
        op's result is cast the same way)."""
        while is_float_cast(node):
            node = node.args[0]
        return self.rounded.get(node, frozenset())

    def _interpret(self, node: fx.Node, forward: bool):
        raise NotImplementedError

    def _leaf(self, node: fx.Node):
        raise NotImplementedError


@dataclasses.dataclass
class Miss:
    """A subgraph that looked like a fusable backward but was left as it was."""
    op: str
    node: str
    reason: str


@dataclasses.dataclass
class Site:
    """A rewritten subgraph: which nodes it replaced and with what."""
    op: str
    mode: Optional[str]
    outputs: Dict[str, str]
    inputs: Dict[str, str]
    replaced_nodes: List[str]
    replaced_targets: Dict[str, int]
    #: modelled memory traffic in bytes (each non-view node reads its inputs and writes
    #: its output): of the replaced subgraph, of what replaced it, and the fused op's
    #: minimum (each input read once, each output written once)
    bytes_before: int = 0
    bytes_after: int = 0
    bytes_minimum: int = 0


def fake_mode_of(graph: fx.Graph):
    for node in graph.nodes:
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode"):
            return v.fake_mode
    return None


def call(graph: fx.Graph, fake_mode, target, args, kwargs=None, value=None) -> fx.Node:
    """Insert a call (at the graph's current insertion point) with its fake value:
    ``value`` when the caller knows it (the node replaces one it equals), else computed."""
    kwargs = kwargs or {}
    node = graph.call_function(target, tuple(args), kwargs)
    _created(node)
    if value is not None:
        node.meta["val"] = value
        return node
    meta_args, meta_kwargs = fx.node.map_arg((tuple(args), kwargs), lambda n: n.meta.get("val"))
    if fake_mode is None:
        value = target(*meta_args, **meta_kwargs)
    else:
        value = _static_fake_value(fake_mode, target, meta_args, meta_kwargs)
        if value is None:
            with fake_mode:
                value = target(*meta_args, **meta_kwargs)
    node.meta["val"] = value
    return node


def _static_fake_value(fake_mode, target, args, kwargs):
    """The fake value of ``target(*args, **kwargs)`` from its meta kernel, or None.

    FakeTensorMode's dispatch costs ~0.1-0.5 ms a call, most of it bookkeeping that
    only symbolic shapes need. With static shapes, running the op's meta kernel on
    meta tensors of the same geometry and wrapping the results gives the same
    shapes, strides and dtypes for a tenth of that. Anything else (symbolic sizes,
    an explicit device, an op without a meta kernel) goes through the fake mode.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    if "device" in kwargs:
        return None
    devices = []

    def to_meta(v):
        if not isinstance(v, torch.Tensor):
            return v
        if not (isinstance(v, FakeTensor) and v.fake_mode is fake_mode and v.storage_offset() == 0
                and all(type(x) is int for x in (*v.shape, *v.stride()))):
            raise Unsupported("not a static fake tensor")
        devices.append(v.device)
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")

    def convert(v):  # op arguments nest tensors in lists at most (cat, stack)
        return type(v)(to_meta(x) for x in v) if isinstance(v, (list, tuple)) else to_meta(v)

    try:
        with outside_fake_mode():  # torch 2.6 and 2.7 call backward compilers inside the fake mode
            meta_args = tuple(convert(a) for a in args)
            meta_kwargs = {k: convert(v) for k, v in kwargs.items()}
            if not devices:
                return None
            out = target(*meta_args, **meta_kwargs)
    except Exception:  # the fake mode decides: it has decompositions and fallbacks
        return None
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not all(isinstance(o, torch.Tensor) and o.device.type == "meta" for o in outs):
        return None
    fakes = [FakeTensor(fake_mode, o, devices[0]) for o in outs]
    return type(out)(fakes) if isinstance(out, (tuple, list)) else fakes[0]


def getitem(graph, fake_mode, node, index) -> fx.Node:
    item = graph.call_function(operator.getitem, (node, index))
    _created(item)
    item.meta["val"] = node.meta["val"][index]
    return item


def cast(graph, fake_mode, node: fx.Node, to: torch.dtype) -> fx.Node:
    if dtype(node) == to:
        return node
    return call(graph, fake_mode, aten._to_copy.default, (node,), {"dtype": to})


class Insertion:
    """Insert nodes right after ``anchor``, remembering which ones were inserted."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node):
        self.graph, self.anchor, self.stop = graph, anchor, anchor.next
        self._context = graph.inserting_before(self.stop)

    def __enter__(self):
        self._context.__enter__()
        return self

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)

    def nodes(self) -> List[fx.Node]:
        out, node = [], self.anchor.next
        while node is not self.stop:
            out.append(node)
            node = node.next
        return out


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
    """
    found = {n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")}
    if not found:
        return None
    for node in graph.nodes:
        if node.op != "placeholder" and any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def outside_users(region: List[fx.Node], outputs: Iterable[fx.Node]) -> List[fx.Node]:
    """Interior nodes (not outputs) used by nodes outside the region."""
    inside, outs = set(region), set(outputs)
    return [n for n in region if n not in outs and any(u not in inside for u in n.users)]


def erase_dead(graph: fx.Graph, nodes: Iterable[fx.Node]) -> List[fx.Node]:
    """Erase the given nodes that no longer have users, users first."""
    erased = []
    for node in sorted({n for n in nodes if not n._erased}, reverse=True):  # users before what they use
        if not node.users and node.op == "call_function":
            graph.erase_node(node)
            erased.append(node)
    return erased


@functools.lru_cache(maxsize=None)
def target_name(target: Any) -> str:
    return getattr(target, "__name__", str(target))


VIEW_TARGETS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
    aten.slice.Tensor, aten.select.int, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.unsqueeze.default, aten.t.default, aten.transpose.int, aten.permute.default, aten.alias.default,
    aten.detach.default, aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default, operator.getitem,
}


def tensor_bytes(value) -> int:
    """Bytes of a tensor (or a tuple of them), symbolic sizes at their example values."""
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    if not isinstance(value, torch.Tensor):
        return 0
    numel = value.numel()
    if type(numel) is int:
        return numel * value.element_size()
    numel = 1
    for size in value.shape:
        numel *= int(size.node.hint) if isinstance(size, torch.SymInt) and size.node.hint is not None else int(size)
    return numel * value.element_size()


def node_traffic(node: fx.Node) -> int:
    if node.op != "call_function" or node.target in VIEW_TARGETS:
        return 0
    reads = sum(tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    return reads + tensor_bytes(node.meta.get("val"))


def commit(graph: fx.Graph, op: str, mode: Optional[str], region: List[fx.Node], outputs: Dict[str, fx.Node],
           replacements: Dict[fx.Node, fx.Node], inputs: Dict[str, fx.Node], added: List[fx.Node],
           fused: fx.Node) -> Site:
    """Swap the replaced outputs for their new values, erase the dead region, describe it
    (``outputs``: the fused op's output names and the nodes they replace)."""
    counts: Dict[str, int] = {}
    for n in region:
        counts[target_name(n.target)] = counts.get(target_name(n.target), 0) + 1
    site = Site(op, mode, outputs={name: old.name for name, old in outputs.items()},
                inputs={k: v.name for k, v in inputs.items() if v is not None},
                replaced_nodes=[n.name for n in region], replaced_targets=counts,
                bytes_before=sum(node_traffic(n) for n in region),
                bytes_after=sum(node_traffic(n) for n in added), bytes_minimum=node_traffic(fused))
    if _OPEN:  # from here on the graph changes: a failure can no longer be undone per site
        _OPEN[-1].committed = True
        _OPEN[-1].replacements = replacements
    for old, new in replacements.items():
        old.replace_all_uses_with(new)
    inputs = {a for n in region for a in n.all_input_nodes}
    erase_dead(graph, region)
    erase_unused_upstream(graph, inputs)
    return site


def erase_unused_upstream(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """Erase the pure calls among ``nodes`` left without users, and then theirs: forward
    values a replaced subgraph alone had recomputed."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node._erased or node.users or node.op != "call_function" or node.is_impure():
            continue
        stack.extend(node.all_input_nodes)
        graph.erase_node(node)


# -- one transaction per candidate --------------------------------------------

@dataclasses.dataclass
class Transaction:
    """The nodes one candidate's rewrite inserted, and whether it began to rewire the graph."""
    nodes: List[fx.Node] = dataclasses.field(default_factory=list)
    committed: bool = False
    replacements: Dict[fx.Node, fx.Node] = dataclasses.field(default_factory=dict)


_OPEN: List[Transaction] = []  # the transactions in progress, innermost last


def _created(node: fx.Node) -> None:
    if _OPEN:
        _OPEN[-1].nodes.append(node)


class Rewrites:
    """One pattern's sites and misses in one graph; each candidate is its own transaction.

    Examining a candidate (:meth:`examine`, :meth:`evaluated`) or rewriting it
    (:meth:`rewrite`) may fail with any exception; that costs the candidate only: it
    becomes a miss whose reason is the error, the nodes its rewrite had inserted are
    erased, the other sites still fuse, and later rounds leave it alone. With
    ``strict`` the error is raised instead, and so is one that happens after the graph
    began to be rewired (the pass manager's whole-graph snapshot then puts it back).

    The pass runs the patterns in rounds until nothing new fuses (a site whose dy is
    another site's dx fuses once that one is a fused op): sites accumulate over the
    rounds, misses are the last round's plus every internal error.
    """

    def __init__(self, graph: fx.Graph, op: str, strict: bool = False):
        self.graph, self.op, self.strict = graph, op, strict
        self.fake_mode = fake_mode_of(graph)
        self.sites: List[Site] = []
        self.round_misses: List[Miss] = []
        #: candidates this round left undecided because they build on a site it matched
        self.pending = 0
        self.errors: List[Miss] = []
        self._failed: set = set()  # names of the nodes whose candidates failed
        self._replaced: Dict[fx.Node, fx.Node] = {}

    @property
    def misses(self) -> List[Miss]:
        return self.errors + self.round_misses

    def begin_round(self) -> None:
        self.round_misses, self.pending = [], 0

    def current(self, node: Optional[fx.Node]) -> Optional[fx.Node]:
        """The node that now holds ``node``'s value (an earlier rewrite may have replaced it)."""
        while node in self._replaced:
            node = self._replaced[node]
        return node

    def _failed_at(self, node, exc: Exception) -> None:
        name = getattr(node, "name", str(node))
        reason = f"internal error, candidate left unfused: {type(exc).__name__}: {exc}"
        log.warning("npu_fusion: %s at %s: %s", self.op, name, reason, exc_info=exc)
        self._failed.add(name)
        self.errors.append(Miss(self.op, name, reason))

    def examine(self, node: fx.Node, fn, *args):
        """``fn(*args)``, or None (a recorded miss) if it raises."""
        if getattr(node, "name", None) in self._failed:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            if self.strict:
                raise
            self._failed_at(node, exc)
            return None

    def evaluated(self, ev: "MemoEvaluator") -> None:
        """Report the nodes an evaluator could not evaluate (they stayed opaque leaves)."""
        errors, ev.errors = ev.errors, []
        for node, exc in errors:
            if self.strict:
                raise exc
            if node.name not in self._failed:
                self._failed_at(node, exc)

    def rewrite(self, node: fx.Node, fn, *args) -> None:
        """Run ``fn(*args)``, which returns a :class:`Site` (committed) or a :class:`Miss`."""
        if node.name in self._failed:
            return
        tx = Transaction()
        _OPEN.append(tx)
        try:
            done = fn(*args)
        except Exception as exc:
            if self.strict or tx.committed:
                raise
            erase_dead(self.graph, tx.nodes)  # nothing outside them uses them yet
            self._failed_at(node, exc)
            return
        finally:
            _OPEN.pop()
        if isinstance(done, Miss):
            erase_dead(self.graph, tx.nodes)
            self.round_misses.append(done)
        else:
            self.sites.append(done)
            self._replaced.update(tx.replacements)
