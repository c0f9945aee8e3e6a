"""The report as an application above :mod:`npu_fusion.plugin`: :func:`explain` (one training step
of the user's own module or function with the pass, reported), the full-size analysis of a
transformers config on fake tensors (:mod:`.fullsize`) and the HTML page (:mod:`.html`).

Nothing in ``plugin/`` imports this package. The step, its recording backend, the gradient
comparison and the text tables are :mod:`npu_fusion.plugin.report`'s, which the command line's
report uses too (its :func:`~npu_fusion.plugin.report.analyse`), so both print the same text and
serialize to the same JSON.
"""
__all__ = ["Explanation", "explain"]


def __getattr__(name):
    # imported on first use, not with the package: ``TORCH_LOGS=npu_fusion`` makes torch walk
    # npu_fusion's packages while torch is still being imported, and importing the pass from
    # there registered its logger in the middle of torch's own log set-up (every line logged twice)
    if name in __all__:
        from . import explanation

        return getattr(explanation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
