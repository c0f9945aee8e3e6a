"""Fuse the decomposed RoPE and RMSNorm subgraphs of AOTAutograd's graphs into Ascend fused ops.

npu-fusion is a ``torch.compile`` graph pass; :func:`install_inductor`, :func:`install` (torchair)
and the ``npu_fusion`` backend put it into a compiler, :func:`explain` reports what it did.
"""
import warnings

with warnings.catch_warnings():
    # torch says once, when its fake-tensor machinery is first imported, that NumPy is missing;
    # npu-fusion uses no NumPy, so that notice is noise here (a NumPy call elsewhere still raises)
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    from . import lowering  # noqa: F401  (registers torch.ops.npu_fusion)

__version__ = "0.1.0"


def install(config=None, **options):
    """Install the npu-fusion pass into a torchair ``CompilerConfig`` (see
    :func:`npu_fusion.plugin.torchair.install`); returns the config. The path without the
    saved-set change (the pass sees each backward graph after the partition):
    ``backend="npu_fusion"`` fuses the joint graph on an Ascend host too. Under ``dynamic=True``
    compile with :func:`get_npu_backend` rather than torchair's, so a norm's eps is specialized."""
    from .plugin.torchair import install as _install

    return _install(config, **options)


def get_npu_backend(*, compiler_config, **kwargs):
    """torchair's backend for a config :func:`install` set up, with the float constants ``dynamic=True``
    passes as inputs (a norm's eps) specialized under a guard first (see
    :func:`npu_fusion.plugin.torchair.get_npu_backend`)."""
    from .plugin.torchair import get_npu_backend as _get

    return _get(compiler_config=compiler_config, **kwargs)


def explain(model_or_fn, *example_inputs, **kwargs):
    """Compile ``model_or_fn`` with the pass, run one training step on ``example_inputs`` and
    report what was fused, what was not and why, and whether the gradients are still right
    (:func:`npu_fusion.report.explain`)."""
    from .report import explain as _explain

    return _explain(model_or_fn, *example_inputs, **kwargs)


def install_inductor(**options):
    """Install the npu-fusion pass into Inductor's joint-graph hook
    (``torch._inductor.config.joint_custom_pre_pass``; see
    :func:`npu_fusion.plugin.inductor.install_inductor`); returns the pass."""
    from .plugin.inductor import install_inductor as _install

    return _install(**options)
