"""The method both matchers build on: memoized abstract interpretation of a backward
graph, seeing through saved tensors to their forward definitions.

:class:`MemoEvaluator` evaluates each node once into a value of the matcher's abstract
domain (RoPE: exact per-position polynomials, :mod:`.lanes`; RMSNorm: symbolic
expressions, :mod:`.algebra`); a node outside the domain raises :class:`Unsupported`
and becomes a leaf, an input of whatever the matcher proves. :class:`Provenance`
maps a backward graph's saved-tensor placeholders to the forward nodes that computed
them, so a saved ``rotate_half(q)`` is read as that expression of q, and copies of
one forward expression are one value. Casts are identities of real arithmetic: the
evaluator sees through them and remembers which ones rounded
(:func:`rounding_problem`).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

import torch
import torch.fx as fx

from .nodes import dtype, holds, is_float_cast, is_value_preserving_cast, native_dtype, val


class Unsupported(Exception):
    """A node is outside the abstract domain: the evaluator treats it as a leaf."""

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

    def stands_for_saved(self, node: fx.Node) -> bool:
        """Whether ``node`` stands for a saved forward value (a backward placeholder), read through
        :meth:`forward_definition` as a forward value rather than as a backward node."""
        return node.op == "placeholder"

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

class JointProvenance(Provenance):
    """A joint graph (forward and backward in one graph) read as its partition would be, with
    exact widening casts looked through.

    ``backward`` are the joint graph's backward nodes. A forward value a backward node reads
    is a value the partition saves: it stands for itself as a saved tensor does (read as a
    forward definition is, a leaf where it cannot be read). So does the source of an exact
    widening cast that is saved (an HF-style norm's ``x`` under its float32 upcast): a fused op
    reads x in its own dtype, and the partitioner then saves x instead of the upcast. The other
    forward values are the forward graph's (:meth:`is_forward`): read only through the saved
    values they feed, as in a backward graph with its forward graph.
    """

    def __init__(self, graph: fx.Graph, backward: Iterable[fx.Node]):
        super().__init__(None, graph)
        backward = set(backward)
        self._interior: set = set()
        saved = [n for n in graph.nodes if n not in backward and n.op != "output"
                 and not n.name.startswith("tangents") and any(u in backward for u in n.users)]
        for node in saved:
            while True:
                if val(node) is not None:
                    self._fw_by_name[node.name] = self._bw_by_name[node.name] = node
                if not (is_float_cast(node) and is_value_preserving_cast(node)):
                    break
                node = node.args[0]
        for node in graph.nodes:
            if node not in backward and node.op != "output" and node.name not in self._fw_by_name \
                    and not node.name.startswith("tangents"):
                self._interior.add(node)

    def stands_for_saved(self, node: fx.Node) -> bool:
        return self._fw_by_name.get(node.name) is node or node.op == "placeholder"

    def is_forward(self, node: fx.Node) -> bool:
        return node in self._interior

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
        self._depth = 0  # nesting of value() calls
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
        if not self._depth and self._is_forward(node):
            # a forward value no backward node reads, asked for directly (a joint graph's; a
            # backward graph has none): read only through the saved values it feeds
            return None
        self._depth += 1
        try:
            return self._value(node)
        finally:
            self._depth -= 1

    def _value(self, node):
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
            saved = self.provenance is not None and self.provenance.stands_for_saved(node)
            definition = self.provenance.forward_definition(node) if saved else node
            if definition is not None and definition.op == "call_function":
                try:
                    result = self._interpret(definition, forward=saved or self._is_forward(node))
                    if not saved:
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

def rounding_problem(ev: "MemoEvaluator", nodes: Iterable[fx.Node], roles: Iterable[fx.Node]) -> Optional[str]:
    """Why a site cannot fuse because the program rounds a value inside it more coarsely than
    any of its inputs is stored (``x.to(bf16)`` in a float32 program), which the fused op
    would not do; None when every such cast is to a dtype an input already has (a bf16 or
    fp16 model rounds to its own dtype everywhere: that is its precision, not a step)."""
    stored = {native_dtype(n, ev.provenance) for n in roles if n is not None}
    coarse = sorted({str(d) for n in nodes if n is not None for d in ev.rounded_inside(n)
                     if not any(holds(d, s) for s in stored)})
    if coarse:
        return (f"the program rounds a value inside the site to {', '.join(coarse)} (a narrowing cast) "
                f"more coarsely than its inputs are stored; the fused op would not round it")
    return None
