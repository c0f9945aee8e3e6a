"""The one recording backend of the report, the tests and the benchmarks.

The one recording backend of the report, the tests and the benchmarks: the ``npu_fusion``
backend's AOTAutograd with the real pass, keeping each graph's backward before and after the
pass, the pass's :class:`~npu_fusion.plugin.pass_manager.FusionResult` s, and how many times
each graph ran (:mod:`.runs`).

The pass runs where the ``npu_fusion`` backend runs it (``fuse_joint`` on each joint graph), or
with ``stage="backward"`` after the partition (torchair's hook). ``before`` is the backward graph
without the pass (on the joint stage the partition of the joint graph as it was), ``after`` the
backward the backend partitioned. :class:`InductorRecorder` reads the same from stock Inductor,
which hands over no graph (no op counts there), and :class:`TorchairRecorder` from torchair's
own backend after ``npu_fusion.install`` (the pass after torchair's partition).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Callable, Dict, List, Optional

import torch

from ..compat import OpOverload, decompositions_of, math_attention
from ..plugin.backend import aot_backend, fused_backward, run_keeping_unfused
from ..plugin.options import FusionOptions
from ..plugin.pass_manager import FusionResult
from .runs import count_calls, count_graph_runs, runs_of
from .timing import Clock


def _target_name(target, qualified: bool) -> str:
    if qualified and isinstance(target, OpOverload):
        return str(target)  # aten.mul.Tensor
    return getattr(target, "__name__", str(target))  # mul.Tensor


def op_counts(graph: torch.fx.Graph, qualified: bool = False) -> collections.Counter:
    """Calls per target: ``mul.Tensor``, or with ``qualified`` ``aten.mul.Tensor`` (the report's)."""
    return collections.Counter(_target_name(n.target, qualified) for n in graph.nodes if n.op == "call_function")


class Recorder:
    """A torch.compile backend running the pass as the ``npu_fusion`` backend does, recording it.

    ``decompositions``: a decomposition table of its own for AOTAutograd (Inductor's
    ``select_decomp_table()``), instead of the options' ``decompositions``. ``fuse=False`` keeps
    the backward graph modules (``backwards``) and their partitions' forward graphs
    (``partition_forwards``) without running the pass, for tests and profiles that run
    ``fuse_backward`` themselves (the stage then defaults to ``"backward"``). ``module_paths``
    keeps each node's module path, read before the pass replaces nodes (the report's). Each graph
    is announced to ``on_graph(gm, run)`` before the pass runs on it."""

    def __init__(self, options: FusionOptions, fuse: bool = True, stage: Optional[str] = None,
                 decompositions: Optional[dict] = None, module_paths: bool = False,
                 on_graph: Optional[Callable] = None):
        self.options, self.table, self.fuse = options, decompositions, fuse
        #: where the pass runs: on the joint graph (the backend's way), or on the backward
        #: graph after the partition (torchair's hook; what ``fuse=False`` keeps by default)
        self.stage = stage or ("joint" if fuse else "backward")
        self.module_paths, self.on_graph = module_paths, on_graph
        self.before: List[torch.fx.Graph] = []
        self.results: List[FusionResult] = []
        self._after: List[Callable[[], torch.fx.Graph]] = []  # per result, once partitioned
        self.forwards = []  # the forward graphs dynamo handed over, one per compiled graph
        #: the backward graph modules and the forward graph of each one's partition
        self.backwards, self.partition_forwards = [], []
        #: per graph through the pass (parallel to ``results``), the key of the graph whose runs
        #: count its runs (:func:`~.runs.count_graph_runs`; None until a joint graph is partitioned)
        self.run_keys: List[Optional[int]] = []
        #: per graph through the pass: each node's module path (empty unless ``module_paths``)
        self.paths: List[Dict[str, str]] = []
        #: per graph through the pass: what the partition saves without the pass (a joint graph's)
        self.saved_before: List[Optional[Any]] = []
        #: CPU seconds this recorder spent around the pass (copies, the unfused partition): no
        #: part of a compile, taken out of the step's time (:func:`~.timing.pass_share`)
        self.recording_cpu = 0.0

    def backend(self):
        """The AOTAutograd backend (``.kwargs`` are its compilers, partitioner and decompositions)."""
        return aot_backend(self.options, self._around_pass, stage=self.stage, decompositions=self.table)

    def __call__(self, gm, example_inputs):
        self.forwards.append(gm.graph)
        return self.backend()(gm, example_inputs)

    def aot_function(self, fn):
        """``fn`` through AOTAutograd alone (no dynamo), with the pass as in :meth:`__call__`."""
        from ..compat import aot_function

        return aot_function(fn, **self.backend().kwargs)

    def _around_pass(self, gm, run):
        if run.stage == "backward" or (run.stage == "joint" and run.split is None):
            self.backwards.append(gm)
            self.partition_forwards.append(run.forward)
        if not self.fuse:
            return
        with Clock() as around:
            if self.on_graph is not None:
                self.on_graph(gm, run)
            self.paths.append({n.name: nearest_module_path(n) for n in gm.graph.nodes} if self.module_paths else {})
            result, before, saved_before = run_keeping_unfused(gm, run)
            self.results.append(result)
            self.before.append(before)
            self.saved_before.append(saved_before)
            self._after.append(fused_backward(gm, run))
            count_graph_runs(gm, run, self.run_keys)
        self.recording_cpu += around.cpu - result.cpu_seconds

    def installed(self):
        """What must surround the compiled step (nothing for this backend)."""
        return contextlib.nullcontext()

    @property
    def runs(self) -> List[int]:
        """How many times each graph through the pass ran so far (parallel to ``results``)."""
        return runs_of(self.run_keys)

    @property
    def after(self) -> List[torch.fx.Graph]:
        """The backward graphs after the pass (partitioned ones once the compile has run)."""
        return [after() for after in self._after]

    def fused(self, op: str) -> int:
        """Fused sites in the graphs (each once, however often its graph ran)."""
        return sum(r.fused(op) for r in self.results)

    def fused_runs(self, op: str) -> int:
        """Fused sites as they ran: each graph's sites times the runs of that graph."""
        return sum(r.fused(op) * n for r, n in zip(self.results, self.runs))

    def before_counts(self, qualified: bool = False) -> List[collections.Counter]:
        return [op_counts(g, qualified) for g in self.before]

    def after_counts(self, qualified: bool = False) -> collections.Counter:
        """Op counts over every backward graph after the pass."""
        total = collections.Counter()
        for g in self.after:
            total += op_counts(g, qualified)
        return total

    def misses(self):
        return [m for r in self.results for m in r.misses]


class InductorRecorder(Recorder):
    """Stock Inductor after ``install_inductor``, the pass inside its partition. The pass's
    results are read from ``HISTORY``; Inductor hands over no graph, so ``before`` and
    ``after`` stay empty."""

    def __call__(self, gm, example_inputs):
        from ..compat import inductor_backend
        from ..plugin.pass_manager import HISTORY

        mark = HISTORY.mark()
        if self.on_graph is not None:
            self.on_graph(None, None)
        compiled = inductor_backend()(gm, example_inputs)
        new = HISTORY.since(mark)
        self.results.extend(new)
        self.paths.extend({} for _ in new)
        self.saved_before.extend(None for _ in new)
        key, counted = count_calls(compiled)
        self.run_keys.extend(key for _ in new)
        return counted

    @contextlib.contextmanager
    def installed(self):
        """The pass installed, and the compile caches off (a cache hit skips the joint passes)."""
        from ..compat import no_compile_caches
        from ..plugin.inductor import install_inductor, uninstall_inductor

        install_inductor(**{k: v for k, v in dataclasses.asdict(self.options).items()
                            if k not in ("partitioner", "decompositions")})
        try:
            with no_compile_caches():
                yield
        finally:
            uninstall_inductor()


class TorchairRecorder(InductorRecorder):
    """torchair's own backend (``torchair.get_npu_backend``) with ``npu_fusion.install``: the pass
    in its post-grad hook, on each graph after torchair's partition. torchair compiles a
    backward graph when it first runs, so the results are read from ``HISTORY`` when the step is
    over (the end of :meth:`installed`), and each is counted with its forward graph's runs: the
    forward graphs compile in order, the backward graphs in the reverse order of their forwards. Off an NPU, torchair builds
    the GE graphs and runs the FX graphs eagerly (``debug.run_eagerly``), and two CPU ops that
    torch_npu would replace on an NPU get forms GE converts: ``aten.silu_backward`` decomposed,
    attention in PyTorch's math SDPA (the CPU's flash-attention op has no converter)."""

    def __init__(self, options: FusionOptions, on_graph: Optional[Callable] = None):
        super().__init__(options, on_graph=on_graph)
        self._forward_keys: List[int] = []

    def __call__(self, gm, example_inputs):
        import torchair

        from ..plugin.torchair import install

        if self.on_graph is not None:
            self.on_graph(None, None)
        config = install(torchair_config(), **{k: v for k, v in dataclasses.asdict(self.options).items()
                                               if k not in ("partitioner", "decompositions")})
        stand_ins = {} if on_npu() else decompositions_of(torch.ops.aten.silu_backward)
        backend = torchair.get_npu_backend(compiler_config=config, custom_decompositions=stand_ins)
        key, counted = count_calls(backend(gm, example_inputs))
        self._forward_keys.append(key)
        return counted

    @contextlib.contextmanager
    def installed(self):
        from ..plugin.pass_manager import HISTORY

        mark = HISTORY.mark()
        try:
            with contextlib.nullcontext() if on_npu() else math_attention():
                yield
        finally:
            new = HISTORY.since(mark)
            self.results.extend(new)
            self.paths.extend({} for _ in new)
            self.saved_before.extend(None for _ in new)
            self.run_keys.extend(self._keys_of(new))

    def _keys_of(self, results: List[FusionResult]) -> List[int]:
        """Each result's graph key: a forward or inference graph's in compile order (the newest
        forwards'), a backward's in the reverse order (backwards compile as the step unwinds)."""
        ahead = sum(r.graph != "backward" for r in results)
        forwards = iter(self._forward_keys[len(self._forward_keys) - ahead:])
        backwards = iter(reversed(self._forward_keys))
        return [next(backwards if r.graph == "backward" else forwards) for r in results]


def torchair_config():
    """A fresh ``torchair.CompilerConfig``; off an NPU, one that runs the compiled graphs eagerly."""
    import torchair

    config = torchair.CompilerConfig()
    config.debug.run_eagerly = not on_npu()
    return config


def on_npu() -> bool:
    npu = getattr(torch, "npu", None)
    return npu is not None and npu.is_available()


def module_path(node: torch.fx.Node) -> str:
    """The path of the module whose forward made ``node``, such as ``layers.0.attn``.

    The module whose forward made ``node`` (AOTAutograd copies the forward node's
    ``nn_module_stack`` onto a backward node, as ``fwd_nn_module_stack`` or, recomputed, as
    ``nn_module_stack``), relative to the outermost module of the stack: ``layers.0.attn``; ""
    for none or for the outermost module itself."""
    stack = node.meta.get("fwd_nn_module_stack") or node.meta.get("nn_module_stack")
    if not stack:
        return ""
    paths = [entry[0] for entry in stack.values()]
    root, inner = paths[0], paths[-1]
    return inner[len(root) + 1:] if inner.startswith(root + ".") else ""


def nearest_module_path(node: torch.fx.Node, limit: int = 32) -> str:
    """``node``'s module path, or the nearest one among its inputs (a gradient accumulation, the
    node a miss names, often belongs to no module), looking at ``limit`` nodes at most."""
    queue, seen, index = [node], {node}, 0
    while index < min(len(queue), limit):
        current, index = queue[index], index + 1
        path = module_path(current)
        if path:
            return path
        for source in current.all_input_nodes:
            if source not in seen:
                seen.add(source)
                queue.append(source)
    return ""
