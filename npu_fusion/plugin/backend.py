"""The ``npu_fusion`` torch.compile backend.

``torch.compile(model, backend="npu_fusion", options={...})``. It runs AOTAutograd with
the pass on each joint graph, before the partition, and on each inference graph (the
forward rules: evaluation, generation), everywhere: on an Ascend host with
torchair's compilers and decompositions (GE compiles both graphs), elsewhere with the
graphs run as they are (the fused ops on their reference kernels).
"""
from __future__ import annotations

import copy
import importlib.util
from typing import Any, Callable, Dict, Optional

import torch

from ..compat import aot_autograd, core_aten_decompositions, make_boxed_func, partition_function
from ..fallback import warn_fallback
from .options import FusionOptions
from .pass_manager import fuse_backward, fuse_inference, fuse_joint, in_compiled_autograd
from .recompose import decompose_again, recompose_decomposed
from .saved_activations import saved_set
from .specialize import specializing


def _on_npu_host() -> bool:
    if importlib.util.find_spec("torch_npu") is None or importlib.util.find_spec("torchair") is None:
        return False
    try:
        import torch_npu  # noqa: F401

        return bool(torch.npu.is_available())
    except Exception as error:  # torch_npu and torchair are installed: this is meant to be an NPU host
        warn_fallback("backend", f"backend='npu_fusion' could not ask torch_npu for an NPU ({type(error).__name__}: "
                                 f"{error}), so it compiles for the CPU (AOTAutograd, reference kernels), not "
                                 f"through torchair. Fix torch_npu/CANN, or use torchair's backend with "
                                 f"npu_fusion.install(config)")
        return False


def _decompositions(name: str):
    return core_aten_decompositions() if name == "core" else {}


def aot_backend(options: FusionOptions, around_pass: Optional[Callable] = None, stage: str = "joint",
                compiler: Optional[Callable] = None, decompositions: Optional[dict] = None, **aot_options):
    """AOTAutograd with the pass on each joint graph, run inside ``partition_fn`` before the
    partitioner splits it (:func:`~npu_fusion.plugin.pass_manager.fuse_joint`), so the
    partitioner sees the fused ops and saves what they read.

    Fusing at the partition rather than in the backward compiler means the backward graph is
    fused whichever way it then runs: compiled lazily on the first backward, or inlined into
    a compiled-autograd graph. A compiled-autograd graph that reaches this backend (it is only
    a backward) is rewritten too, with :func:`~npu_fusion.plugin.pass_manager.fuse_backward`.
    An inference graph (AOTAutograd makes one instead of a joint graph under ``torch.no_grad()``
    or when no input needs a gradient) gets the forward rules,
    :func:`~npu_fusion.plugin.pass_manager.fuse_inference`, before it is compiled.

    ``stage="backward"`` runs the pass on the backward graph after the partition instead, with
    the forward graph of the same partition for provenance: what torchair's post-partition hook
    does, for tests and benchmarks that compare the two (the saved set is then the one chosen
    for the unfused backward).

    ``around_pass(gm, run)``, if given, wraps the pass call (the report, the tests and the
    benchmarks record graphs or time it): ``gm`` is the graph the pass rewrites, ``run()`` runs
    the pass and returns its :class:`~npu_fusion.plugin.pass_manager.FusionResult`;
    ``run.stage`` is ``"joint"``, ``"backward"`` or ``"inference"``, ``run.forward`` the forward graph given for
    provenance (backward stage), ``run.split(joint_gm)`` partitions a joint graph as this
    backend does (a copy taken before ``run()`` gives the unfused partition), and
    ``run.partitioned`` is ``(forward, backward)`` once the backend has partitioned.

    ``compiler(gm, example_inputs)`` compiles the forward, backward and inference graphs
    (default: run them as they are); ``decompositions`` replaces the table the ``decompositions``
    option names; ``aot_options`` go to ``aot_autograd`` (the torchair path's, below). Where the
    table decomposes an op the SwiGLU rules read whole (``silu``, ``silu_backward``), the pass
    puts it back where the graph holds exactly that table's trace of it, and decomposes again
    what it leaves unfused (:mod:`.recompose`).
    """
    if stage not in ("joint", "backward"):
        raise ValueError(f"stage must be 'joint' or 'backward', got {stage!r}")
    partition = partition_function(options.partitioner)
    table = decompositions if decompositions is not None else _decompositions(options.decompositions)
    fuse = _fuser(options, stage, around_pass, table)

    def partition_fn(joint, joint_inputs, **kwargs):
        def split(gm):
            return partition(gm, joint_inputs, **kwargs)

        if stage == "joint":
            result, run = fuse(joint, None, split)
            fw_gm, bw_gm = split(joint)
        else:
            fw_gm, bw_gm = split(joint)
            result, run = fuse(bw_gm, fw_gm.graph, split)
        _partitioned(run, result, fw_gm, bw_gm)
        return fw_gm, bw_gm

    def fw_compiler(fw_gm, inputs):
        if in_compiled_autograd():  # the whole backward, compiled as an inference graph
            fuse(fw_gm, None)
        return compiler(fw_gm, inputs) if compiler is not None else make_boxed_func(fw_gm.forward)

    def bw_compiler(bw_gm, inputs):
        return compiler(bw_gm, inputs) if compiler is not None else make_boxed_func(bw_gm.forward)

    def inference_compiler(gm, inputs):
        if not in_compiled_autograd():  # fw_compiler fuses a compiled-autograd graph as a backward
            fuse(gm, None, inference=True)
        return fw_compiler(gm, inputs)

    aot = aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, inference_compiler=inference_compiler,
                       partition_fn=partition_fn, decompositions=table, **aot_options)
    return specializing(aot, options)


def _fuser(options: FusionOptions, stage: str, around_pass: Optional[Callable], table: Optional[dict] = None):
    """The function that runs the pass on a graph, through ``around_pass`` when there is one.

    ``fuse(gm, forward, split=None, inference=False) -> (result, run)``: the pass on ``gm`` (a
    joint graph when ``split``, the partition function, is given on the joint stage; an inference
    graph with ``inference``; else a backward graph). ``table`` is the decomposition table
    AOTAutograd traced ``gm`` with: the ops the rules read whole that it decomposed are put back
    before the pass where the graph holds exactly their decomposition, and those left unfused
    decomposed again after it (:mod:`.recompose`)."""
    def fuse(gm, forward, split=None, inference=False):
        result = []

        def run():
            joint = stage == "joint" and split is not None and not inference  # partitioned next, never run
            traces = {}  # SiLU's traces, shared by the recomposition and its undoing
            recomposed = recompose_decomposed(gm, options, table, traces, recompile=not joint)
            if inference:
                result.append(fuse_inference(gm, options))
            elif joint:
                result.append(fuse_joint(gm, options, recompile=False))
            else:
                result.append(fuse_backward(gm, options, forward=forward))
            decompose_again(gm, recomposed, table, traces, recompile=not joint)
            return result[-1]
        run.stage = "inference" if inference else stage
        run.forward, run.split, run.partitioned = forward, split, None
        run.after_partition = []  # callbacks(forward, backward) once a joint graph is partitioned

        if around_pass is None:
            run()
        else:
            around_pass(gm, run)
        return (result[-1] if result else None), run

    return fuse


def _partitioned(run, result, fw_gm, bw_gm) -> None:
    """Once the backend has partitioned: the partition for an ``around_pass`` (and its callbacks),
    and the saved set on the pass's result."""
    run.partitioned = (fw_gm, bw_gm)
    for callback in run.after_partition:
        callback(fw_gm, bw_gm)
    if result is not None:
        result.saved = saved_set(fw_gm, bw_gm)


def run_keeping_unfused(gm: torch.fx.GraphModule, run):
    """Run the pass and keep the backward graph and saved set of the program without it.

    For an ``around_pass``: run the pass and return ``(result, backward graph, saved set)`` of
    the program without the pass; on a joint graph, the partition of a copy taken before the
    pass, else a copy of the backward graph (its saved set is the one the partition keeps: None)."""
    if run.stage == "joint" and run.split is not None:
        unfused = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # its attributes shared, not copied
        result = run()
        fw_gm, bw_gm = run.split(unfused)
        return result, bw_gm.graph, saved_set(fw_gm, bw_gm)
    before = copy.deepcopy(gm.graph)
    return run(), before, None


def fused_backward(gm: torch.fx.GraphModule, run) -> Callable[[], torch.fx.Graph]:
    """For an ``around_pass``: the backward graph after the pass, once the backend has
    partitioned (call the returned function after the compile)."""
    if run.stage == "joint" and run.split is not None:
        return lambda: run.partitioned[1].graph
    return lambda: gm.graph


def torchair_backend(options: FusionOptions, compiler_config=None):
    """The backend on an Ascend host, with torchair's compilers and decompositions.

    AOTAutograd runs the pass on the joint graph, as elsewhere; torchair's compiler
    (``torchair.get_compiler(config)``) compiles the forward, backward and inference graphs,
    with torchair's decompositions, so GE compiles both graphs and the fused ops reach it
    through their converters. Every option is honoured:
    ``partitioner`` picks the partition, ``decompositions="core"`` adds core ATen's table
    under torchair's."""
    import torchair

    from ..compat import torchair_decompositions
    from ..lowering import ge_converters

    ge_converters.register()  # in case torchair became importable after npu_fusion was imported
    config = compiler_config if compiler_config is not None else torchair.CompilerConfig()
    table = dict(_decompositions(options.decompositions))
    table.update(torchair_decompositions(config))
    return aot_backend(options, compiler=torchair.get_compiler(config), decompositions=table,
                       keep_inference_input_mutations=True)


def get_backend(options: Optional[Dict[str, Any]] = None, *, torchair_config=None,
                ascend_host: Optional[bool] = None):
    """The ``npu_fusion`` backend for ``options``: :func:`torchair_backend` on an Ascend host
    (``ascend_host``: detected when None; tests set it), :func:`aot_backend` elsewhere.
    ``torchair_config`` is the ``torchair.CompilerConfig`` to compile with on an Ascend host."""
    opts = FusionOptions.from_mapping(options)
    if ascend_host is None:
        ascend_host = _on_npu_host()
    if ascend_host:
        return torchair_backend(opts, torchair_config)
    if torchair_config is not None:
        raise ValueError("npu_fusion backend: torchair_config is only used on an Ascend host (none here)")
    return aot_backend(opts)


def npu_fusion_backend(gm: torch.fx.GraphModule, example_inputs, options: Optional[Dict[str, Any]] = None):
    return get_backend(options)(gm, example_inputs)
