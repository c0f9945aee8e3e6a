"""Fusing on AOTAutograd's joint graph, before the partition.

The joint graph holds the forward and the backward in one graph: ``primals_*`` and
``tangents_*`` placeholders, forward nodes first, then the backward. The rules already read
any node that does not depend on a tangent as a forward value, an input of a site (the
min-cut partitioner and activation checkpointing recompute forward values inside backward
graphs), so they find their sites in a joint graph as in a backward one. Fusing there lets
the partitioner, default or min-cut, see the fused ops and save what they read (x in its own
dtype, rstd, the tables) instead of what the unfused backward read (an HF-style norm's
float32 upcast of x).

Two things the partitioners need from the graph the pass leaves them:

* **Placement.** The default partitioner takes every node before the last forward node as a
  forward node, by position. A rule inserts its nodes after the last of their inputs, which in
  a joint graph can be a forward node (a norm whose dy is a tangent). Every node a backward
  rule inserted is backward work (it replaces backward nodes or prepares their operands), so it
  is tagged ``is_backward`` and, where it landed among the forward nodes, moved after them.
  Inserted nodes carry no activation-checkpointing tag, like the backward nodes they replace.
  A forward rule's nodes (the fused forward ops) come tagged ``is_forward`` with the tags of
  the forward node they replace, and stay where they are.
* **Legality.** A tensor the caller can reach (a graph input, a returned tensor, a view of
  either) may be updated in place by the caller between forward and backward; that is legal
  when the program saved a copy and raises when it saved the tensor itself, or any view of its
  storage (views share one version counter). So a caller-reachable storage is read by the
  backward after the pass only where the unfused backward read it too. Every backward read of
  a forward value is checked, whichever rule made the reader or the value: a backward rule's
  fused op, a forward rule's fused op whose outputs the backward now reads (a fused pair), an
  unfused backward node a rule rewired. A read that breaks the rule reads a copy made in the
  forward instead (``_to_copy``, tagged ``MUST_SAVE`` so no partitioner recomputes it from the
  original). Returned tensors are told apart by their place among the forward's outputs, so a
  returned value a forward rule replaced is still the tensor the caller holds; the graph's
  output node is no reader (returning a tensor does not save it). "Read by the backward"
  counts reads through forward values that activation checkpointing recomputes (their inputs
  are saved); the min-cut partitioner's own recomputation is not predicted, so under it a copy
  may be made where the unfused program would have saved the tensor itself (the safe side).
  Where the unfused backward read that storage too, the refusal must survive: only the caller's
  tensor itself carries the version counter (Inductor returns every view it computes as an alias
  with a counter of its own, and min-cut may save a view of an input rather than the input). So a
  read the pass made of a caller's storage reads the caller's tensor, through views made in the
  backward (tagged ``must_be_in_backward``: every partitioner saves the tensor, not a view; they start
  from a whole-tensor ``expand``, so min-cut's CSE cannot merge them with the forward's views, and
  a split's piece re-makes the split); another view of a returned tensor's base reads a copy.
  A returned tensor the pass made a view (a fused op's output permuted back) is returned as a
  forward copy, read by the backward: the caller's tensor must be no view of a value it never
  sees (AOTAutograd hands one out as a view of a multi-output function, which autograd forbids
  the caller to update in place, and Inductor as an alias with a counter of its own).
* **Recomputation** (min-cut only). Min-cut never recomputes a value that a backward op it
  cannot fuse with (a fused op, a custom op to it) reads: that value must be materialized in the
  backward anyway, so it saves it. The unfused backward read RoPE's tables through pointwise
  ops, and min-cut recomputed them from the positions and the inverse frequencies instead of
  saving them. A fused op reads each table it shares with the forward through a hand-off, one
  pointwise node in the backward (``table * 1``, tagged ``must_be_in_backward``), so min-cut
  keeps that choice (each fused op declares them: ``FusedOp.recomputable``). The hand-off writes the table once per
  backward; the fused op reads it as before. Larger operands (x, dy) get none: recomputing
  them costs a full activation's traffic.
"""
from __future__ import annotations

import functools
import operator
from typing import Callable, Dict, Hashable, List, Optional, Set

import torch
import torch.fx as fx

from ..lowering import FUSED_OPS
from ..patterns.nodes import aten, gradient_dependent
from ..patterns.rewrite import call, fake_mode_of

TAG = "partitioner_tag"

#: per fused op's schema name, the arguments min-cut may recompute rather than save (see
#: Recomputation above), from each op's declaration
RECOMPUTABLE_ARGUMENTS = {f"npu_fusion::{op.name}": op.recomputable for op in FUSED_OPS}


def _must_recompute(node: fx.Node) -> bool:
    from torch.utils.checkpoint import CheckpointPolicy

    return node.meta.get("recompute") in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _must_save_policy():
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE


def is_joint_graph(graph: fx.Graph) -> bool:
    """A graph with both primals (forward inputs) and tangents (incoming gradients)."""
    names = [n.name for n in graph.find_nodes(op="placeholder")]
    return any(n.startswith("primals") for n in names) and any(n.startswith("tangents") for n in names)


def forward_boundary(graph: fx.Graph, gradient: Set[fx.Node]) -> Optional[fx.Node]:
    """The last forward node, as the default partitioner finds it (the last node tagged
    ``is_forward`` or a primal); without tags, the last node before the first call that
    depends on a tangent."""
    last = None
    for node in graph.nodes:
        if node.meta.get(TAG) == "is_forward" or (node.op == "placeholder" and node.name.startswith("primals")):
            last = node
    if last is not None and any(TAG in n.meta for n in graph.nodes):
        return last
    for node in graph.nodes:
        if node.op == "call_function" and node in gradient:
            return node.prev
    return last


def aliased_input(node) -> Optional[fx.Node]:
    """The input whose storage ``node``'s value shares, or None: the argument a view op's schema
    marks as aliased by its result (``Tensor(a) self``: views, splits, ``view_as_real``), and
    for a ``getitem`` of a split, the split's."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is operator.getitem:
        return aliased_input(node.args[0])
    try:
        places = _aliased_places(node.target)
    except TypeError:  # an unhashable target: read its schema here
        places = _aliased_places.__wrapped__(node.target)
    for place in places:
        value = node.args[place] if place < len(node.args) else None
        if isinstance(value, fx.Node):
            return value
    return None


@functools.lru_cache(maxsize=None)
def _aliased_places(target) -> tuple:
    """The places of the arguments an op's schema marks as aliased by its result (none for an op
    without a schema, a mutating one, or one whose results alias nothing): read once per op."""
    schema = getattr(target, "_schema", None)
    if schema is None or schema.is_mutable or not any(r.alias_info is not None for r in schema.returns):
        return ()
    return tuple(i for i, argument in enumerate(schema.arguments) if argument.alias_info is not None)


def base_of(node):
    """The node whose storage ``node``'s value lives in: through every aliasing op to its base."""
    while (source := aliased_input(node)) is not None:
        node = source
    return node


def copy_by_to_copy(graph: fx.Graph, fake_mode, value: fx.Node) -> fx.Node:
    """A copy as AOTAutograd graphs write one (``_to_copy``, not ``clone``, which compilers
    drop as a no-op when nothing else marks it needed)."""
    return call(graph, fake_mode, aten._to_copy.default, (value,))


class ReturnedTensors:
    """The places of a graph's outputs the caller receives, and which were views before the pass.

    A fused op's output permuted back is a view of a value the caller never sees, where the unfused
    program returned a tensor of its own; AOTAutograd's runtime hands such a view out as a view of
    its multi-output function, which autograd then forbids the caller to update in place (eager
    allows it). :meth:`copy_made_views` returns a copy in its place."""

    def __init__(self, graph: fx.Graph, places: List[int]):
        self.graph = graph
        self.places = places
        outputs = _outputs_of(graph)
        #: the places whose tensor is a view before the pass (the caller's is an alias already)
        self.views = {i for i in places if aliased_input(outputs[i]) is not None}

    @classmethod
    def of_partitioned_forward(cls, graph: fx.Graph) -> "ReturnedTensors":
        """A training forward after the partition: the outputs AOTAutograd marks as the user's
        (its saved tensors are the backward's, no caller holds them); none where unmarked."""
        output = next(iter(graph.find_nodes(op="output")))
        descriptions = output.meta.get("desc") or ()
        return cls(graph, [i for i, d in enumerate(descriptions) if type(d).__name__ == "PlainAOTOutput"])

    def copy_made_views(self, copy_op: Callable) -> List[fx.Node]:
        """Return a copy (``copy_op``, right after it) of each returned tensor the pass made a view;
        returns the copies."""
        outputs = _outputs_of(self.graph)
        copies: Dict[fx.Node, fx.Node] = {}
        for place in self.places:
            node = outputs[place]
            if place not in self.views and isinstance(node, fx.Node) and aliased_input(node) is not None \
                    and node not in copies:
                with self.graph.inserting_after(node):
                    copies[node] = copy_op(self.graph, fake_mode_of(self.graph), node)
        if copies:
            self.return_instead(copies)
        return list(copies.values())

    def return_instead(self, replacements: Dict[fx.Node, fx.Node]) -> None:
        """Return each replacement at the returned places of the node it replaces (the outputs keep
        their container: the other places are untouched)."""
        output = next(iter(self.graph.find_nodes(op="output")))
        outputs = list(output.args[0])
        for place in self.places:
            if isinstance(outputs[place], fx.Node) and outputs[place] in replacements:
                outputs[place] = replacements[outputs[place]]
        output.args = (type(output.args[0])(outputs),) + tuple(output.args[1:])


def _outputs_of(graph: fx.Graph) -> list:
    return list(next(iter(graph.find_nodes(op="output"))).args[0])


class JointGraph:
    """A joint graph as it was before the pass: its nodes, and the forward values its unfused
    backward reads. :meth:`prepare_for_partition` then places and guards what the pass added."""

    def __init__(self, graph: fx.Graph, copy_op: Optional[Callable] = None, min_cut: bool = False):
        self.graph = graph
        #: whether min-cut partitions the graph (it then gets hand-offs, see Recomputation above)
        self.min_cut = min_cut
        #: ``copy_op(graph, fake_mode, value)`` inserts a copy of ``value`` (at the insertion point)
        self.copy_op = copy_op or copy_by_to_copy
        self.original = set(graph.nodes)
        gradient = gradient_dependent(graph) or set()
        self.boundary = forward_boundary(graph, gradient)
        self.backward = self._backward_nodes(gradient)
        #: the places of the forward's outputs (the tensors the graph returns to the caller)
        self.returned_places = [i for i, o in enumerate(self._outputs())
                                if isinstance(o, fx.Node) and o not in self.backward]
        #: the forward values the unfused backward reads, each with its readers
        self.original_reads = self._backward_reads(self.backward)
        #: the returned tensors, and which were views before the pass
        self.returned = ReturnedTensors(graph, self.returned_places)
        #: the caller-reachable storages the unfused backward reads, by :meth:`_reachable_keys`'s key
        reachable = self._reachable_keys()
        self.reachable_read = {reachable[base_of(v)] for v in self.original_reads if base_of(v) in reachable}

    def _backward_nodes(self, gradient: Set[fx.Node]) -> Set[fx.Node]:
        if self.boundary is None:
            return set(gradient)
        nodes = list(self.graph.nodes)
        after = {n for n in nodes[nodes.index(self.boundary) + 1:] if n.op != "output"}
        return after | {n for n in gradient if n.op != "placeholder"}

    def _outputs(self) -> list:
        return _outputs_of(self.graph)

    def _backward_reads(self, backward: Set[fx.Node]) -> Dict[fx.Node, List[fx.Node]]:
        """The forward values ``backward`` reads, each with its readers: the inputs of backward
        nodes, and the inputs of forward values activation checkpointing recomputes for it (read
        by the recomputed value). The output node reads nothing: returning a tensor saves none."""
        readers: Dict[fx.Node, Dict[fx.Node, None]] = {}  # each value's readers, in order, once each
        stack = [(a, n) for n in backward if n.op != "output" for a in n.all_input_nodes if a not in backward]
        while stack:
            node, reader = stack.pop()
            if node.op == "placeholder" and node.name.startswith("tangents"):
                continue
            first = node not in readers
            readers.setdefault(node, {})[reader] = None
            if first and _must_recompute(node):
                stack.extend((a, node) for a in node.all_input_nodes if a not in backward)
        return {node: list(read_by) for node, read_by in readers.items()}

    def _reachable_keys(self) -> Dict[fx.Node, Hashable]:
        """The storages the caller can reach, each with a key that names it before and after the
        pass: a graph input by its name, a returned tensor by its first place among the outputs
        (a forward rule may have replaced the node that computes it)."""
        keys: Dict[fx.Node, Hashable] = {}
        for p in self.graph.find_nodes(op="placeholder"):
            if not p.name.startswith("tangents"):
                keys[p] = ("input", p.name)
        outputs = self._outputs()
        for place in self.returned_places:
            if place < len(outputs) and isinstance(outputs[place], fx.Node):
                keys.setdefault(base_of(outputs[place]), ("returned", place))
        return keys

    def prepare_for_partition(self) -> List[fx.Node]:
        """Tag and place the inserted nodes, guard the backward's reads of caller-reachable tensors
        and return no view the pass made. Returns the forward copies made."""
        # a forward rule's nodes come tagged is_forward: forward work, left where it is
        added = [n for n in self.graph.nodes if n not in self.original and n.meta.get(TAG) != "is_forward"]
        if self.boundary is not None and self.boundary._erased:  # a forward rule replaced the last forward node
            self.boundary = forward_boundary(self.graph, gradient_dependent(self.graph) or set())
        for node in added:
            node.meta[TAG] = "is_backward"
        self._move_after_forward(added)
        copies = self._guard_reachable_reads(added)
        copies += self._return_made_views_as_copies()
        if self.min_cut:
            self._hand_off_recomputable_reads(added)
        return copies

    def _return_made_views_as_copies(self) -> List[fx.Node]:
        """Return a forward copy of each returned tensor the pass made a view (:class:`ReturnedTensors`;
        a copy the guard already returned is no view); returns the copies."""
        return self.returned.copy_made_views(lambda graph, fake_mode, node: self._forward_copy(node))

    def _move_after_forward(self, added: List[fx.Node]) -> None:
        """Move inserted nodes that sit among the forward nodes to just after the last one, in
        their order (their inputs stay before them, their users after them)."""
        if self.boundary is None:
            return
        position = {n: i for i, n in enumerate(self.graph.nodes)}
        early = [n for n in added if position[n] < position[self.boundary]]
        anchor = self.boundary
        for node in early:
            anchor.append(node)
            anchor = node

    def _hand_off_recomputable_reads(self, added: List[fx.Node]) -> None:
        """Each fused op's recomputable arguments that are forward values computed in the graph:
        read through a hand-off in the backward, so min-cut may recompute them."""
        for node in added:
            schema = getattr(node.target, "_schema", None)
            recomputable = RECOMPUTABLE_ARGUMENTS.get(schema.name, ()) if schema is not None else ()
            if not recomputable:
                continue
            for index, argument in enumerate(schema.arguments[:len(node.args)]):
                value = node.args[index]
                if argument.name in recomputable and self._computed_forward_value(value):
                    with self.graph.inserting_before(node):
                        hand_off = call(self.graph, fake_mode_of(self.graph), aten.mul.Tensor, (value, 1))
                    hand_off.meta[TAG] = "must_be_in_backward"
                    node.replace_input_with(value, hand_off)

    def _computed_forward_value(self, value) -> bool:
        return (isinstance(value, fx.Node) and value in self.original and value not in self.backward
                and value.op == "call_function" and isinstance(value.meta.get("val"), torch.Tensor))

    def _guard_reachable_reads(self, added: List[fx.Node]) -> List[fx.Node]:
        """Guard the backward's reads of storages the caller can reach; returns the forward copies.

        Where the unfused backward did not read that storage, the read goes through a forward copy;
        where it did and the pass made the read, the read is of the caller's tensor itself
        (:meth:`_read_as_callers`)."""
        backward = (self.backward & set(self.graph.nodes)) | set(added)
        reachable = self._reachable_keys()
        copies: List[fx.Node] = []
        callers: Dict[Hashable, tuple] = {}  # per storage, :meth:`_callers_tensor`
        position = {n: i for i, n in enumerate(self.graph.nodes)}  # readers keep their order
        for value, readers in self._backward_reads(backward).items():
            key = reachable.get(base_of(value))
            if key is None or not isinstance(value.meta.get("val"), torch.Tensor):
                continue
            if key not in self.reachable_read:
                copies.append(self._read_through_forward_copy(value, readers))
                continue
            new_readers = [r for r in readers if r in backward and r not in self.original_reads.get(value, ())]
            if new_readers and not (value is self._callers_node(key) and aliased_input(value) is None):
                if key not in callers:
                    callers[key] = self._callers_tensor(key, copies)
                first = min(new_readers, key=position.__getitem__)
                self._read_as_callers(value, new_readers, first, callers[key], copies)
        for node in added:  # a view the pass made of the caller's storage: no partitioner saves it
            if aliased_input(node) is not None and base_of(node) in reachable:
                node.meta[TAG] = "must_be_in_backward"
        return copies

    def _callers_node(self, key: Hashable) -> fx.Node:
        """The node the backward saves as the caller's tensor under ``key``.

        That is the graph input, or the returned node; a node returned as a view before the pass
        stands for its base (a compiler returns a view as an alias of its own at each place, with a
        version counter of its own)."""
        if key[0] == "input":
            return next(p for p in self.graph.find_nodes(op="placeholder") if p.name == key[1])
        returned = self._outputs()[key[1]]
        return base_of(returned) if key[1] in self.returned.views else returned

    def _callers_tensor(self, key: Hashable, copies: List[fx.Node]):
        """The caller's node under ``key`` and the node saved as it: :meth:`_callers_node`, or where
        the pass made a returned tensor a view (a fused op's output permuted back), a forward copy of
        it, returned in its place."""
        node = self._callers_node(key)
        if key[0] == "input" or aliased_input(node) is None:
            return node, node
        copy = self._forward_copy(node)
        self.returned.return_instead({node: copy})
        copies.append(copy)
        return node, copy

    def _read_as_callers(self, value: fx.Node, readers: List[fx.Node], first: fx.Node, callers,
                         copies: List[fx.Node]) -> None:
        """Make ``readers`` read ``value`` as views of the caller's tensor made in the backward.

        Every partitioner then saves the caller's tensor itself, whose version counter guards the
        backward as the unfused program's did; a value that is no view of it reads a copy. The views
        go before ``first``, the earliest reader."""
        node_of_callers, saved = callers
        chain = []  # the views from the caller's tensor (exclusive) to value (inclusive)
        node = value
        while node is not node_of_callers and node is not None:
            chain.append(node)
            if node.target is operator.getitem:  # a piece of a split: the split is re-made too
                node = node.args[0]
                chain.append(node)
            node = aliased_input(node)
        if node is None:  # another view of the returned node's base: its storage, not its tensor
            copies.append(self._read_through_forward_copy(value, readers))
            return
        with self.graph.inserting_before(first):
            # the views start from a whole-tensor expand, which no forward view chain starts from:
            # min-cut's CSE would merge a re-made view with the forward's (untagged) one, and save it
            head = call(self.graph, fake_mode_of(self.graph), aten.expand.default,
                        (saved, [-1] * saved.meta["val"].dim()))
            head.meta[TAG] = "must_be_in_backward"
            made = {node_of_callers: head}
            for view in reversed(chain):
                args, kwargs = fx.node.map_arg((view.args, view.kwargs), lambda n: made.get(n, n))
                made[view] = call(self.graph, fake_mode_of(self.graph), view.target, args, kwargs)
                made[view].meta[TAG] = "must_be_in_backward"
        for reader in readers:
            reader.replace_input_with(value, made.get(value, saved))

    def _read_through_forward_copy(self, value: fx.Node, readers: List[fx.Node]) -> fx.Node:
        """Make ``readers`` read a forward copy of ``value`` (:meth:`_forward_copy`); returns the copy."""
        copy = self._forward_copy(value)
        for reader in readers:
            reader.replace_input_with(value, copy)
        return copy

    def _forward_copy(self, value: fx.Node) -> fx.Node:
        """A copy of ``value`` among the forward nodes, right after ``value`` (after the last
        forward input when it is one), saved for the backward by every partitioner.

        Not after the last placeholder: that is a tangent, and the rules' inserted nodes may sit
        before it (a rotation's backward inserted after ``tangents_1``); the default partitioner
        takes every node before the last forward-tagged one as forward, the backward ones too."""
        where = value
        if value.op == "placeholder":
            where = [p for p in self.graph.find_nodes(op="placeholder") if not p.name.startswith("tangents")][-1]
        with self.graph.inserting_after(where):
            copy = self.copy_op(self.graph, fake_mode_of(self.graph), value)
        copy.meta[TAG] = "is_forward"
        copy.meta["recompute"] = _must_save_policy()
        return copy
