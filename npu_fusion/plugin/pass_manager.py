"""The npu-fusion pass: run the pattern rewrites on a backward, a joint or an inference FX graph.

:func:`fuse_joint` runs it on AOTAutograd's joint graph, before the partition (the
``npu_fusion`` backend, the Inductor hook); :func:`fuse_backward` on a graph that is
only a backward (torchair's post-partition hook, compiled-autograd graphs);
:func:`fuse_inference` on a graph that is only a forward with no backward (AOTAutograd's
inference graph: under ``torch.no_grad()``, or when no input needs a gradient). All three
share one run: it rewrites the graph in place after taking a
:class:`Snapshot`; if any rewrite fails, the graph is rebuilt from the snapshot,
so an internal error leaves the graph as it was (and then raises, with
``strict=True``).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.fx as fx

from ..compat import current_compile_id, dynamo_counters, empty_graph_like, specialize_size
from ..lowering.sizes import guarding_sizes
from ..patterns import RULES
from ..patterns.evaluator import InferenceProvenance, JointProvenance, PartitionedForwardProvenance, Provenance
from ..patterns.context import PassContext
from ..patterns.rewrite import Miss, RuleContext, Site
from ..patterns.rule import FusionRule, RoundReport
from ..patterns.nodes import one_round
from .joint import JointGraph, ReturnedTensors, copy_by_to_copy
from .logs import TRACE_AFTER, TRACE_BEFORE, dump_graph, log, trace_decisions, trace_graph
from .options import FusionOptions

COUNTER = "npu_fusion"


@dataclasses.dataclass
class FusionResult:
    """What one run of the pass did to one graph."""
    target: str
    sites: List[Site] = dataclasses.field(default_factory=list)
    misses: List[Miss] = dataclasses.field(default_factory=list)
    error: Optional[str] = None
    seconds: float = 0.0
    #: the pass's own time on this process's CPU clock (``time.process_time``, over the same span as
    #: ``seconds``): what a busy machine disturbs less, the numerator of the pass's share of a compile
    cpu_seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    #: which graph the pass ran on: ``"joint"`` (before the partition), ``"backward"``,
    #: ``"inference"`` (a forward that has no backward) or ``"forward"`` (a training forward
    #: after the partition: torchair's hook)
    graph: str = "backward"
    #: on a joint graph: the caller-reachable tensors the backward reads through a forward copy
    #: after the pass (the unfused backward read a copy of them, see :mod:`.joint`)
    copies: List[str] = dataclasses.field(default_factory=list)
    #: what the backend's partition saves for the backward after the pass
    #: (:class:`~npu_fusion.plugin.saved_activations.SavedSet`), when the backend partitioned
    saved: Optional[Any] = None
    #: the nodes the pass added, counted by target (``aten.full_like.default``,
    #: ``npu_fusion.rms_norm_grad.default``, ``getitem``): what it asks the compiler to lower
    emitted: Dict[str, int] = dataclasses.field(default_factory=dict)

    def fused(self, op: str) -> int:
        return sum(1 for s in self.sites if s.op == op)

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


class History:
    """The newest results of this process (the report and the benchmarks read them).

    Bounded, so that a long run with many recompilations does not keep every result
    alive: ``mark()`` then ``since(mark)`` gives the results added after the mark, as
    long as no more than ``limit`` were added in between.
    """

    def __init__(self, limit: int = 256):
        self._results: collections.deque = collections.deque(maxlen=limit)
        self._added = 0

    def append(self, result: FusionResult) -> None:
        self._results.append(result)
        self._added += 1

    def mark(self) -> int:
        return self._added

    def since(self, mark: int) -> List[FusionResult]:
        count = self._added - mark
        return list(self._results)[-count:] if count > 0 else []

    def clear(self) -> None:
        self._results.clear()

    def __iter__(self):
        return iter(list(self._results))

    def __len__(self) -> int:
        return len(self._results)


#: forward graphs a session keeps for backwards not compiled yet (each backward takes its own
#: out): a backward compiles when the step unwinds, after every forward of the step (a forward per
#: graph break, per compiled function, per recompile), so a step may hold many
FORWARD_GRAPHS_KEPT = 256


class _CollectionsPaused:
    """The garbage collector paused while any run of the pass is in progress. The pass allocates
    many small objects; full collections over everything Dynamo keeps alive would cost more than
    the pass itself. The collector is the process's: nested or concurrent runs pause it once,
    and the last one to end enables it again if it was enabled before the first began."""

    def __init__(self):
        self._lock = threading.Lock()
        self._depth, self._was_enabled = 0, False

    def __enter__(self):
        with self._lock:
            if self._depth == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._depth += 1

    def __exit__(self, *exc):
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._was_enabled:
                gc.enable()


_COLLECTIONS_PAUSED = _CollectionsPaused()


class PassSession:
    """What the pass keeps between its runs.

    What the pass keeps between its runs: the newest results (:class:`History`, which the
    report and the benchmarks read) and the forward graphs torchair's hook saw, by dynamo
    compile id, so the backward of the same compilation can see what its saved tensors were.
    Each run takes a session (``session=``); the hooks use :data:`DEFAULT_SESSION`."""

    def __init__(self, history_limit: int = 256, forwards_kept: int = FORWARD_GRAPHS_KEPT,
                 pause_collections: bool = True):
        self.history = History(history_limit)
        self.forwards: "collections.OrderedDict[Any, fx.Graph]" = collections.OrderedDict()
        #: the misses each remembered forward's run recorded (its sites' backwards account for them)
        self.forward_misses: Dict[Any, List[Miss]] = {}
        self.forwards_kept = forwards_kept
        #: pause the garbage collector during a run (see :class:`_CollectionsPaused`)
        self.pause_collections = pause_collections

    def remember_forward(self, gm: fx.GraphModule, graph: Optional[fx.Graph] = None) -> None:
        """Keep ``graph`` (default: ``gm``'s) as the forward of this compilation's backward."""
        key = _compile_id()
        if key is not None:
            self.forwards[key] = graph if graph is not None else gm.graph
            self.forwards.move_to_end(key)
            while len(self.forwards) > self.forwards_kept:
                self.forward_misses.pop(self.forwards.popitem(last=False)[0], None)

    def remember_forward_misses(self, misses: List[Miss]) -> None:
        """Keep the misses the pass recorded in this compilation's forward, for its backward's run."""
        key = _compile_id()
        if key in self.forwards:
            self.forward_misses[key] = list(misses)

    def forward_misses_for(self, gm: fx.GraphModule) -> List[Miss]:
        """The misses of this backward's forward (:meth:`remember_forward_misses`), taken out."""
        key = _compile_id()
        return self.forward_misses.pop(key, []) if key is not None else []

    def forward_for(self, gm: fx.GraphModule) -> Optional[fx.Graph]:
        """The forward graph of this backward, if one was remembered and provably is it.

        The forward graph remembered for this backward's compile id, if it provably is this
        backward's forward (:func:`saved_tensor_mismatch`); otherwise None, and the pass runs on
        the backward alone (a wrong forward would make the pass see wrong saved values). The
        backward takes it out: a compilation's backward compiles once, and what stays is bounded
        by the forwards whose backward has not compiled yet."""
        key = _compile_id()
        forward = self.forwards.pop(key, None) if key is not None else None
        if forward is None:
            return None
        mismatch = saved_tensor_mismatch(forward, gm.graph)
        if mismatch is not None:
            log.warning("npu_fusion: the forward graph remembered for compile %s is not this backward's (%s); "
                        "the pass runs on the backward alone", key, mismatch)
            return None
        return forward

    def collections_paused(self):
        return _COLLECTIONS_PAUSED if self.pause_collections else contextlib.nullcontext()


#: the session of the hooks and of callers that pass none
DEFAULT_SESSION = PassSession()
#: the default session's results (the report and the benchmarks read them)
HISTORY = DEFAULT_SESSION.history


class Snapshot:
    """A graph's nodes as they were, to rebuild the graph if a rewrite fails midway.

    The rewrites add nodes, rewire arguments and erase dead nodes, but never change a
    node's argument tuples, name or metadata dict in place, so holding those per node
    is a full record. It costs a tenth of copying the graph up front; the rebuild,
    on failure only, gives a graph with the same nodes, names, arguments, metadata
    and code (new node objects: erased ones cannot be put back).
    """

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.nodes = [(n, n.op, n.target, n.args, n.kwargs, n.name, n.type, n.meta) for n in graph.nodes]

    def rebuild(self) -> fx.Graph:
        old = self.graph
        new = empty_graph_like(old)
        env: Dict[fx.Node, fx.Node] = {}
        for node, op, target, args, kwargs, name, type_expr, meta in self.nodes:
            args, kwargs = fx.node.map_arg((args, kwargs), env.__getitem__)
            env[node] = rebuilt = new.create_node(op, target, args, kwargs, name=name, type_expr=type_expr)
            rebuilt.meta = meta
        return new


def _compile_id():
    return current_compile_id()


def is_backward_graph(gm: fx.GraphModule) -> bool:
    """A graph the pass rewrites: AOTAutograd's backward (it has ``tangents`` inputs), or
    the graph of a compiled-autograd compilation (the whole backward, compiled as a
    forward: torchtitan and FSDP2 users turn it on to overlap communication)."""
    return in_compiled_autograd() or any(n.op == "placeholder" and n.name.startswith("tangents")
                                         for n in gm.graph.nodes)


def is_inference_graph(gm: fx.GraphModule) -> bool:
    """A forward graph that no backward reads: AOTAutograd's inference graph (made instead of a
    joint graph under ``torch.no_grad()`` or when no input needs a gradient). AOTAutograd names a
    joint graph's inputs, and so its partition's, ``primals_*`` and ``tangents_*``; an inference
    graph's are ``arg*_*``. A compiled-autograd graph is a backward (:func:`is_backward_graph`)."""
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    return not is_backward_graph(gm) and not any(name.startswith(("primals", "tangents")) for name in names)


def in_compiled_autograd() -> bool:
    key = _compile_id()
    return getattr(key, "compiled_autograd_id", None) is not None


def remember_forward(gm: fx.GraphModule, session: Optional[PassSession] = None) -> None:
    (session or DEFAULT_SESSION).remember_forward(gm)


def forward_for(gm: fx.GraphModule, session: Optional[PassSession] = None) -> Optional[fx.Graph]:
    """The session's forward graph of this backward (:meth:`PassSession.forward_for`)."""
    return (session or DEFAULT_SESSION).forward_for(gm)


def _tensor_value(node) -> Optional[torch.Tensor]:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _shape_text(value: torch.Tensor) -> tuple:
    """Sizes compared as written (``s0``, ``16``): equal symbols are one size, and no guard is made."""
    return tuple(str(size) for size in value.shape)


def saved_tensor_mismatch(forward: fx.Graph, backward: fx.Graph) -> Optional[str]:
    """Why ``forward`` is not the forward of ``backward``, or None when it is.

    AOTAutograd's partitioners return the saved tensors as the forward's last tensor outputs
    (only saved sizes, which are not tensors, follow them) and take them, in the same order, as
    the backward's placeholders before the tangents. So the backward's k saved tensors must be
    the forward's last k tensor outputs one by one: the same name, dtype and shape.
    """
    inputs = [n for n in backward.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    unknown = [n.name for n in inputs if n.meta.get("val") is None]
    if unknown:
        return f"backward inputs {unknown} have no recorded value to compare"
    saved = [n for n in inputs if _tensor_value(n) is not None]
    outputs: List[fx.Node] = []
    for node in forward.nodes:
        if node.op == "output":
            fx.node.map_arg(node.args[0], outputs.append)
    returned = [a for a in outputs if _tensor_value(a) is not None]
    if len(returned) < len(saved):
        return f"the backward has {len(saved)} saved tensors, the forward returns {len(returned)} tensors"
    for fw, bw in zip(returned[len(returned) - len(saved):], saved):
        fv, bv = _tensor_value(fw), _tensor_value(bw)
        if fw.name != bw.name:
            return f"saved tensor {bw.name} is {fw.name} in the forward"
        if fv.dtype != bv.dtype or _shape_text(fv) != _shape_text(bv):
            return (f"saved tensor {bw.name} is {bv.dtype}{list(_shape_text(bv))} in the backward, "
                    f"{fv.dtype}{list(_shape_text(fv))} in the forward")
    return None


def fuse_backward(gm: fx.GraphModule, options: Union[FusionOptions, Mapping, None] = None,
                  forward: Optional[fx.Graph] = None, session: Optional[PassSession] = None,
                  forward_misses: List[Miss] = ()) -> FusionResult:
    """Rewrite RoPE and RMSNorm backward subgraphs of ``gm`` in place.

    ``forward``, the forward graph of the same partition, is optional; with it the
    pass can see through saved tensors (``rotate_half(q)``, the normalized input)
    and fuse their consumers too; ``forward_misses``, the misses the pass recorded in that forward,
    make each missed forward site's backward left here one miss too. Returns a :class:`FusionResult`,
    also added to the ``session``'s history (:data:`DEFAULT_SESSION`'s when none is given).
    """
    return _fuse(gm, options, forward, kind="backward", session=session, forward_misses=forward_misses)


def fuse_inference(gm: fx.GraphModule, options: Union[FusionOptions, Mapping, None] = None,
                   session: Optional[PassSession] = None) -> FusionResult:
    """Rewrite the forward RoPE and RMSNorm subgraphs of an inference graph ``gm`` in place.

    An inference graph is a forward that no backward reads: AOTAutograd makes one instead of a
    joint graph under ``torch.no_grad()`` or when no input needs a gradient (evaluation,
    ``generate()``). Only the forward rules run (:data:`INFERENCE_STAGES`), each site unpaired:
    nothing but the program reads what it computes, so a norm or a rotation fuses wherever the
    target takes it, or is one recorded miss. Returns a :class:`FusionResult` (``graph``
    ``"inference"``, added to the ``session``'s history)."""
    return _fuse(gm, options, None, kind="inference", session=session)


def fuse_forward(gm: fx.GraphModule, options: Union[FusionOptions, Mapping, None] = None,
                 session: Optional[PassSession] = None) -> FusionResult:
    """Rewrite the forward RoPE and RMSNorm subgraphs of a training forward graph ``gm``, after the partition, in place.

    Rewrite the forward RoPE and RMSNorm subgraphs of a partitioned training forward graph ``gm``
    (torchair's hook sees no joint graph) in place, keeping its contract with the backward: what it
    returns for the backward (its saved tensors) is, after the pass, the same value or provably
    equal to it (a norm's y and rstd from the fused op), and an intermediate it saves stays
    computed (:class:`~npu_fusion.patterns.evaluator.PartitionedForwardProvenance`); a site where that
    cannot hold stays, one recorded miss. Returns a :class:`FusionResult` (``graph`` ``"forward"``)."""
    return _fuse(gm, options, None, kind="forward", session=session)


def fuse_joint(gm: fx.GraphModule, options: Union[FusionOptions, Mapping, None] = None,
               copy_op: Optional[Callable] = None, partitioner: Optional[str] = None,
               session: Optional[PassSession] = None, recompile: bool = True) -> FusionResult:
    """Rewrite RoPE and RMSNorm backward subgraphs of AOTAutograd's joint graph ``gm`` in place,
    before the partition, and leave the graph ready for it (:mod:`.joint`): the partitioner then
    saves what the fused ops read. ``copy_op`` makes the forward copies of caller-reachable
    tensors (:class:`~.joint.JointGraph`; each compiler keeps a different op); ``partitioner``
    is the one that will split the graph (default: the options'). ``recompile=False`` leaves the
    module's Python code as it was, for a caller that partitions the graph next and never runs the
    joint module (the backend: a partitioner reads the graph, and min-cut regenerates the code
    itself); the code generation is a quarter of the pass at 8 layers. Returns a
    :class:`FusionResult` (added to the ``session``'s history)."""
    return _fuse(gm, options, None, kind="joint", layout=lambda graph, options: JointGraph(
        graph, copy_op, min_cut=(partitioner or options.partitioner) == "min_cut"), session=session,
        recompile=recompile)


#: the rule stages (:data:`~npu_fusion.patterns.rule.STAGES`) that run on an inference graph: the
#: forward rules (a joint-stage rule reads a joint graph's forward nodes; an inference graph is all
#: forward); a backward rule has no gradient to read there
INFERENCE_STAGES = ("joint", "forward")


def _fuse(gm: fx.GraphModule, options, forward: Optional[fx.Graph], kind: str, layout=None,
          session: Optional[PassSession] = None, recompile: bool = True, forward_misses: List[Miss] = ()) -> FusionResult:
    """The one run of the pass the entries share: snapshot, rounds, record. ``kind`` is the
    graph's: ``"joint"`` (with its ``layout``), ``"backward"`` or ``"inference"``."""
    session = session or DEFAULT_SESSION
    if not isinstance(options, FusionOptions):
        options = FusionOptions.from_mapping(options)
    target = options.resolved_target()
    result = FusionResult(target=target, nodes_before=len(gm.graph.nodes), graph=kind)
    if options.dump_graphs:
        dump_graph(f"npu_fusion: {kind} graph before the pass ({result.nodes_before} nodes, target {target}):", gm)
    trace_graph(TRACE_BEFORE, gm)
    start, cpu = time.perf_counter(), time.process_time()  # after the dump: the pass's own time
    with session.collections_paused():
        _rewrite_or_restore(gm, options, forward, layout if kind == "joint" else None, result, recompile,
                            forward_misses)
    result.seconds, result.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    result.nodes_after = len(gm.graph.nodes)
    _record(result)
    trace_graph(TRACE_AFTER, gm)
    trace_decisions(result)
    if options.dump_graphs:
        dump_graph(f"npu_fusion: {kind} graph after the pass ({result.nodes_after} nodes):", gm)
    session.history.append(result)
    return result


def _rewrite_or_restore(gm: fx.GraphModule, options, forward: Optional[fx.Graph], joint_layout,
                        result: FusionResult, recompile: bool = True, forward_misses: List[Miss] = ()) -> None:
    """Rewrite ``gm`` in place (sites, misses and copies into ``result``), or, on any failure,
    put the graph back as it was (``result.error``; ``strict`` raises). ``joint_layout(graph,
    options)`` reads a joint graph's layout (None: ``gm`` is a backward or, with ``result.graph``
    ``"inference"``, an inference graph)."""
    graph, snapshot = gm.graph, None
    try:
        snapshot = Snapshot(graph)
        # before the rewrites: what the unfused backward reads
        layout = joint_layout(graph, options) if joint_layout is not None else None
        inference = result.graph in ("inference", "forward")  # forward rules only
        if layout is not None:
            provenance = JointProvenance(graph, layout.backward, layout.min_cut)
        elif result.graph == "forward":
            provenance = PartitionedForwardProvenance(graph)
            returned = ReturnedTensors.of_partitioned_forward(graph)
        elif inference:
            provenance = InferenceProvenance(graph)
        else:
            provenance = Provenance(forward, graph)
        context = PassContext.of(graph, provenance, result.target, options.strict)
        context.forward_misses = list(forward_misses) if forward is not None else []
        result.sites, result.misses = _rewrite_in_rounds(context, options, INFERENCE_STAGES if inference else None)
        if layout is not None and result.sites:
            result.copies = [n.args[0].name for n in layout.prepare_for_partition()]
        elif result.graph == "forward" and result.sites:  # the user's outputs: no view the pass made
            result.copies = [n.args[0].name for n in returned.copy_made_views(copy_by_to_copy)]
        graph.lint()
        if result.sites:
            result.emitted = emitted_targets(snapshot, graph)
            if recompile:
                gm.recompile()
    except Exception as exc:  # the pass never makes a graph wrong: put the original back
        if snapshot is not None:
            gm.graph = snapshot.rebuild()  # the failure may have come after some rewrites (recompiles)
        if options.strict:
            raise
        result.error = f"{type(exc).__name__}: {exc}"
        result.sites, result.misses, result.copies, result.emitted = [], [], [], {}
        log.warning("npu_fusion: pass failed, graph left unchanged: %s", result.error, exc_info=True)


def emitted_target_name(target) -> str:
    """How :attr:`FusionResult.emitted` names a call's target: an op overload by its qualified
    name (``aten.stack.default``), any other callable by its name (``getitem``)."""
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def emitted_targets(snapshot: Snapshot, graph: fx.Graph) -> Dict[str, int]:
    """The calls in ``graph`` that were not in ``snapshot`` (the pass added them), counted by target."""
    before = {entry[0] for entry in snapshot.nodes}
    counts: Dict[str, int] = collections.Counter(
        emitted_target_name(n.target) for n in graph.nodes if n.op == "call_function" and n not in before)
    return dict(sorted(counts.items()))


def _record(result: FusionResult) -> None:
    """Counters and the ``npu_fusion`` log: each site fused, each miss, a summary."""
    counters = dynamo_counters(COUNTER)
    for site in result.sites:
        counters[site.op] += 1
        log.info("npu_fusion: fused %s (%s) replacing %d nodes %s", site.op, site.mode or "-",
                 len(site.replaced_nodes), site.outputs)
        if site.note:
            log.info("npu_fusion:   %s", site.note)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("npu_fusion:   inputs %s; replaced %s (%s); modelled bytes %d -> %d, fused-op minimum %d",
                      site.inputs, site.replaced_targets, ", ".join(site.replaced_nodes),
                      site.bytes_before, site.bytes_after, site.bytes_minimum)
    for miss in result.misses:
        counters[f"{miss.op}_missed"] += 1
        log.info("npu_fusion: left %s at %s unfused: %s", miss.op, miss.node, miss.reason)
    log.info("npu_fusion: %s graph %d -> %d nodes (target %s): %d fused %s, %d left unfused, %.1f ms",
             result.graph, result.nodes_before, result.nodes_after, result.target, len(result.sites),
             {op: result.fused(op) for op in sorted({s.op for s in result.sites})}, len(result.misses),
             result.seconds * 1e3)


#: rounds of the patterns over one graph: each round can only fuse sites whose dy was
#: another site's dx in the round before, and models chain at most a few such sites
MAX_ROUNDS = 4


def _rewrite_in_rounds(context: PassContext, options: FusionOptions, stages: Optional[Tuple[str, ...]] = None):
    """Run the enabled rules in rounds until a round changes nothing that another could use.

    Run the enabled rules (:data:`~npu_fusion.patterns.RULES`, in that order; only those of
    ``stages`` when given) until a
    round fuses nothing new or leaves no candidate undecided (a miss, or a candidate a
    rule's :class:`~npu_fusion.patterns.RoundReport` counts as pending): a site whose dy is
    the expression of another site's dx (post- and sandwich norms) fuses once that one is
    a fused op."""
    graph = context.graph
    running = [rule for rule in RULES if options.enables(rule) and (stages is None or rule.stage in stages)]
    context.enabled = frozenset(rule.option for rule in running)
    rules: List[Tuple[FusionRule, RuleContext]] = [(rule, RuleContext(context, rule.op.name)) for rule in running]
    guarded = isinstance(context.provenance, JointProvenance)  # compiled now: a guard still reaches Dynamo
    if guarded:
        for rule, _ in rules:
            for size in rule.static_sizes(graph):
                specialize_size(size)
    with guarding_sizes(guarded):  # the chips' size limits: proved, or kept under a guard
        return _rounds(context, rules)


def _rounds(context: PassContext, rules: List[Tuple[FusionRule, RuleContext]]):
    """The rounds of :func:`_rewrite_in_rounds`, then what no form matched, recorded."""
    graph = context.graph
    for _ in range(MAX_ROUNDS):
        fused = sum(len(ctx.sites) for _, ctx in rules)
        pending = 0
        with one_round(graph):
            for rule, ctx in rules:
                ctx.round_misses = []
                pending += _run_round(rule, graph, ctx).pending
        undecided = pending or any(ctx.round_misses for _, ctx in rules)
        if sum(len(ctx.sites) for _, ctx in rules) == fused or not undecided:
            break
    if isinstance(context.provenance, JointProvenance):  # the forward sites' misses, for their backwards
        context.forward_misses = [m for rule, ctx in rules if rule.stage != "backward" for m in ctx.misses]
    with one_round(graph):  # the rules' reports rewrite nothing: one gradient_dependent for all
        for rule, ctx in rules:  # what no form matched is a miss too, never silence
            ctx.round_misses += rule.unexplained(graph, ctx, ctx.misses)
    context.judgements.settle()  # one reason per site: a backward no form read takes its forward's
    return ([s for _, ctx in rules for s in ctx.sites], [m for _, ctx in rules for m in ctx.misses])


def _run_round(rule: FusionRule, graph: fx.Graph, ctx: RuleContext) -> RoundReport:
    """One round of one rule: its ``find``, then each match emitted as its own transaction."""
    report = rule.find(graph, ctx)
    ctx.round_misses += report.misses
    for match in report.matches:
        if ctx.has_failed(match.dx):
            continue
        if ctx.erased_under(match) is not None:  # an earlier site of this round took a node it reads
            report.pending += 1  # found again in the rewritten graph next round
            continue
        with ctx.transaction(match.dx) as tx:
            tx.outcome = rule.emit(ctx, match)
    return report


def make_torchair_pass(options: Union[FusionOptions, Mapping, None] = None, session: Optional[PassSession] = None):
    """A ``post_grad_custom_pre_pass`` for torchair: ``fn(gm, example_inputs, config)``. It fuses
    each backward graph, each inference graph (the forward rules, :func:`fuse_inference`) and each
    training forward graph (:func:`fuse_forward`: what it saves for the backward unchanged or
    provably equal). It remembers each training forward as it was before the pass in ``session``
    (:data:`DEFAULT_SESSION`): the backward's saved tensors are named after that graph's nodes, and
    its backward rules read their definitions there (the fused forward computes equal values)."""
    options = options if isinstance(options, FusionOptions) else FusionOptions.from_mapping(options)
    session = session or DEFAULT_SESSION

    def npu_fusion_pass(gm, example_inputs=None, config=None):
        if is_backward_graph(gm):
            forward, missed = session.forward_for(gm), session.forward_misses_for(gm)
            fuse_backward(gm, options, forward=forward, session=session, forward_misses=missed)
        elif is_inference_graph(gm):
            fuse_inference(gm, options, session=session)
        else:
            session.remember_forward(gm, Snapshot(gm.graph).rebuild())
            session.remember_forward_misses(fuse_forward(gm, options, session=session).misses)

    return npu_fusion_pass
