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

import operator
from typing import Any, Dict, Iterable, List, Mapping, Optional

import torch
import torch.fx as fx

from .nodes import dtype, holds, is_float_cast, is_value_preserving_cast, val


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
            memo, interned, impure = {}, {}, {}  # shared: each forward node (and op's purity) is keyed once
            for name, bw in self._bw_by_name.items():
                key = _expression_key(self._fw_by_name[name], memo, interned, impure)
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

    def __init__(self, graph: fx.Graph, backward: Iterable[fx.Node], min_cut: bool = False):
        super().__init__(None, graph)
        #: whether min-cut partitions the graph (it recomputes cheap forward values in the backward)
        self.min_cut = min_cut
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

class InferenceProvenance(JointProvenance):
    """An inference graph (AOTAutograd's graph when nothing needs a gradient) read as a joint graph
    with no backward: every node a forward one, none saved. The forward rules fuse there unpaired,
    and what no form matches is found by its own shape, with no backward to pair it with."""

    def __init__(self, graph: fx.Graph):
        super().__init__(graph, ())


class PartitionedForwardProvenance(InferenceProvenance):
    """A training forward graph after the partition (torchair's hook), read as an inference graph whose outputs the backward reads.

    A training forward graph after the partition (torchair's hook sees no joint graph), read as an
    inference graph whose saved outputs are a contract with a backward compiled later: the graph's
    output node returns them. A fused op's output takes a saved value's place only where it equals
    it (a norm's y and rstd), and an intermediate the forward saves stays computed, reading the fused
    op's outputs (:func:`saved_by_the_forward`); the backward is fused against the forward as it was
    before the pass (the pass manager keeps that copy for it)."""


def saved_by_the_forward(provenance, node: fx.Node) -> bool:
    """Whether ``node`` is the output node of a partitioned training forward graph: a reader that saves what it reads for the backward."""
    return isinstance(provenance, PartitionedForwardProvenance) and node.op == "output"


def _expression_key(node: fx.Node, memo: Dict[fx.Node, Any], interned: Dict[tuple, int],
                    impure: Optional[Dict[Any, bool]] = None):
    """An id of a forward node's expression, equal for nodes that compute the same values from
    the same graph inputs; None for a random or impure op anywhere in it. Expressions are
    interned (an op and the ids of its arguments), so a key stays small however deep it is;
    nodes are keyed in graph order, inputs first, so no recursion runs as deep as the graph.
    ``impure`` remembers each op overload's purity (its schema's, the same for every call)."""
    impure = {} if impure is None else impure
    for n in sorted(_unkeyed_ancestors(node, memo)):  # fx.Node orders by position in the graph
        if n.op == "placeholder":
            key = ("input", n.name)
        elif n.op == "call_function" and not _is_impure(n, impure) and \
                torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()):
            parts = [_argument_key(a, memo) for a in (n.args, tuple(sorted(n.kwargs.items())))]
            # the op itself, not its printed name: one op is one object, and printing one is slow
            key = None if any(p is None for p in parts) else (n.target, *parts)
        else:
            key = None
        memo[n] = None if key is None else interned.setdefault(key, len(interned))
    return memo[node]

def _is_impure(node: fx.Node, known: Dict[Any, bool]) -> bool:
    """``node.is_impure()``, remembered per op overload: an overload's purity is its schema's and its
    registered effects', whatever the arguments (only higher-order ops read those)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return node.is_impure()
    if target not in known:
        known[target] = node.is_impure()
    return known[target]

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
        #: the program keeps its result is refused, see :func:`rounding_problem`)
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
        memo = self.memo
        if node in memo:  # evaluated already (what _value answers first)
            return memo[node]
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
        is_forward = self._is_forward(node)
        if is_forward:
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
                    result = self._interpret(definition, forward=saved or is_forward)
                    if not saved:
                        self.interpreted.add(node)
                    if result is not None:
                        self.rounded[node] = self._rounding(definition)
                except Unsupported as exc:
                    result = None
                    if is_forward:
                        raise
                    self.unsupported[node] = str(exc)
                except Exception as exc:  # an evaluator bug: this node stays opaque, which is sound
                    self.errors.append((node, exc))
                    result = None
                    if is_forward:
                        raise Unsupported("evaluation failed") from exc
        if result is None:
            result = self._leaf(node)
        self.memo[node] = result
        return result

    def _rounding(self, definition: fx.Node) -> frozenset:
        """The dtypes a value was rounded to on its way, by narrowing casts seen through.

        A piece of a split, chunk or unbind is read from the parent's own arguments, which the
        domain evaluates in the parent's stead: the parent's rounding is theirs, recorded for it
        here so that the roundings above the split count (and :meth:`roundings_inside` walks
        through it)."""
        if definition.target is operator.getitem:
            for parent in definition.all_input_nodes:
                if parent not in self.rounded and parent.op == "call_function":
                    self.rounded[parent] = self._rounding(parent)
        out = frozenset().union(*(self.rounded.get(a, frozenset()) for a in definition.all_input_nodes))
        if is_float_cast(definition) and not is_value_preserving_cast(definition):
            out |= {dtype(definition)}
        return out

    def roundings_inside(self, output: fx.Node, roles: Iterable[fx.Node]):
        """What the program rounds between a site's ``output`` and the values the fused op reads.

        What the program rounds between a site's ``output`` and its ``roles`` (the values the
        fused op reads), not counting the output's own trailing casts (the fused op's result is
        cast the same way) nor any rounding that made a role's value (the fused op reads that
        value as it is): the dtypes of the narrowing casts the evaluation saw through, and the
        nodes the site reads that are a role's value rounded otherwise than the role, each with
        the dtypes of the roundings they differ by (a rounded copy of x bound to the unrounded x
        because the two are equal up to casts, or the unrounded table read beside the rounded
        copy bound to the table, as a rotation reading cos exactly on half of its lanes and
        ``cos.to(bf16)`` on the other half: the fused op would read one copy everywhere)."""
        while is_float_cast(output):
            output = output.args[0]
        roles = list(roles)
        role_values = [(self.memo[r], self.rounded.get(r, frozenset())) for r in roles if self.memo.get(r) is not None]
        stop, seen, stack, found, rounded_roles = set(roles), set(), [output], set(), []
        while stack:
            node = stack.pop()
            if node in seen or node in stop:
                continue
            seen.add(node)
            value, rounded = self.memo.get(node), self.rounded.get(node, frozenset())
            # the roundings compared first: equal values (polynomials, expressions) cost more to compare
            differ = next((rounded ^ r for v, r in role_values if value is not None and rounded != r and v == value),
                          None)
            if differ:
                rounded_roles.append((node, differ))
            if node not in self.rounded:  # a leaf: not interpreted
                continue
            saved = self.provenance.saved_in_backward(node) if self._is_forward(node) else None
            if saved is not None:  # a forward value the backward reads as a saved tensor
                stack.append(saved)
                continue
            definition = node
            if node.op == "placeholder" and self.provenance is not None:
                definition = self.provenance.forward_definition(node)
            if definition is None or definition.op != "call_function":
                continue
            if is_float_cast(definition) and not is_value_preserving_cast(definition):
                found.add(dtype(definition))
            stack.extend(definition.all_input_nodes)
        return found, rounded_roles

    def _interpret(self, node: fx.Node, forward: bool):
        raise NotImplementedError

    def _leaf(self, node: fx.Node):
        raise NotImplementedError

def kept_precision(output: fx.Node) -> torch.dtype:
    """The precision at which the program keeps the value a site replaces: the dtype of the
    first narrowing cast among the float casts that end at ``output`` (the program's own next
    rounding of the value), else the dtype the value is computed in."""
    chain = []
    while is_float_cast(output):
        chain.append(dtype(output))
        output = output.args[0]
    precision = dtype(output)
    for d in reversed(chain):
        if not holds(d, precision):
            return d
    return precision

def rounding_problem(ev: "MemoEvaluator", outputs: Mapping[str, fx.Node], roles: Iterable[fx.Node]) -> Optional[str]:
    """Why a site cannot fuse because the program rounds inside it more coarsely than it keeps
    a value the site replaces; None when it does not.

    The fused op computes each output exactly (in a dtype that holds its operands and the
    output's :func:`kept_precision` R) and rounds it once to R. A value the program stores
    in R is best rounded once from the exact result: nearest rounding gives the closest
    value of R, so roundings inside to a dtype D that holds R (autocast rounding each term to
    the bf16 gradient it forms, a bf16 model rounding to its own dtype) cost nothing to drop.
    A rounding coarser than R (``dy.to(bf16)`` inside a float32 program; a round trip
    through fp8 to simulate quantization) is the program's own step, which the fused op would
    not take: the site stays unfused. Each output is judged by its own precision, never
    excused because another role is stored in the narrow dtype. Nor may the fused op read an
    input less rounded than the program does (a rounded copy of x bound to the unrounded x,
    which it equals up to casts), which changes the function, not only its arithmetic, unless
    the rounding is to the dtype of the gradient the site processes (tables cast to the
    activations' dtype, ``cos.to(x.dtype)``: the program's working precision). ``roles``
    come dy first."""
    roles = list(roles)
    gradient = dtype(roles[0])  # dy's: the precision the program processes the gradient in
    roles = [n for n in roles if n is not None]
    for name, output in outputs.items():
        if output is None:
            continue
        kept = kept_precision(output)
        found, rounded_roles = ev.roundings_inside(output, roles)
        coarse = sorted(str(d) for d in found if not holds(d, kept))
        if coarse:
            return (f"the program rounds a value inside the site to {', '.join(coarse)} (a narrowing cast), "
                    f"more coarsely than it keeps {name} ({output.name}, {kept}); the fused op would not "
                    f"round it")
        # a table rounded to the gradient's own dtype (``cos.to(x.dtype)``) is the program's
        # working precision; a rounding coarser than that makes another input
        coarser = [n for n, dtypes in rounded_roles if not all(holds(d, gradient) for d in dtypes)]
        if coarser:
            return (f"the site reads {coarser[0].name}, a copy of one of its inputs rounded otherwise than the copy "
                    f"the fused op would read, by a rounding coarser than its gradient ({gradient}): the fused op "
                    f"would read one copy where the program reads both")
    return None
