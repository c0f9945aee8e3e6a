"""Hook the npu-fusion pass into Inductor (stock, or torch_npu's) on the joint and inference graphs.

Inductor's partition runs its joint-graph passes first, and they call
``torch._inductor.config.joint_custom_pre_pass`` with the joint forward-and-backward graph;
Inductor runs the same passes on an inference graph (AOTAutograd's graph under
``torch.no_grad()`` or when no input needs a gradient, which is never partitioned) before it
compiles it. :func:`install_inductor` puts the pass there, so ``backend="inductor"`` (and
Hugging Face's Trainer with ``torch_compile_backend="inductor"``) fuses as the ``npu_fusion``
backend does: on a joint graph, the min-cut partitioner sees the fused ops and saves what they
read; on an inference graph, the forward rules fuse each norm and rotation. The fused ops are custom
ops with fake kernels, so Inductor runs them as fallback kernels (their reference kernel on a
CPU, torch_npu's on an NPU)::

    import npu_fusion
    npu_fusion.install_inductor(target="auto")
    model = torch.compile(model)  # backend="inductor"

Under ``dynamic=True`` Dynamo passes a norm's float ``eps`` as a 0-d tensor input; a second
hook, ``torch._inductor.config.pre_grad_custom_pass`` (run on Dynamo's graph before AOTAutograd),
specializes it under a guard (:mod:`.specialize`) as the ``npu_fusion`` backend does.

Inductor's table decomposes ``aten.silu`` and ``aten.silu_backward`` before its joint passes;
with a SwiGLU option on, the pass first puts them back where the graph holds exactly the trace of
their decomposition in Inductor's table (:func:`~.recompose.recompose_decomposed`), and decomposes
again into that trace what it leaves unfused (:func:`~.recompose.decompose_again`), so SwiGLU
fuses here as on the ``npu_fusion`` backend and the unfused graph is Inductor's own.

A pass already in the slot keeps running, first; installing again replaces the earlier
npu-fusion pass rather than stacking it. The pass is a ``CustomGraphPass`` whose ``uuid()``
hashes the package's sources and the options, so the FX graph cache stays valid; a chained
pass without a uuid of its own makes it None (Inductor then bypasses the cache, as it would
for that pass alone). Graphs that are not joint ones reach the pass too: inference graphs
(fused with ``fuse_inference``), and a compiled-autograd graph, which is only a backward
(fused with ``fuse_backward``).
"""
from __future__ import annotations

import pathlib
from typing import Any, Optional

from ..compat import custom_graph_pass_base, hash_for_files, inductor_config, inductor_decompositions
from .options import FusionOptions
from .recompose import decompose_again, recompose_decomposed, replace_by_decomposition

#: options Inductor decides itself: it partitions with min-cut and decomposes with its own table
NOT_HONOURED = ("partitioner", "decompositions")


def _sources() -> tuple:
    root = pathlib.Path(__file__).resolve().parent.parent
    return tuple(str(p) for sub in ("lowering", "patterns", "plugin") for p in sorted((root / sub).rglob("*.py")))


def _make_pass_class():
    class NpuFusionJointPass(custom_graph_pass_base()):
        """Inductor's ``joint_custom_pre_pass`` (joint and inference graphs): ``previous`` first,
        then npu-fusion."""

        def __init__(self, options: FusionOptions, previous: Any = None):
            self.options, self.previous = options, previous

        def __call__(self, graph) -> None:
            for previous in _as_passes(self.previous):
                previous(graph)
            from .joint import is_joint_graph
            from .pass_manager import fuse_backward, fuse_inference, fuse_joint, in_compiled_autograd

            gm = graph.owning_module
            if gm is None:
                return
            # Inductor regenerates the module's code after its joint passes (when any custom pass
            # ran): no step here recompiles it, and the SiLU traces serve both ways
            table, traces = inductor_decompositions(), {}
            recomposed = recompose_decomposed(gm, self.options, table, traces, recompile=False)
            if is_joint_graph(graph):
                result = fuse_joint(gm, self.options, copy_op=_copy_by_multiplying, partitioner="min_cut",
                                    recompile=False)
            elif in_compiled_autograd():  # the whole backward, compiled as an inference graph
                result = fuse_backward(gm, self.options)
            else:  # Inductor runs these passes on no other graph: an inference graph (no backward)
                result = fuse_inference(gm, self.options)
            decompose_again(gm, recomposed, table, traces, recompile=False)
            if result.sites or recomposed:
                decompose_what_inductor_refuses(gm, recompile=False)

        def uuid(self) -> Optional[bytes]:
            previous = [p.uuid() if hasattr(p, "uuid") else None for p in _as_passes(self.previous)]
            if any(p is None for p in previous):
                return None
            extra = repr((self.options, self.options.resolved_target(), previous))
            return hash_for_files(_sources(), extra)

    return NpuFusionJointPass


class NpuFusionPreGradPass:
    """Inductor's ``pre_grad_custom_pass``: ``previous`` first, then the model constants specialized.

    It has no ``uuid()`` on purpose: Inductor then runs it before its caches' lookups (the
    "early" timing), so the key hashes the graph with the constants in it and every compile,
    a cache hit too, installs the guard; a pass run after the lookup would reuse a graph
    specialized to another eps with no guard."""

    def __init__(self, previous: Any = None):
        self.previous = previous
        self.timing = None  # the pre_grad_pass_timing installing it set, restored by uninstalling

    def __call__(self, graph) -> None:
        for previous in _as_passes(self.previous):
            previous(graph)
        from .specialize import specialize_model_constants

        if graph.owning_module is not None:
            specialize_model_constants(graph.owning_module)


def _copy_by_multiplying(graph, fake_mode, value):
    """A copy Inductor keeps: ``x * 1`` (exact for every float; Inductor removes a ``clone``, a
    same-dtype convert and ``_to_copy`` has no lowering, only a decomposition)."""
    import torch

    from ..patterns.rewrite import call

    return call(graph, fake_mode, torch.ops.aten.mul.Tensor, (value, 1))


def decompose_what_inductor_refuses(gm, recompile: bool = True) -> int:
    """Decompose, in place and with Inductor's own table, each call Inductor's lowering would refuse.

    Those are the ATen ops the pass emits after AOTAutograd decomposed the graph (casts, ones of
    a norm without weight or input gradient, a rotation table rebuilt by ``stack`` or
    ``repeat_interleave``...) that Inductor only knows by their decomposition: its implicit
    fallback asserts there is none. ``recompile=False`` leaves the module's code for the caller to
    regenerate. Returns how many calls were decomposed."""
    from ..compat import inductor_refuses
    from ..patterns.context import fake_mode_of

    refused = [n for n in gm.graph.nodes if n.op == "call_function" and inductor_refuses(n.target)]
    if refused:
        table, fake_mode = inductor_decompositions(), fake_mode_of(gm.graph)
        for node in refused:
            replace_by_decomposition(gm, node, table, fake_mode)
        gm.graph.lint()
        if recompile:
            gm.recompile()
    return len(refused)


def _as_passes(slot) -> tuple:
    if slot is None:
        return ()
    return tuple(slot) if isinstance(slot, (list, tuple)) else (slot,)


_PASS_CLASS = []


def joint_pass(options: FusionOptions, previous: Any = None):
    """The ``CustomGraphPass`` running the npu-fusion pass on Inductor's joint graphs."""
    if not _PASS_CLASS:
        _PASS_CLASS.append(_make_pass_class())
    return _PASS_CLASS[0](options, previous)


def install_inductor(**options: Any):
    """Install the npu-fusion pass into ``torch._inductor.config.joint_custom_pre_pass``; returns
    the pass. The specializing pass goes into ``pre_grad_custom_pass`` (chained the same way).
    ``options`` are :class:`~npu_fusion.plugin.options.FusionOptions` fields; ``partitioner`` and ``decompositions`` are Inductor's own to decide, and naming them is an
    error (use ``backend="npu_fusion"`` to choose them)."""
    given = sorted(set(options) & set(NOT_HONOURED))
    if given:
        raise ValueError(f"npu_fusion.install_inductor: option(s) {given} are not honoured on this path (Inductor "
                         f"partitions with min-cut and decomposes with its own table); compile with "
                         f"backend='npu_fusion' to choose them")
    opts = FusionOptions.from_mapping(options)
    config = inductor_config()
    previous = config.joint_custom_pre_pass
    if previous is not None and isinstance(previous, _PASS_CLASS[0] if _PASS_CLASS else ()):
        previous = previous.previous  # re-install: keep what ours had chained
    config.joint_custom_pre_pass = joint_pass(opts, previous)
    _install_pre_grad(config, opts)
    return config.joint_custom_pre_pass


def _install_pre_grad(config, options: FusionOptions) -> None:
    """Put (or, where no enabled rule reads a constant float, take) the specializing pass in ``pre_grad_custom_pass``."""
    from .specialize import reads_constant_floats

    _uninstall_pre_grad(config)
    if reads_constant_floats(options):
        config.pre_grad_custom_pass = NpuFusionPreGradPass(config.pre_grad_custom_pass)
        if getattr(config, "pre_grad_pass_timing", None) == "default":  # what a pass without uuid gets, said once
            config.pre_grad_pass_timing = config.pre_grad_custom_pass.timing = "early"


def _uninstall_pre_grad(config) -> None:
    current = config.pre_grad_custom_pass
    if isinstance(current, NpuFusionPreGradPass):
        config.pre_grad_custom_pass = current.previous
        if current.timing is not None and config.pre_grad_pass_timing == current.timing:
            config.pre_grad_pass_timing = "default"


def uninstall_inductor() -> None:
    """Take the npu-fusion passes out of ``joint_custom_pre_pass`` and ``pre_grad_custom_pass``, leaving what they chained."""
    config = inductor_config()
    current = config.joint_custom_pre_pass
    if _PASS_CLASS and isinstance(current, _PASS_CLASS[0]):
        config.joint_custom_pre_pass = current.previous
    _uninstall_pre_grad(config)
