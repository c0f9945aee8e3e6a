"""The ``npu_fusion`` torch.compile backend.

``torch.compile(model, backend="npu_fusion", options={...})``. On an Ascend host
with torchair it compiles through torchair with the pass installed; elsewhere it
runs AOTAutograd with the pass on each joint graph, before the partition, and the
fused ops run on their reference kernels.
"""
from __future__ import annotations

import copy
import importlib.util
from typing import Any, Callable, Dict, Optional

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from .options import FusionOptions
from .pass_manager import fuse_backward, fuse_joint, in_compiled_autograd
from .saved_activations import saved_set


def _on_npu_host() -> bool:
    if importlib.util.find_spec("torch_npu") is None or importlib.util.find_spec("torchair") is None:
        return False
    try:
        import torch_npu  # noqa: F401

        return bool(torch.npu.is_available())
    except Exception:
        return False


def _partition_fn(name: str):
    from torch._functorch import partitioners

    return {"default": partitioners.default_partition,
            "min_cut": partitioners.min_cut_rematerialization_partition}[name]


def _decompositions(name: str):
    if name == "core":
        from torch._decomp import core_aten_decompositions

        return core_aten_decompositions()
    return {}


def aot_backend(options: FusionOptions, around_pass: Optional[Callable] = None, stage: str = "joint"):
    """AOTAutograd with the pass on each joint graph, run inside ``partition_fn`` before the
    partitioner splits it (:func:`~npu_fusion.plugin.pass_manager.fuse_joint`), so the
    partitioner sees the fused ops and saves what they read.

    Fusing at the partition rather than in the backward compiler means the backward graph is
    fused whichever way it then runs: compiled lazily on the first backward, or inlined into
    a compiled-autograd graph. A compiled-autograd graph that reaches this backend (it is only
    a backward) is rewritten too, with :func:`~npu_fusion.plugin.pass_manager.fuse_backward`.

    ``stage="backward"`` runs the pass on the backward graph after the partition instead, with
    the forward graph of the same partition for provenance: what torchair's post-partition hook
    does, for tests and benchmarks that compare the two (the saved set is then the one chosen
    for the unfused backward).

    ``around_pass(gm, run)``, if given, wraps the pass call (the report, the tests and the
    benchmarks record graphs or time it): ``gm`` is the graph the pass rewrites, ``run()`` runs
    the pass and returns its :class:`~npu_fusion.plugin.pass_manager.FusionResult`;
    ``run.stage`` is ``"joint"`` or ``"backward"``, ``run.forward`` the forward graph given for
    provenance (backward stage), ``run.split(joint_gm)`` partitions a joint graph as this
    backend does (a copy taken before ``run()`` gives the unfused partition), and
    ``run.partitioned`` is ``(forward, backward)`` once the backend has partitioned.
    """
    if stage not in ("joint", "backward"):
        raise ValueError(f"stage must be 'joint' or 'backward', got {stage!r}")
    partition = _partition_fn(options.partitioner)

    def fuse(gm, forward, split=None):
        result = []

        def run():
            joint = stage == "joint" and split is not None
            result.append(fuse_joint(gm, options) if joint else fuse_backward(gm, options, forward=forward))
            return result[-1]
        run.stage, run.forward, run.split, run.partitioned = stage, forward, split, None

        if around_pass is None:
            run()
        else:
            around_pass(gm, run)
        return (result[-1] if result else None), run

    def partition_fn(joint, joint_inputs, **kwargs):
        def split(gm):
            return partition(gm, joint_inputs, **kwargs)

        if stage == "joint":
            result, run = fuse(joint, None, split)
            fw_gm, bw_gm = split(joint)
        else:
            fw_gm, bw_gm = split(joint)
            result, run = fuse(bw_gm, fw_gm.graph, split)
        run.partitioned = (fw_gm, bw_gm)
        if result is not None:
            result.saved = saved_set(fw_gm, bw_gm)
        return fw_gm, bw_gm

    def fw_compiler(fw_gm, _inputs):
        if in_compiled_autograd():  # the whole backward, compiled as an inference graph
            fuse(fw_gm, None)
        return make_boxed_func(fw_gm.forward)

    def bw_compiler(bw_gm, _inputs):
        return make_boxed_func(bw_gm.forward)

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, partition_fn=partition_fn,
                        decompositions=_decompositions(options.decompositions))


def run_keeping_unfused(gm: torch.fx.GraphModule, run):
    """For an ``around_pass``: run the pass and return ``(result, backward graph, saved set)`` of
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


def npu_fusion_backend(gm: torch.fx.GraphModule, example_inputs, options: Optional[Dict[str, Any]] = None):
    opts = FusionOptions.from_mapping(options)
    if _on_npu_host():
        import torchair

        from .torchair import install

        config = install(torchair.CompilerConfig(), **(options or {}))
        return torchair.get_npu_backend(compiler_config=config)(gm, example_inputs)
    return aot_backend(opts)(gm, example_inputs)
