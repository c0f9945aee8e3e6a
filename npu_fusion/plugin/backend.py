"""The ``npu_fusion`` torch.compile backend.

``torch.compile(model, backend="npu_fusion", options={...})``. On an Ascend host
with torchair it compiles through torchair with the pass installed; elsewhere it
runs AOTAutograd with the pass on each backward graph, and the fused ops run on
their reference kernels.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Callable, Dict, Optional

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from ..fallback import warn_fallback
from .options import FusionOptions
from .pass_manager import fuse_backward, in_compiled_autograd
from .saved_activations import narrow_saved_activations


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


def _partition_fn(name: str):
    from torch._functorch import partitioners

    return {"default": partitioners.default_partition,
            "min_cut": partitioners.min_cut_rematerialization_partition}[name]


def _decompositions(name: str):
    if name == "core":
        from torch._decomp import core_aten_decompositions

        return core_aten_decompositions()
    return {}


def aot_backend(options: FusionOptions, around_pass: Optional[Callable] = None):
    """AOTAutograd with the pass on each backward graph, run as soon as the partitioner
    has split the joint graph, with the forward graph of the same partition for
    provenance.

    Running it at the partition rather than in the backward compiler means the
    backward graph is fused whichever way it then runs: compiled lazily on the first
    backward, or inlined into a compiled-autograd graph (which no longer tells which
    saved tensors were the same forward value). A compiled-autograd graph that reaches
    this backend is rewritten too, as a backward.

    ``around_pass(bw_gm, run)``, if given, wraps the pass call (the report, the tests and
    the benchmarks record graphs or time it); ``run()`` runs the pass and returns its
    :class:`~npu_fusion.plugin.pass_manager.FusionResult`, and ``run.forward`` is the forward
    graph it gives the pass.
    """
    partition = _partition_fn(options.partitioner)

    def fuse(bw_gm, forward):
        result = []

        def run():
            result.append(fuse_backward(bw_gm, options, forward=forward))
            return result[-1]
        run.forward = forward  # for an ``around_pass`` that keeps the graphs

        if around_pass is None:
            run()
        else:
            around_pass(bw_gm, run)
        return result[-1] if result else None

    def partition_fn(joint, joint_inputs, **kwargs):
        fw_gm, bw_gm = partition(joint, joint_inputs, **kwargs)
        result = fuse(bw_gm, fw_gm.graph)
        if options.narrow_saved and result is not None and result.sites:
            result.saved = narrow_saved_activations(fw_gm, bw_gm)
        return fw_gm, bw_gm

    def fw_compiler(fw_gm, _inputs):
        if in_compiled_autograd():  # the whole backward, compiled as an inference graph
            fuse(fw_gm, None)
        return make_boxed_func(fw_gm.forward)

    def bw_compiler(bw_gm, _inputs):
        return make_boxed_func(bw_gm.forward)

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, partition_fn=partition_fn,
                        decompositions=_decompositions(options.decompositions))


def npu_fusion_backend(gm: torch.fx.GraphModule, example_inputs, options: Optional[Dict[str, Any]] = None):
    opts = FusionOptions.from_mapping(options)
    if _on_npu_host():
        import torchair

        from .torchair import install

        config = install(torchair.CompilerConfig(), **(options or {}))
        return torchair.get_npu_backend(compiler_config=config)(gm, example_inputs)
    return aot_backend(opts)(gm, example_inputs)
