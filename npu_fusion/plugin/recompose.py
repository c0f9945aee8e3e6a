"""Put back the ops the SwiGLU rules read whole where a decomposition table took them apart, and take apart again what stays unfused.

AOTAutograd traces the joint graph through the decomposition table of the path that compiles it:
Inductor's own, or the ``npu_fusion`` backend's (``decompositions="core"``: core ATen's; on an
Ascend host torchair's under it). Those tables decompose ``aten.silu`` and ``aten.silu_backward``,
which the SwiGLU rules read as leaves of the lanes domain. Before the rules run,
:func:`recompose_decomposed` puts one call back wherever the graph holds, node for node, the trace
of the op's decomposition in that same table on the same inputs (so the call has the value of
what it replaces, bit for bit); after them, :func:`decompose_again` puts that trace back in
place of each call the pass left unfused, so an unfused site is exactly what the user's table
made of it. One recomposition serves both paths, parameterized by the table.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Iterable, List, Optional

import torch
import torch.fx as fx

from ..patterns.fake_values import move_views
from .options import FusionOptions

#: node meta that describes a call's value (the trace of its decomposition has its own)
VALUE_META = ("val", "tensor_meta", "example_value")


def recomposable_ops(options: FusionOptions, table: Optional[dict]) -> List:
    """The ops an enabled rule reads whole (``reads_whole``) that ``table`` decomposes, by name."""
    from ..patterns import RULES

    if not table:
        return []
    wanted = {name for rule in RULES if options.enables(rule) for name in rule.reads_whole}
    ops = [getattr(torch.ops.aten, name).default for name in sorted(wanted)]
    return [op for op in ops if op in table]


def recompose_decomposed(gm: fx.GraphModule, options: FusionOptions, table: Optional[dict],
                         traces: Optional[dict] = None, recompile: bool = True) -> List[fx.Node]:
    """Put ``aten.silu`` and ``aten.silu_backward`` back, in place, where ``gm`` holds exactly their decomposition in ``table``.

    A subgraph is recomposed only where it is, node for node, the trace of the op's
    decomposition (``table``) on the same inputs, so the op has its value bit for bit; an
    intermediate something else reads stays for that reader. Returns the calls it put back
    (:func:`decompose_again` takes apart those the pass leaves). ``traces``: the traces made so
    far on this graph, by :func:`_call_key`; given the same dict, :func:`decompose_again` reuses
    them (the trace of a call it takes apart is the one that matched it). ``recompile=False``
    leaves the module's Python code as it was, for a caller that regenerates it after its passes
    (Inductor, after its joint passes)."""
    ops = recomposable_ops(options, table)
    if not ops:
        return []
    from ..patterns.context import fake_mode_of

    fake_mode, calls, structures = fake_mode_of(gm.graph), [], known_structures(table)
    traces = {} if traces is None else traces
    for op in ops:
        erased = set()
        for inputs in list(_decomposition_inputs(gm.graph, op)):
            if not erased.intersection(inputs):
                done = _recompose(gm, op, inputs, table, fake_mode, traces, structures)
                if done is not None:
                    call, gone = done
                    calls.append(call)
                    erased.update(gone)
    if calls:
        gm.graph.lint()
        if recompile:
            gm.recompile()
    return calls


def decompose_again(gm: fx.GraphModule, calls: Iterable[fx.Node], table: dict,
                    traces: Optional[dict] = None, recompile: bool = True) -> int:
    """Put the trace of its decomposition (``table``) back in place of each of ``calls`` still in ``gm``.

    The calls :func:`recompose_decomposed` put back that the pass left unfused: the graph there
    is again what the table made of the program. ``traces`` and ``recompile`` as for
    :func:`recompose_decomposed` (the same ``traces``: a call whose inputs kept their geometry
    takes the trace that matched it). Returns how many it took apart."""
    from ..patterns.context import fake_mode_of

    present = set(gm.graph.nodes)
    left = [c for c in calls if c in present]
    if left:
        fake_mode = fake_mode_of(gm.graph)
        traces = {} if traces is None else traces
        for node in left:
            replace_by_decomposition(gm, node, table, fake_mode, traces)
        gm.graph.lint()
        if recompile:
            gm.recompile()
    return len(left)


def _uncast(node) -> list:
    """What ``node`` converts, where it is a dtype conversion (the decompositions upcast their inputs), then ``node``.

    The source first: the op recomposed on it is the one the program called, casts included
    (Inductor's table converts with ``prims.convert_element_type``, core ATen's with ``_to_copy``)."""
    out = [node]
    target = getattr(node, "target", None)
    if target is torch.ops.prims.convert_element_type.default or (
            target is torch.ops.aten._to_copy.default and set(node.kwargs) <= {"dtype"}):
        out.insert(0, node.args[0])
    return out


def _decomposition_inputs(graph: fx.Graph, op):
    """Candidate inputs of a decomposed ``op``, read off the first call of its decomposition.

    ``silu``: ``exp(neg(x))`` (Inductor's table) or ``x * sigmoid(x)`` (core ATen's);
    ``silu_backward``: ``dy * sigmoid(x)`` (both)."""
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if op is aten.silu.default and node.target in (aten.neg.default, aten.sigmoid.default):
            for x in _uncast(node.args[0]):
                yield (x,)
        elif op is aten.silu_backward.default and node.target is aten.sigmoid.default:
            for user in node.users:
                if user.target is aten.mul.Tensor and len(user.args) == 2 and user.args[1] is node:
                    for dy in _uncast(user.args[0]):
                        for x in _uncast(node.args[0]):
                            yield (dy, x)


def _same_argument(a, b) -> bool:
    """Whether two call arguments are the same: the same nodes, equal constants of one type, alike sequences."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_argument(x, y) for x, y in zip(a, b))
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b
    return type(a) is type(b) and a == b


def _match_trace(traced: fx.Graph, inputs):
    """The graph's nodes that are, node for node, ``traced`` run on ``inputs``: (its output's node, the calls matched), or (None, [])."""
    env, placeholders, matched, root = {}, iter(inputs), [], None
    for inner in traced.nodes:
        if inner.op == "placeholder":
            env[inner] = next(placeholders)
        elif inner.op == "output":
            root = env.get(inner.args[0]) if isinstance(inner.args[0], fx.Node) else None
        elif inner.op != "call_function":
            return None, []
        else:
            args, kwargs = fx.node.map_arg((inner.args, inner.kwargs), env.__getitem__)
            readers = inner.all_input_nodes
            if not readers:
                return None, []
            found = next((u for u in env[readers[0]].users if u.op == "call_function" and u.target is inner.target
                          and _same_argument(u.args, args) and _same_argument(dict(u.kwargs), dict(kwargs))
                          and u not in matched), None)
            if found is None:
                return None, []
            env[inner] = found
            matched.append(found)
    return root, matched


def _trace_key(op, values) -> Optional[tuple]:
    """What a decomposition's trace depends on: the op and each input's dtype, device, shape and strides (None where a size is symbolic)."""
    import torch

    key = [op]
    for value in values:
        if not isinstance(value, torch.Tensor):
            return None
        geometry = (*value.shape, *value.stride())
        if not all(isinstance(n, int) for n in geometry):
            return None
        key.append((value.dtype, value.device, tuple(value.shape), value.stride()))
    return tuple(key)


#: per decomposition table (a copy of its entries) and determinism flag, the structure of each
#: decomposition trace :func:`_recompose` made (by :func:`_call_key`); the newest few tables
_STRUCTURES: List[tuple] = []
_TABLES_KEPT = 4


def known_structures(table: dict) -> dict:
    """The traces' structures (:func:`_structure`) made with ``table``'s entries in this process, by :func:`_call_key`.

    A trace is a function of the call's key, the table's entries and the determinism flag
    (a decomposition may branch on it), so a structure found under all three is the trace a new
    one would make, node for node: the next graph of the same geometry (another compile, a
    recompile, the graph after a graph break) matches it without tracing. The match reads
    nodes, targets and arguments only; the values stay with the graph that made them."""
    flag = torch.are_deterministic_algorithms_enabled()
    for entry in _STRUCTURES:
        if entry[1] == flag and entry[0] == table:
            return entry[2]
    entry = (dict(table), flag, {})
    _STRUCTURES.insert(0, entry)
    del _STRUCTURES[_TABLES_KEPT:]
    return entry[2]


def _structure(traced: fx.Graph) -> fx.Graph:
    """A copy of ``traced``'s nodes without their meta (the fake values of the graph that traced it)."""
    copy = fx.Graph()
    copy.output(copy.graph_copy(traced, {}))
    for node in copy.nodes:
        node.meta = {}
    return copy


def _flattened(args, kwargs):
    """A call's arguments as pytree leaves and their spec (a node's kwargs as a plain dict, as a call's)."""
    import torch.utils._pytree as pytree

    return pytree.tree_flatten((tuple(args), dict(kwargs)))


def _call_key(target, leaves, spec) -> Optional[tuple]:
    """What the trace of a call's decomposition depends on: :func:`_trace_key` of its node inputs'
    values, where its arguments sit, and its other arguments (None where a size is symbolic).

    The one key of :func:`_recompose` (a call ``op(*inputs)``) and :func:`replace_by_decomposition`,
    so a trace made to recompose a call serves to take it apart again."""
    key = _trace_key(target, [leaf.meta["val"] for leaf in leaves if isinstance(leaf, fx.Node)])
    if key is None:
        return None
    return key, str(spec), tuple(repr(leaf) for leaf in leaves if not isinstance(leaf, fx.Node))


def _recompose(gm: fx.GraphModule, op, inputs, table: dict, fake_mode, traces: Optional[dict] = None,
               structures: Optional[dict] = None):
    """Replace the subgraph that is the trace of ``op(*inputs)``'s decomposition by one call of ``op``.

    Returns (the call, the nodes it erased), or None where the subgraph is not there. An
    intermediate that something else reads stays for that reader: the call has the root's
    value whatever reads it. ``traces`` keeps each trace by :func:`_call_key` for the next
    candidate of the same op and geometry (each layer's; a trace is only read); ``structures``
    (:func:`known_structures`) keeps each trace's nodes without their values, across graphs."""
    from ..compat import traced_decomposition

    if any(not isinstance(i, fx.Node) or i.op == "output" or i.meta.get("val") is None for i in inputs):
        return None
    structures = {} if structures is None else structures
    try:  # read-only until the match is whole: a failure costs only this candidate
        values = [i.meta["val"] for i in inputs]
        key = _call_key(op, *_flattened(tuple(inputs), {})) if traces is not None else None
        traced = traces.get(key) if key is not None else None
        shape = traced.graph if traced is not None else structures.get(key) if key is not None else None
        if shape is None:
            with fake_mode if fake_mode is not None else contextlib.nullcontext():
                traced = traced_decomposition(lambda *a: op(*a), values, table)
            shape = traced.graph
            if key is not None:
                traces[key] = traced
                structures[key] = _structure(shape)
        root, matched = _match_trace(shape, inputs)
    except Exception:  # inputs the op does not take (a dtype or shape it refuses), or a graph it cannot read
        return None
    if root is None or root in inputs:
        return None
    graph = gm.graph
    with graph.inserting_before(root):
        call = graph.call_function(op, tuple(inputs))
    call.meta = dict(root.meta)
    root.replace_all_uses_with(call)
    erased = []
    for node in reversed(matched):
        if not node.users:
            graph.erase_node(node)
            erased.append(node)
    return call, erased


def replace_by_decomposition(gm: fx.GraphModule, node: fx.Node, table: dict, fake_mode,
                             traces: Optional[dict] = None) -> None:
    """Put the trace of ``node``'s decomposition (``table``) in place of ``node`` in ``gm``.

    ``traces`` keeps each trace for the next call of the same op, geometry and other arguments
    (each layer's; a trace is only read, its constants shared)."""
    import torch.utils._pytree as pytree

    from ..compat import traced_decomposition

    leaves, spec = _flattened(node.args, node.kwargs)
    inputs = [i for i, leaf in enumerate(leaves) if isinstance(leaf, fx.Node)]

    def as_called(*values):
        filled = list(leaves)
        for i, value in zip(inputs, values):
            filled[i] = value
        args, kwargs = pytree.tree_unflatten(filled, spec)
        return node.target(*args, **kwargs)

    values = [leaves[i].meta["val"] for i in inputs]
    key = _call_key(node.target, leaves, spec) if traces is not None else None
    traced = traces.get(key) if key is not None else None
    if traced is None:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            traced = traced_decomposition(as_called, values, table)
        if key is not None:
            traces[key] = traced
    graph, env, placeholders = gm.graph, {}, iter(leaves[i] for i in inputs)
    with graph.inserting_before(node):
        for inner in traced.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(placeholders)
            elif inner.op == "get_attr":  # a constant the decomposition made: moved into gm
                name = f"_decomposed_{node.name}_{inner.target}"
                setattr(gm, name, getattr(traced, inner.target))
                env[inner] = graph.get_attr(name)
                env[inner].meta = dict(inner.meta)
            elif inner.op == "output":
                result = fx.node.map_arg(inner.args[0], env.__getitem__)
            else:
                env[inner] = copied = graph.node_copy(inner, env.__getitem__)
                # the replaced call's partitioner tag and recompute policy, values of its own (below)
                copied.meta = {**{k: v for k, v in node.meta.items() if k not in VALUE_META}, **copied.meta}
                _value_of_its_own(copied, fake_mode)
    if isinstance(result, fx.Node):
        move_views(node, result)
        node.replace_all_uses_with(result)
    else:  # an op of several outputs: its users are getitems
        for user in list(node.users):
            assert user.target is operator.getitem, user
            move_views(user, result[user.args[1]])
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(node)


def _value_of_its_own(copied: fx.Node, fake_mode) -> None:
    """Give a node copied from a decomposition's trace a fake value computed from its own inputs' values.

    The trace's values are of the inputs it was traced on (another layer's, for a trace reused),
    and shared by every copy; aliasing analyses read storages from the fake values (a saved tensor
    whose storage no output shares is a donated buffer), so each copy's value is on its own inputs'
    storage or its own memory, as tracing would have made it. Where no fake mode or value can be
    had, the trace's value stays."""
    from ..patterns.fake_values import fake_value_of, set_fake_value

    if fake_mode is None or copied.op != "call_function":
        return
    values = fx.node.map_arg((copied.args, copied.kwargs), lambda n: n.meta.get("val"))
    if any(isinstance(n, fx.Node) and n.meta.get("val") is None for n in copied.all_input_nodes):
        return
    try:
        value = fake_value_of(fake_mode, copied.target, *values)
    except Exception:  # the trace's value is the op's value on this geometry: keep it
        return
    set_fake_value(copied, value)
