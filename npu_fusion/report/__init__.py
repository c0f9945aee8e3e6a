"""The report: an application above :mod:`npu_fusion.plugin`.

The report, an application above :mod:`npu_fusion.plugin`: ``npu-fusion report``
(:mod:`.command`), :func:`explain` (one training step of the user's own module or function with
the pass, reported; :mod:`.explanation`), the full-size analysis of a transformers config on fake
tensors (:mod:`.fullsize`) and the HTML page (:mod:`.html`).

All of them run one step through :func:`.analysis.analyse` (or, on fake tensors, its assembly),
with what :mod:`npu_fusion.measure` measures (the recording backend, run counts, the gradient
criterion, the independent site counter), so the command line and ``explain`` print the same text
(:mod:`.text`) and serialize to the same JSON. What the step runs is a :class:`.subjects.Subject`:
a bundled decoder, a tiny transformers model, or the user's own.

Nothing in ``plugin/`` or ``measure/`` imports this package.
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
