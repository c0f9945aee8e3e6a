"""The report as an application above :mod:`npu_fusion.plugin`: :func:`explain` (one training step
of the user's own module or function with the pass, reported), the full-size analysis of a
transformers config on fake tensors (:mod:`.fullsize`) and the HTML page (:mod:`.html`).

Nothing in ``plugin/`` imports this package. The step, its recording backend, the gradient
comparison and the text tables are :mod:`npu_fusion.plugin.report`'s, which the command line's
report uses too (its :func:`~npu_fusion.plugin.report.analyse`), so both print the same text and
serialize to the same JSON.
"""
from .explanation import Explanation, explain

__all__ = ["Explanation", "explain"]
