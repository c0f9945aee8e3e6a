"""Rewriting a graph: one transaction per candidate, and the one emit every rule shares.

A rule's ``emit`` inserts the fused op's operands after the last of its inputs
(:class:`Insertion`, nodes made through :class:`Edit`), then :func:`emit_fused_op`
checks them with the op's own input checks, calls the op and casts each output as the
program cast the value it replaces; :func:`commit` rewires the replaced outputs and
erases what is dead. :class:`RuleContext` (a rule's view of one run of the pass) runs
each candidate as a transaction: any failure before :func:`commit` costs only that
candidate (a recorded miss, its inserted nodes erased); after it, the pass manager's
whole-graph snapshot puts the graph back. The open transactions are the run's
(:class:`~.context.PassContext`), never the process's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
from typing import Dict, Iterable, List, Optional, Sequence, Union

import torch
import torch.fx as fx

from ..compat import active_fake_mode, is_erased
from ..lowering.checks import FusedOpInputError
from ..lowering.fused_op import FusedOp
from ..lowering.sizes import same_shape
from .context import PassContext, fake_mode_of
from .evaluator import MemoEvaluator, Unsupported
from . import fake_values
from .layout import relaid_like, restored, same_layout
from .nodes import aten, dtype, holds, is_float_cast, shape, target_name, val
from .traffic import node_traffic

log = logging.getLogger("npu_fusion")

#: fake_mode_of lives in .context; plugin.joint reads it here, with call
__all__ = ["fake_mode_of", "call", "cast", "getitem", "Edit", "Insertion", "RuleContext", "Rewrites", "Miss", "Site",
           "commit", "emit_fused_op", "exact_common_dtype", "replacement_of", "input_problem", "erase_dead",
           "erase_unused_upstream", "Transaction"]


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
    #: what of the subgraph the rewrite left to the program, and why (None: nothing)
    note: Optional[str] = None

def exact_common_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The narrowest float dtype that holds every operand exactly.

    The narrowest float dtype that holds every operand exactly: one of them when it holds
    the others, else float32 (float16 and bfloat16 each hold only part of the other), so a
    fused op never rounds data through a dtype the program did not use for it."""
    dtypes = set(dtypes)
    for candidate in sorted(dtypes | {torch.float32, torch.float64}, key=lambda t: torch.finfo(t).bits):
        if all(holds(candidate, d) for d in dtypes):
            return candidate
    raise Unsupported(f"no float dtype holds {sorted(map(str, dtypes))}")

def call(graph: fx.Graph, fake_mode, target, args, kwargs=None, value=None, created=None) -> fx.Node:
    """Insert a call (at the graph's current insertion point) with its fake value:
    ``value`` when the caller knows it (the node replaces one it equals), else computed.
    ``created``, a list, records the node (a transaction's inserted nodes)."""
    kwargs = kwargs or {}
    erased = []
    fx.node.map_arg((tuple(args), kwargs), lambda n: erased.append(n.name) if is_erased(n) else None)
    if erased:  # a stale match: the candidate fails here, before anything is inserted or rewired
        raise ValueError(f"{erased[0]}, an operand of the {target_name(target)} to insert, was erased by an "
                         f"earlier rewrite")
    args, kwargs = _symbolic_sizes_as_nodes(graph, (tuple(args), kwargs), created)
    node = graph.call_function(target, tuple(args), kwargs)
    if created is not None:
        created.append(node)
    if value is None:
        meta_args, meta_kwargs = fx.node.map_arg((tuple(args), kwargs), lambda n: n.meta.get("val"))
        value = target(*meta_args, **meta_kwargs) if fake_mode is None else \
            fake_values.fake_value_of(fake_mode, target, meta_args, meta_kwargs)
    fake_values.set_fake_value(node, value)
    return node

def _symbolic_sizes_as_nodes(graph: fx.Graph, arguments, created):
    """``arguments`` with each symbolic size (a ``SymInt`` the caller read off a recorded value: a view's
    shape) replaced by a node of the graph that computes it, inserted where the call goes.

    FX names a symbolic size in a call's arguments by the node that computes it; a bare ``SymInt``
    would be printed as its symbol (``s77``), which the graph's code does not define. The size is a
    graph input (a ``SymInt`` placeholder) or one axis of an input tensor (``sym_size``, added at the
    insertion point); an expression no input is raises :class:`Unsupported` (the candidate stays)."""
    def size(v):
        if isinstance(v, (list, tuple)):
            return type(v)(size(x) for x in v)
        if not isinstance(v, torch.SymInt):
            return v
        if v.node.expr.is_number:
            return int(v.node.expr)
        inputs = graph.find_nodes(op="placeholder")
        same = next((p for p in inputs if isinstance(p.meta.get("val"), torch.SymInt)
                     and p.meta["val"].node.expr == v.node.expr), None)
        if same is not None:
            return same
        for p in inputs:
            tensor = p.meta.get("val")
            axis = next((d for d, n in enumerate(tensor.shape) if isinstance(n, torch.SymInt) and n.node.expr == v.node.expr),
                        None) if isinstance(tensor, torch.Tensor) else None
            if axis is not None:
                read = graph.call_function(aten.sym_size.int, (p, axis))
                read.meta["val"] = tensor.shape[axis]
                if created is not None:
                    created.append(read)
                return read
        raise Unsupported(f"the symbolic size {v} is neither a graph input nor an axis of one")

    args, kwargs = arguments
    return size(args), {k: size(v) for k, v in kwargs.items()}


def getitem(graph, fake_mode, node, index, created=None) -> fx.Node:
    item = graph.call_function(operator.getitem, (node, index))
    if created is not None:
        created.append(item)
    fake_values.set_fake_value(item, node.meta["val"][index])
    return item

def cast(graph, fake_mode, node: fx.Node, to: torch.dtype, created=None) -> fx.Node:
    if dtype(node) == to:
        return node
    return call(graph, fake_mode, aten._to_copy.default, (node,), {"dtype": to}, created=created)


class Edit:
    """Inserting nodes into one pass's graph: :func:`call`, :func:`cast` and :func:`getitem` with
    the graph's fake mode, each node recorded in the innermost open transaction of the pass
    (erased again if the candidate fails before :func:`commit`)."""

    def __init__(self, graph: fx.Graph, fake_mode, transactions: List["Transaction"]):
        self.graph, self.fake_mode, self._transactions = graph, fake_mode, transactions

    @property
    def transaction(self) -> Optional["Transaction"]:
        return self._transactions[-1] if self._transactions else None

    def _created(self) -> Optional[list]:
        tx = self.transaction
        return tx.nodes if tx is not None else None

    def call(self, target, args, kwargs=None, value=None) -> fx.Node:
        return call(self.graph, self.fake_mode, target, args, kwargs, value, created=self._created())

    def cast(self, node: fx.Node, to: torch.dtype) -> fx.Node:
        return cast(self.graph, self.fake_mode, node, to, created=self._created())

    def getitem(self, node: fx.Node, index: int) -> fx.Node:
        return getitem(self.graph, self.fake_mode, node, index, created=self._created())

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

def replacement_of(edit: Edit, result: fx.Node, old: fx.Node) -> fx.Node:
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
        if not holds(d, precision):
            result, precision = edit.cast(result, d), d
    result = edit.cast(result, dtypes[-1])
    target = chain[0] if chain else matched
    if not same_shape(shape(result), shape(target)):
        result = edit.call(aten.view.default, (result, list(shape(target))))
    return result

def input_problem(fake_mode, check, *args) -> Optional[str]:
    """The message of the fused op's own input ``check`` (a constraint of docs/fused-ops.md it breaks)
    on the values of ``args`` (nodes, None or plain values), under the graph's fake mode; None if none."""
    values = [val(a) if isinstance(a, fx.Node) else a for a in args]
    try:  # entering the mode that is active already (the backward compiler's) changes nothing but costs
        with fake_mode if fake_mode is not None and fake_mode is not active_fake_mode() else contextlib.nullcontext():
            check(*values)
    except FusedOpInputError as exc:
        return str(exc)
    return None

def commit(edit: Edit, op: str, mode: Optional[str], region: List[fx.Node], outputs: Dict[str, fx.Node],
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
    tx = edit.transaction
    if tx is not None:  # from here on the graph changes: a failure can no longer be undone per site
        tx.committed = True
        tx.replacements = replacements
    for old, new in replacements.items():
        fake_values.move_views(old, new)  # the program's views of old now alias new's memory
        old.replace_all_uses_with(new)
    inputs = {a for n in region for a in n.all_input_nodes}
    erase_dead(edit.graph, region)
    # the replaced outputs too, with what they alone read: a region found empty (a rotation of no
    # positions) left them computed, and the leftover finder then recorded the fused site as a miss
    erase_unused_upstream(edit.graph, inputs | {old for old in replacements if not is_erased(old)})
    return site

def erase_dead(graph: fx.Graph, nodes: Iterable[fx.Node]) -> List[fx.Node]:
    """Erase the given nodes that no longer have users, users first."""
    erased = []
    for node in sorted({n for n in nodes if not is_erased(n)}, reverse=True):  # users before what they use
        if not node.users and node.op == "call_function":
            graph.erase_node(node)
            erased.append(node)
    return erased

def erase_unused_upstream(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """Erase the pure calls among ``nodes`` left without users, and then theirs: forward
    values a replaced subgraph alone had recomputed."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if is_erased(node) or node.users or node.op != "call_function" or node.is_impure():
            continue
        stack.extend(node.all_input_nodes)
        graph.erase_node(node)

@dataclasses.dataclass
class Transaction:
    """The nodes one candidate's rewrite inserted, and whether it began to rewire the graph."""
    nodes: List[fx.Node] = dataclasses.field(default_factory=list)
    committed: bool = False
    replacements: Dict[fx.Node, fx.Node] = dataclasses.field(default_factory=dict)
    #: what the candidate came to: a committed Site or a Miss
    outcome: Optional[Union[Site, Miss]] = None

class RuleContext:
    """One rule's view of one run of the pass, with its own ledger.

    One rule's view of one run of the pass: the :class:`~.context.PassContext` (graph,
    provenance, target, strictness) and the rule's own ledger (its sites, its internal errors,
    the candidates that failed, the nodes its rewrites replaced); each candidate is its own
    transaction.

    Examining a candidate (:meth:`examine`, :meth:`evaluated`) or rewriting it
    (:meth:`rewrite`) may fail with any exception; that costs the candidate only: it
    becomes a miss whose reason is the error, the nodes its rewrite had inserted are
    erased, the other sites still fuse, and later rounds leave it alone. With
    ``strict`` the error is raised instead, and so is one that happens after the graph
    began to be rewired (the pass manager's whole-graph snapshot then puts it back).

    The pass runs the rules in rounds until nothing new fuses (a site whose dy is
    another site's dx fuses once that one is a fused op): sites accumulate over the
    rounds, misses are the last round's (:attr:`round_misses`) plus every internal error.
    """

    def __init__(self, context: PassContext, op: str):
        self.context, self.op = context, op
        self.graph, self.provenance, self.target = context.graph, context.provenance, context.target
        self.strict, self.fake_mode = context.strict, context.fake_mode
        #: inserts nodes recorded in the open transaction
        self.edit = Edit(context.graph, context.fake_mode, context.transactions)
        self.sites: List[Site] = []
        self.round_misses: List[Miss] = []
        self.errors: List[Miss] = []
        #: the forward values a recorded miss is about, by its node's name, where the rule's find knows them
        self.subjects: Dict[str, frozenset] = {}
        self._failed: set = set()  # names of the nodes whose candidates failed
        self._replaced: Dict[fx.Node, fx.Node] = {}

    @property
    def misses(self) -> List[Miss]:
        return self.errors + self.round_misses

    def current(self, node: Optional[fx.Node]) -> Optional[fx.Node]:
        """The node that now holds ``node``'s value (an earlier rewrite may have replaced it)."""
        while node in self._replaced:
            node = self._replaced[node]
        return node

    def erased_under(self, match) -> Optional[fx.Node]:
        """A node ``match`` reads that an earlier rewrite of this round erased without a replacement, or None.

        A node ``match`` reads (a node-valued field, one of its ``roles``, or the leaf of an
        evaluator's role) that an earlier rewrite of this run erased and :meth:`current` does not
        map to a replacement (one site's output extended through a cast that another site's input
        was read before: a norm of a norm), or its key ``dx`` erased at all: the match is stale,
        found again in the rewritten graph next round."""
        if is_erased(match.dx):
            return match.dx
        fields = [getattr(match, f.name) for f in dataclasses.fields(match)] if dataclasses.is_dataclass(match) else []
        nodes = [v for v in (*fields, *getattr(match, "roles", ())) if isinstance(v, fx.Node)]
        leaves = getattr(getattr(match, "ev", None), "leaves", None)
        if isinstance(leaves, list):  # roles as (leaf id, positions): the leaves the op's operands are read from
            ids = [v[0] for v in fields if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], int)]
            stale = [leaves[i] for i in ids if 0 <= i < len(leaves) and is_erased(leaves[i])]
            if stale:
                return stale[0]
        return next((n for n in nodes if is_erased(n) and self.current(n) is n), None)

    def _failed_at(self, node, exc: Exception) -> None:
        name = node.name if isinstance(node, fx.Node) else str(node)
        reason = f"internal error, candidate left unfused: {type(exc).__name__}: {exc}"
        log.warning("npu_fusion: %s at %s: %s", self.op, name, reason, exc_info=exc)
        self._failed.add(name)
        self.errors.append(Miss(self.op, name, reason))

    def examine(self, node: fx.Node, fn, *args):
        """``fn(*args)``, or None (a recorded miss at ``node``, the candidate) if it raises."""
        if node.name in self._failed:
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

    def raise_if_strict(self, ev: "MemoEvaluator") -> None:
        """With ``strict``, raise the first error an evaluator met (a pure look that records
        nothing, such as finding a site again, still raises where the pass is strict)."""
        if self.strict and ev.errors:
            raise ev.errors[0][1]

    def has_failed(self, node: fx.Node) -> bool:
        """Whether examining or rewriting the candidate at ``node`` failed earlier in this run."""
        return node.name in self._failed

    @contextlib.contextmanager
    def transaction(self, node: fx.Node):
        """The candidate at ``node`` as a transaction: the body sets ``tx.outcome`` to a committed
        :class:`Site` or to a :class:`Miss`. A Miss, or an exception before :func:`commit`, erases
        the nodes the body inserted; the exception becomes the candidate's miss (``strict``, or
        one after the graph began to be rewired, raises)."""
        tx = Transaction()
        self.context.transactions.append(tx)
        try:
            yield tx
        except Exception as exc:
            if self.strict or tx.committed:
                raise
            erase_dead(self.graph, tx.nodes)  # nothing outside them uses them yet
            self._failed_at(node, exc)
            return
        finally:
            self.context.transactions.pop()
        if isinstance(tx.outcome, Miss):
            erase_dead(self.graph, tx.nodes)
            self.round_misses.append(tx.outcome)
        else:
            self.sites.append(tx.outcome)
            self._replaced.update(tx.replacements)

    def rewrite(self, node: fx.Node, fn, *args) -> None:
        """Run ``fn(*args)``, which returns a :class:`Site` (committed) or a :class:`Miss`, as the
        transaction of the candidate at ``node`` (none if that candidate failed before)."""
        if not self.has_failed(node):
            with self.transaction(node) as tx:
                tx.outcome = fn(*args)


#: the name rules used before the context held the pass's state
Rewrites = RuleContext


def emit_fused_op(ctx: RuleContext, op: FusedOp, at: fx.Node, operands: Sequence,
                  outputs: Dict[str, fx.Node], order: Optional[List[int]] = None) -> Union[Miss, tuple]:
    """Insert the call of ``op`` on ``operands`` and the casts that replace the site's outputs.

    Inside a rule's :class:`Insertion`: ``(fused call, {replaced output: its replacement})``
    for ``op`` called on ``operands`` (nodes, None or plain values), ``outputs`` named as the
    op names its outputs; or a :class:`Miss` at ``at`` when the operands break one of the
    op's own input checks. With ``order``, the caller's operands are permuted into that memory
    order (:mod:`.layout`) and each result is permuted back."""
    edit = ctx.edit
    problem = input_problem(edit.fake_mode, op.check_inputs, *operands)
    if problem is not None:
        return Miss(op.name, at.name, problem)
    fused = edit.call(op.overload, tuple(operands))
    single = not isinstance(fused.meta.get("val"), (tuple, list))  # an op returning one Tensor
    replacements = {}
    for index, name in enumerate(op.outputs):
        old = outputs.get(name)
        if old is not None:
            result = fused if single else edit.getitem(fused, index)
            replacements[old] = in_layout_of(edit, replacement_of(
                edit, restored(edit, result, order) if order else result, old), old)
    return fused, replacements


def in_layout_of(edit: Edit, new: fx.Node, old: fx.Node) -> fx.Node:
    """The value of ``new`` in ``old``'s strides, copied where they differ.

    ``new`` with ``old``'s strides: a copy into them where they differ and are a dense layout
    (a dx of a transposed q, a keep-dim rstd of a norm run in BSHD order), since the program's
    views of ``old`` rely on them; else ``new`` (the rule compares the layouts, if it must)."""
    if not isinstance(val(new), torch.Tensor) or same_layout(new, old):
        return new
    return relaid_like(edit, new, old) or new


# -- gradients autograd accumulated with a site's dx ----------------------------------------

def gradient_accumulation(node: fx.Node, stop) -> tuple:
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


def add_back_accumulated(edit: Edit, site, replacements) -> List[fx.Node]:
    """The other gradients accumulated with ``site.dx`` (``site.rest``), added back to the fused dx
    after all of them (the RMSNorm and RoPE rules share this)."""
    added = []
    with edit.graph.inserting_before(site.dx):
        total = replacements[site.dx]
        for i, other in enumerate(site.rest):
            last = i == len(site.rest) - 1  # it computes the replaced node's value
            total = edit.call(aten.add.Tensor, (other, total), value=site.dx.meta["val"] if last else None)
            added.append(total)
        replacements[site.dx] = total
    return added


#: what a node inserted as forward work takes from the node it replaces: the partitioner's
#: forward tag, activation checkpointing's policy and region, and where it came from
FORWARD_META = ("partitioner_tag", "recompute", "ac_graph_id", "seq_nr", "stack_trace", "nn_module_stack")


def as_forward_work(nodes: List[fx.Node], like: fx.Node) -> None:
    """Mark inserted nodes as forward nodes (``partitioner_tag`` ``is_forward``): the joint
    graph's preparation (:mod:`npu_fusion.plugin.joint`) leaves them where they are."""
    for node in nodes:
        for key in FORWARD_META:
            if key in like.meta:
                node.meta[key] = like.meta[key]
        node.meta["partitioner_tag"] = "is_forward"
