"""Hook the npu-fusion pass into torchair.

torchair runs a user FX pass on every graph it compiles, after AOTAutograd's
forward/backward partition, through ``CompilerConfig.post_grad_custom_pre_pass``
(``fn(gm, example_inputs, config) -> None``, mutating ``gm``). :func:`install`
puts the npu-fusion pass there::

    import torchair, npu_fusion
    config = npu_fusion.install(torchair.CompilerConfig(), target="a2")
    model = torch.compile(model, backend=torchair.get_npu_backend(compiler_config=config))

The pass fuses each backward graph, each inference graph (the forward rules: evaluation
and generation under ``torch.no_grad()``) and each training forward graph into the fused ops. A
training forward's partition is fixed: a site fuses there where what it saves for the backward is
unchanged or provably equal (a norm's y and rstd from the fused op), and otherwise stays, one
recorded miss (:func:`~npu_fusion.plugin.pass_manager.fuse_forward`).

A pass already set on the config keeps running, first; installing twice on the
same config replaces the earlier npu-fusion pass rather than stacking it. The
fused ops then reach GE through the converters in
:mod:`npu_fusion.lowering.ge_converters`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from ..compat import torchair_pass, torchair_pass_slot
from .options import FusionOptions

#: the attribute that marks a pass function made by :func:`install`.
_MARK = "_npu_fusion_options"


def make_pass(options: FusionOptions, previous: Optional[Callable] = None) -> Callable:
    """The ``post_grad_custom_pre_pass`` function: ``previous`` first, then npu-fusion."""
    state = {}

    def npu_fusion_pass(gm, example_inputs=None, config=None) -> None:
        if previous is not None:
            previous(gm, example_inputs, config)
        if "run" not in state:
            from . import pass_manager  # imported on first use: the pass pulls in the pattern modules

            make = getattr(pass_manager, "make_torchair_pass", None)
            if make is not None:  # every graph fused, each forward remembered unfused for its backward
                state["run"] = make(options)
            else:
                state["run"] = lambda g, _inputs=None, _config=None: pass_manager.fuse_backward(g, options)
        state["run"](gm, example_inputs, config)

    setattr(npu_fusion_pass, _MARK, options)
    npu_fusion_pass.previous = previous
    return npu_fusion_pass


def install(compiler_config=None, **options: Any):
    """Install the npu-fusion pass into a torchair ``CompilerConfig``; returns the config.

    ``options`` are :class:`~npu_fusion.plugin.options.FusionOptions` fields
    (``target``, ``rope``, ``rms_norm``, ``strict``, ``dump_graphs``), checked
    here; ``partitioner`` and ``decompositions`` are torchair's to decide, and naming
    them is an error.

    This is the path without the saved-set change: torchair's hook sees each backward
    graph after the partition, when the forward's saved set is fixed (a bf16 model still
    saves each HF-style norm's float32 upcast). The ``npu_fusion`` backend fuses the
    joint graph on an Ascend host too, with torchair's compilers. ``compiler_config=None``
    makes a fresh ``torchair.CompilerConfig()``.
    A torchair without a backward-pass hook (torch_npu 2.7.1 before its post releases)
    raises :class:`~npu_fusion.compat.UnsupportedTorchair` naming its release.
    """
    given = sorted(set(options) & {"partitioner", "decompositions"})
    if given:
        raise ValueError(f"npu_fusion.install: option(s) {given} are not honoured on this path (torchair partitions "
                         f"with its default partitioner and decomposes with its own table); compile with "
                         f"backend='npu_fusion' to choose them")
    opts = FusionOptions.from_mapping(options)
    if compiler_config is None:
        import torchair

        compiler_config = torchair.CompilerConfig()
    from ..lowering import ge_converters

    ge_converters.register()  # in case torchair became importable after npu_fusion was imported
    slot = torchair_pass_slot(compiler_config)  # raises, naming the release, where torchair has no hook
    previous = torchair_pass(compiler_config)
    if previous is not None and hasattr(previous, _MARK):  # re-install: keep what ours had chained
        previous = previous.previous
    setattr(compiler_config, slot, make_pass(opts, previous))
    return compiler_config


def installed_options(compiler_config) -> Optional[FusionOptions]:
    """The options of the npu-fusion pass installed in ``compiler_config``, or None."""
    return getattr(torchair_pass(compiler_config), _MARK, None)
